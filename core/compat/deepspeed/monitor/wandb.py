"""``deepspeed.monitor.wandb``: ``WandbMonitor``, a Weights & Biases run started on rank 0 (building one needs the
``wandb`` package, as in DeepSpeed)."""

from __future__ import annotations

from .base import Monitor
from .utils import check_wandb_availability, rank


class WandbMonitor(Monitor):
    """The ``wandb`` section's writer: ``wandb.init(project, group, entity=team)`` when enabled."""

    def __init__(self, wandb_config):
        super().__init__(wandb_config)
        check_wandb_availability()
        import wandb

        self.enabled = wandb_config.enabled
        self.group = wandb_config.group
        self.team = wandb_config.team
        self.project = wandb_config.project
        if self.enabled and rank() == 0:
            wandb.init(project=self.project, group=self.group, entity=self.team)

    def log(self, data, step=None, commit=None):
        if self.enabled and rank() == 0:
            import wandb

            return wandb.log(data, step=step, commit=commit)
        return None

    def write_events(self, event_list):
        if self.enabled and rank() == 0:
            for name, value, step, *_ in event_list:
                self.log({name: value}, step=step)
