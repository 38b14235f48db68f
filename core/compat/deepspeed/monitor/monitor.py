"""``deepspeed.monitor.monitor``: the ``Monitor`` base class and ``MonitorMaster``, which writes each event list to
every writer the config enables, on rank 0 only."""

from __future__ import annotations

from .base import Monitor
from .utils import rank

__all__ = ["Monitor", "MonitorMaster"]


class MonitorMaster(Monitor):
    """The enabled writers of a ``DeepSpeedMonitorConfig`` (built on rank 0 only; other ranks write nothing)."""

    def __init__(self, monitor_config):
        from .comet import CometMonitor
        from .csv_monitor import csvMonitor
        from .tensorboard import TensorBoardMonitor
        from .wandb import WandbMonitor

        super().__init__(monitor_config)
        self.enabled = monitor_config.enabled
        self.tb_monitor = self.wandb_monitor = self.csv_monitor = self.comet_monitor = None
        if rank() != 0:
            return
        if monitor_config.tensorboard.enabled:
            self.tb_monitor = TensorBoardMonitor(monitor_config.tensorboard)
        if monitor_config.wandb.enabled:
            self.wandb_monitor = WandbMonitor(monitor_config.wandb)
        if monitor_config.csv_monitor.enabled:
            self.csv_monitor = csvMonitor(monitor_config.csv_monitor)
        if monitor_config.comet.enabled:
            self.comet_monitor = CometMonitor(monitor_config.comet)

    def write_events(self, event_list):
        if rank() != 0:
            return
        for writer in (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor):
            if writer is not None:
                writer.write_events(event_list)
