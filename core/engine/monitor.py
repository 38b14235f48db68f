"""``engine.monitor``: DeepSpeed's ``MonitorMaster`` surface, for scripts that log their own metrics through it.

``write_events([(name, value, step), ...])`` writes on rank 0, as DeepSpeed's does: CSV files laid out as DeepSpeed's
``csv_monitor`` (``<output_path>/<job_name>/<name with / and spaces as _>.csv``, a ``step,<last part of the name>``
header, then one row per event), and TensorBoard scalars when the ``tensorboard`` package is installed. wandb is
not written; that is said once, at the first event. The engine writes no events of its own.
"""

from __future__ import annotations

import csv
import logging
import os
import time
from typing import Any

from torsh.config import MonitoringConfig

log = logging.getLogger("torsh.engine")


class Monitor:
    """Where ``write_events`` goes: the writers the config enables (nothing when none is, as in DeepSpeed)."""

    def __init__(self, monitoring: MonitoringConfig, rank: int):
        self.enabled = monitoring.tensorboard.enabled or monitoring.csv.enabled or monitoring.wandb.enabled
        self._rank = rank
        self._csv_dir = None
        self._csv_files: set[str] = set()
        self._tensorboard = None
        self._unwritten = ["wandb"] if monitoring.wandb.enabled else []
        if rank != 0:
            return
        if monitoring.csv.enabled:
            self._csv_dir = os.path.join(monitoring.csv.output_path, monitoring.csv.job_name)
            os.makedirs(self._csv_dir, exist_ok=True)
        if monitoring.tensorboard.enabled:
            self._tensorboard = _summary_writer(os.path.join(monitoring.tensorboard.output_path,
                                                             monitoring.tensorboard.job_name))  # fmt: skip
            if self._tensorboard is None:
                self._unwritten.append("tensorboard (the tensorboard package is not installed)")

    def write_events(self, event_list: list[tuple[Any, ...]]) -> None:
        """Write ``(name, value, step)`` events on rank 0; other ranks write nothing."""
        if self._rank != 0:
            return
        if self._unwritten:
            log.warning("engine.monitor: %s is not written by the torsh engine", ", ".join(self._unwritten))
            self._unwritten = []
        for name, value, step, *_ in event_list:
            if self._csv_dir is not None:
                self._write_csv(str(name), value, step)
            if self._tensorboard is not None:
                self._tensorboard.add_scalar(name, value, step)
        if self._tensorboard is not None:
            self._tensorboard.flush()

    def _write_csv(self, name: str, value: Any, step: Any) -> None:
        filename = name.replace("/", "_").replace(" ", "_")
        with open(os.path.join(self._csv_dir, filename + ".csv"), "a+", newline="") as handle:
            writer = csv.writer(handle)
            if filename not in self._csv_files:
                self._csv_files.add(filename)
                writer.writerow(["step", name.split("/")[-1]])
            writer.writerow([step, value])


def _summary_writer(log_dir: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=log_dir)


class ThroughputTimer:
    """DeepSpeed's ``engine.tput_timer``: started by ``engine(...)``, stopped by ``engine.step()``; the first
    ``start_step`` optimizer steps (warm-up) are not timed. Wall-clock host time (no device synchronisation)."""

    def __init__(self, batch_size: int, start_step: int = 2, steps_per_output: int | None = None):
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.initialized = False
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0

    def update_epoch_count(self) -> None:
        """Count an epoch and restart the micro-step count."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """Start timing a micro-step (from the ``start_step``-th optimizer step on)."""
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End the micro-step; ``global_step`` when it completed an optimizer step."""
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed steps (``-inf`` before the first optimizer step, as DeepSpeed)."""
        if self.global_step_count > 0:
            timed_steps = self.global_step_count - self.start_step
            if timed_steps <= 0 or self.total_elapsed_time <= 0:
                return 0.0
            return self.batch_size / (self.total_elapsed_time / timed_steps)
        return float("-inf")
