"""``deepspeed.monitor.tensorboard``: ``TensorBoardMonitor``, scalars under ``<output_path>/<job_name>`` written on
rank 0 (``torch.utils.tensorboard``; building one needs the ``tensorboard`` package, as in DeepSpeed)."""

from __future__ import annotations

import os

from .base import Monitor
from .utils import check_tb_availability, rank


class TensorBoardMonitor(Monitor):
    """The ``tensorboard`` section's writer; ``summary_writer`` is its ``SummaryWriter`` (rank 0, when enabled)."""

    def __init__(self, tensorboard_config):
        super().__init__(tensorboard_config)
        check_tb_availability()
        self.summary_writer = None
        self.enabled = tensorboard_config.enabled
        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        if self.enabled and rank() == 0:
            self.get_summary_writer()

    def get_summary_writer(self, base=None):
        """The ``SummaryWriter`` of ``<output_path>/<job_name>``, created on first use (rank 0, when enabled)."""
        if self.enabled and rank() == 0 and self.summary_writer is None:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = os.path.join(self.output_path, self.job_name)
            os.makedirs(log_dir, exist_ok=True)
            self.summary_writer = SummaryWriter(log_dir=log_dir)
        return self.summary_writer

    def write_events(self, event_list, flush=True):
        if self.enabled and self.summary_writer is not None and rank() == 0:
            for event in event_list:
                self.summary_writer.add_scalar(*event)
            if flush:
                self.summary_writer.flush()

    def flush(self):
        if self.enabled and self.summary_writer is not None and rank() == 0:
            self.summary_writer.flush()
