"""``deepspeed.monitor.comet``: ``CometMonitor``, a Comet experiment started on rank 0 with ``comet_ml.start``;
each metric is logged at its first event and then once ``samples_log_interval`` more samples have passed (the
event's step is the engine's global sample count). Building one needs ``comet_ml`` >= 3.41, as in DeepSpeed."""

from __future__ import annotations

from typing import Any

from .base import Monitor
from .utils import check_comet_availability, rank


class CometMonitor(Monitor):
    """The ``comet`` section's writer; ``experiment`` is the started experiment (rank 0, when enabled)."""

    def __init__(self, comet_config):
        super().__init__(comet_config)
        check_comet_availability()
        import comet_ml

        self.enabled = comet_config.enabled
        self._samples_log_interval = comet_config.samples_log_interval
        self._experiment = None
        if self.enabled and rank() == 0:
            self._experiment = comet_ml.start(api_key=comet_config.api_key, project=comet_config.project,
                                              workspace=comet_config.workspace,
                                              experiment_key=comet_config.experiment_key, mode=comet_config.mode,
                                              online=comet_config.online)  # fmt: skip
            if comet_config.experiment_name is not None:
                self._experiment.set_name(comet_config.experiment_name)
        self._last_logged: dict[str, int] = {}

    @property
    def experiment(self) -> Any:
        return self._experiment

    @property
    def samples_log_interval(self) -> int:
        return self._samples_log_interval

    def write_events(self, event_list) -> None:
        if not self.enabled or rank() != 0:
            return
        for name, value, samples, *_ in event_list:
            if self._due(name, samples):
                self._experiment.__internal_api__log_metric__(name=name, value=value, step=samples)

    def _due(self, name: str, samples: int) -> bool:
        last = self._last_logged.get(name)
        if last is None or samples - last >= self._samples_log_interval:
            self._last_logged[name] = samples
            return True
        return False
