"""``deepspeed.monitor.csv_monitor``: ``csvMonitor``, one CSV file per metric under ``<output_path>/<job_name>``
(``step,<last part of the name>`` header, then a row per event), written on rank 0 by the torsh engine's CSV
writer."""

from __future__ import annotations

import os

from torsh.config import MonitoringConfig
from torsh.engine.monitor import Monitor as _EngineMonitor

from .base import Monitor
from .utils import rank


class csvMonitor(Monitor):  # noqa: N801 (DeepSpeed's name)
    """The ``csv_monitor`` section's writer."""

    def __init__(self, csv_config):
        super().__init__(csv_config)
        self.filenames: list[str] = []
        self.enabled = csv_config.enabled
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self._writer = None
        self.log_dir = self.setup_log_dir()

    def setup_log_dir(self, base=None):
        """Create ``<output_path>/<job_name>`` on rank 0 when enabled; that directory (None elsewhere)."""
        if not (self.enabled and rank() == 0):
            return None
        section = {"enabled": True, "output_path": self.output_path, "job_name": self.job_name}
        self._writer = _EngineMonitor(MonitoringConfig(csv=section), rank=0)
        return os.path.join(self.output_path, self.job_name)

    def write_events(self, event_list):
        """Append each ``(name, value, step)`` to its metric's file (rank 0, when enabled)."""
        if self._writer is None or rank() != 0:
            return
        self._writer.write_events(event_list)
        for name, *_ in event_list:
            filename = str(name).replace("/", "_").replace(" ", "_")
            if filename not in self.filenames:
                self.filenames.append(filename)
