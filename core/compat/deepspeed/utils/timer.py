"""``deepspeed.utils.timer``: DeepSpeed's named wall-clock timers and ``trim_mean``.

``SynchronizedWallClockTimer()(name)`` is a timer that waits for the device's queued work at ``start`` and
``stop`` (so it measures the work, not the launch), elapsed times in milliseconds as DeepSpeed reports them.
``trim_mean(data, trim_percent)`` is the mean without the ``trim_percent`` smallest and largest values (the
communication logger's averages); it never reorders the list it is given. ``NoopTimer`` is the stand-in DeepSpeed
uses when timing is off. The engine's throughput timer is ``engine.tput_timer``.
"""

from __future__ import annotations

import time
from statistics import mean

import torch

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"
TIME_EPSILON = 1e-6


def trim_mean(data, trim_percent):
    """The mean of ``data`` without its ``round(len * trim_percent)`` smallest and largest values (0 for an empty
    list). ``data`` is left as it was: the logger's latency and bandwidth lists are parallel, index by index."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_mean: trim_percent must be between 0 and 1, got {trim_percent}")
    n = len(data)
    if n == 0:
        return 0
    k = int(round(n * trim_percent))
    kept = sorted(data)[k:n - k]
    if not kept:
        raise ValueError(f"trim_mean: trimming {trim_percent} from both ends of {n} values leaves none")
    return mean(kept)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Timer:
    """One named timer: ``start``/``stop`` pairs add up until ``reset``; times in milliseconds."""

    def __init__(self, name: str):
        self.name_ = name
        self.started_ = False
        self._start = 0.0
        self._elapsed = 0.0
        self._records: list[float] = []

    def start(self) -> None:
        if self.started_:
            raise RuntimeError(f"timer {self.name_!r} has already been started")
        _synchronize()
        self._start = time.perf_counter()
        self.started_ = True

    def stop(self, reset: bool = False, record: bool = False) -> None:
        if not self.started_:
            raise RuntimeError(f"timer {self.name_!r} is not started")
        _synchronize()
        took = (time.perf_counter() - self._start) * 1000.0
        self._elapsed = took if reset else self._elapsed + took
        if record:
            self._records.append(took)
        self.started_ = False

    def reset(self) -> None:
        self.started_ = False
        self._elapsed = 0.0
        self._records = []

    def elapsed(self, reset: bool = True) -> float:
        """The time added up so far (ms, a running interval included); ``reset`` starts the count again."""
        running = self.started_
        if running:
            self.stop()
        value = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start()
        return value

    def mean(self) -> float:
        """The trimmed mean of the recorded intervals (``stop(record=True)``), ms."""
        return trim_mean(self._records, 0.1)


class SynchronizedWallClockTimer:
    """Named timers: ``timers("fwd").start()`` ... ``.stop()``; ``log(names)`` prints their elapsed times."""

    def __init__(self):
        self.timers: dict[str, _Timer] = {}

    def __call__(self, name: str) -> _Timer:
        if name not in self.timers:
            self.timers[name] = _Timer(name)
        return self.timers[name]

    def get_timers(self) -> dict[str, _Timer]:
        return self.timers

    @staticmethod
    def memory_usage() -> str:
        if not torch.cuda.is_available():
            return ""
        gib = 1024**3
        return (f" | mem_allocated: {torch.cuda.memory_allocated() / gib:.4f} GB | max_mem_allocated: "
                f"{torch.cuda.max_memory_allocated() / gib:.4f} GB")  # fmt: skip

    def log(self, names, normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks=None) -> None:  # fmt: skip
        """Log the elapsed time of each named timer (divided by ``normalizer``) on ``ranks`` (rank 0 by default)."""
        from . import log_dist

        if normalizer <= 0.0:
            raise ValueError(f"SynchronizedWallClockTimer.log: normalizer must be > 0, got {normalizer}")
        parts = [f"{name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
                 for name in names if name in self.timers]  # fmt: skip
        line = "time (ms) | " + " | ".join(parts)
        if memory_breakdown:
            line += self.memory_usage()
        log_dist(line, ranks=ranks or [0])

    def get_mean(self, names, normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        if normalizer <= 0.0:
            raise ValueError(f"SynchronizedWallClockTimer.get_mean: normalizer must be > 0, got {normalizer}")
        means = {}
        for name in names:
            if name in self.timers:
                means[name] = self.timers[name].mean() * 1000.0 / normalizer
                if reset:
                    self.timers[name].reset()
        return means


class NoopTimer:
    """The timers DeepSpeed hands out when ``wall_clock_breakdown`` is off: every call does nothing."""

    class Timer:
        def start(self) -> None: ...

        def reset(self) -> None: ...

        def stop(self, **kwargs) -> None: ...

        def elapsed(self, **kwargs) -> float:
            return 0

        def mean(self) -> float:
            return 0

    def __init__(self):
        self.timer = self.Timer()

    def __call__(self, name: str) -> "NoopTimer.Timer":
        return self.timer

    def get_timers(self) -> dict:
        return {}

    def log(self, names, normalizer=1.0, reset=True, memory_breakdown=False, ranks=None) -> None: ...

    def get_mean(self, names, normalizer=1.0, reset=True) -> dict:
        return {}
