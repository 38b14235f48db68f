"""``deepspeed.utils.comms_logging``: DeepSpeed's communication logger.

``deepspeed.comm`` times each collective while the logger is enabled (the ``comms_logger`` section of the config,
or ``deepspeed.comm.configure(enabled=True)``) and profiles it (every operation with ``prof_all``, those named in
``prof_ops``, or a call with ``prof=True``). Each record is kept by name and message size as DeepSpeed keeps it:
``comms_dict[name][bytes] = [count, [latency ms], [algbw Gbps], [busbw Gbps]]``, index ``i`` of the three lists
being the ``i``-th call. The bandwidths follow DeepSpeed's formulas (those of nccl-tests: an all-reduce moves
``2 (n-1)/n`` of the message per rank, an all-gather ``(n-1)/n`` of ``n`` messages, ...).

What is logged are the script's own ``deepspeed.comm`` calls: the torsh engine reduces gradients through
``torch.distributed`` directly, so its communication is not in the log (DeepSpeed's engine calls its own
``deepspeed.comm``, whose records then include the gradient reductions).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from pydantic import Field

from ..runtime.config_utils import DeepSpeedConfigModel

COMMS_LOGGER = "comms_logger"


def get_caller_func(frame: int = 3) -> str:
    """The name of the function ``frame`` calls up the stack (the caller a ``debug`` record is named after)."""
    return sys._getframe(frame).f_code.co_name


def print_rank_0(message) -> None:
    import torch.distributed as comm  # the process group deepspeed.comm runs on (no import cycle)

    if not comm.is_initialized() or comm.get_rank() == 0:
        print(message)


def convert_size(size_bytes) -> str:
    """A byte count for people: ``"1.5 KB"``, ``"678.86 MB"`` (powers of 1024), ``"0B"`` for nothing."""
    if size_bytes == 0:
        return "0B"
    units = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    power = min(int(math.floor(math.log(size_bytes, 1024))), len(units) - 1)
    return f"{round(size_bytes / math.pow(1024, power), 2)} {units[power]}"


#: How many message sizes each rank moves, per operation: (factor of the algorithm bandwidth, factor of the bus
#: bandwidth as a function of the world size n, whether the message is per rank and the total is n of them).
_ALL_TO_ALL = (1, lambda n: (n - 1) / n, False)
_GATHERING = (1, lambda n: (n - 1) / n, True)
_REDUCING = (2, lambda n: 2 * (n - 1) / n, False)
_POINT = (1, lambda n: 1, False)
_BANDWIDTH_RULES = {
    **dict.fromkeys(("all_to_all_single", "all_to_all"), _ALL_TO_ALL),
    **dict.fromkeys(("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"), _GATHERING),
    **dict.fromkeys(("all_reduce", "all_reduce_coalesced", "inference_all_reduce"), _REDUCING),
    # DeepSpeed stops the process for the object collectives and the monitored barrier (no formula); they move
    # no tensor argument, so their message size is 0 and any formula gives 0
    **dict.fromkeys(("send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast", "broadcast_object_list",
                     "reduce", "gather", "scatter", "barrier", "monitored_barrier", "all_gather_object"), _POINT),
}


def calc_bw_log(comm_op: str, size, duration) -> tuple[float, float]:
    """The algorithm and bus bandwidths (Gbps) of ``comm_op`` moving ``size`` bytes in ``duration`` ms over the
    default group's world size, by DeepSpeed's formulas."""
    import torch.distributed as comm  # the process group deepspeed.comm runs on (no import cycle)

    if comm_op not in _BANDWIDTH_RULES:
        raise ValueError(f"calc_bw_log: no bandwidth formula for the operation {comm_op!r}; the logged operations "
                         f"are {sorted(_BANDWIDTH_RULES)}")  # fmt: skip
    n = comm.get_world_size() if comm.is_initialized() else 1
    alg_factor, bus_factor, per_rank = _BANDWIDTH_RULES[comm_op]
    if per_rank:
        size *= n
    duration = max(duration, 1e-9)  # a timer that reads 0 (coarse clock): no division by zero
    algbw = size * alg_factor / duration
    busbw = size / duration * bus_factor(n) if n > 0 else 0.0
    # bytes per ms -> Gbit/s
    return algbw * 8 / 1e6, busbw * 8 / 1e6


class CommsLoggerConfig(DeepSpeedConfigModel):
    """The ``comms_logger`` section of a DeepSpeed config."""

    enabled: bool = False
    prof_all: bool = True
    prof_ops: list = Field(default_factory=list)
    verbose: bool = False
    debug: bool = False


class DeepSpeedCommsConfig:
    """Whether a config (dict) has a ``comms_logger`` section, and that section read (``comms_logger``)."""

    def __init__(self, ds_config: dict):
        self.comms_logger_enabled = COMMS_LOGGER in ds_config
        if self.comms_logger_enabled:
            self.comms_logger = CommsLoggerConfig(**ds_config[COMMS_LOGGER])


class CommsLogger:
    """The records of the profiled collectives (see the module docstring) and the switches that choose them."""

    def __init__(self):
        defaults = CommsLoggerConfig()
        self.comms_dict: dict[str, dict[int, list]] = {}
        self.verbose = defaults.verbose
        self.debug = defaults.debug
        self.prof_ops = list(defaults.prof_ops)
        self.prof_all = defaults.prof_all
        self.enabled = defaults.enabled

    def configure(self, comms_config: DeepSpeedCommsConfig) -> None:
        """Take the switches of a config's ``comms_logger`` section. The section's ``enabled`` decides (DeepSpeed
        0.19.8 enables the logger for any ``comms_logger`` section, even one that says ``"enabled": false``)."""
        if not comms_config.comms_logger_enabled:
            return
        section = comms_config.comms_logger
        self.enabled = section.enabled
        if self.enabled:
            self.verbose, self.debug = section.verbose, section.debug
            self.prof_ops, self.prof_all = list(section.prof_ops), section.prof_all

    # Three ways to choose what is profiled: everything, by operation name, or one call (prof=True)
    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list) -> None:
        self.prof_ops = list(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def should_profile(self, log_name: str, prof: bool) -> bool:
        """Whether a call named ``log_name`` (``prof``: its own ``prof=`` argument) is recorded."""
        return self.enabled and (prof or self.prof_all or log_name in self.prof_ops)

    def append(self, raw_name: str, record_name: str, latency: float, msg_size: int) -> None:
        """Record one call of the operation ``raw_name`` (which decides the bandwidth formula) under
        ``record_name``: ``latency`` ms moving ``msg_size`` bytes."""
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency)
        record = self.comms_dict.setdefault(record_name, {}).setdefault(msg_size, [0, [], [], []])
        record[0] += 1
        record[1].append(latency)
        record[2].append(algbw)
        record[3].append(busbw)
        if self.verbose:
            from . import log_dist

            log_dist(f"comm op: {record_name} | time (ms): {latency:.2f} | msg size: {convert_size(msg_size)} | "
                     f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}", [0])  # fmt: skip

    def get_raw_data(self) -> dict:
        """The records: ``{name: {bytes: [count, [latencies], [algbws], [busbws]]}}`` (a shallow copy)."""
        return self.comms_dict.copy()

    def has_data(self) -> bool:
        return len(self.comms_dict) > 0

    def reset_data(self) -> None:
        self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict.keys())

    def get_total_operations(self) -> int:
        return sum(record[0] for sizes in self.comms_dict.values() for record in sizes.values())

    def get_operation_summary(self, operation_name: str) -> dict | None:
        """Per message size of ``operation_name``: count, total and trimmed-mean latency, mean bandwidths (None when
        the operation has no record). The records are not changed."""
        if operation_name not in self.comms_dict:
            return None
        return {size: _summary(size, record) for size, record in self.comms_dict[operation_name].copy().items()}

    def log_all(self, print_log: bool = True, show_straggler: bool = False, return_dict: bool = False) -> Any:
        """Print (``print_log``) and/or return (``return_dict``) the summary of every record, as DeepSpeed's
        ``log_summary`` table. ``show_straggler`` adds, per record, the latency of the fastest rank and how much
        longer this rank took: an all-reduce over the default group, so every rank must call it."""
        import datetime

        import torch.distributed as comm  # the process group deepspeed.comm runs on (no import cycle)

        snapshot = self.comms_dict.copy()
        result = {"summary": {}, "straggler_analysis": None,
                  "metadata": {"world_size": comm.get_world_size() if comm.is_initialized() else 1,
                               "rank": comm.get_rank() if comm.is_initialized() else 0,
                               "timestamp": datetime.datetime.now().isoformat()}}  # fmt: skip
        columns = ("Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
                   "busbw_avg (Gbps)")  # fmt: skip
        if print_log:
            print(f"{'Comm. Op': <20}" + "".join(f"{c: <20}" for c in columns))
        for name, sizes in snapshot.items():
            if print_log:
                print(name)
            result["summary"][name] = {}
            for size, record in sorted(sizes.items()):
                row = result["summary"][name][size] = _summary(size, record)
                if print_log:
                    print(f"{' ': <20}{row['msg_size_str']: <20}{row['count']: <20}{row['total_latency_ms']: <20.2f}"
                          f"{row['avg_latency_ms']: <20.2f}{row['tput_avg_gbps']: <20.2f}"
                          f"{row['busbw_avg_gbps']: <20.2f}")  # fmt: skip
        if show_straggler:
            result["straggler_analysis"] = _stragglers(snapshot, print_log)
        return result if return_dict else None


def _summary(size: int, record: list) -> dict:
    from .timer import trim_mean

    return {"count": record[0], "total_latency_ms": sum(record[1]), "avg_latency_ms": trim_mean(record[1], 0.1),
            "tput_avg_gbps": trim_mean(record[2], 0.1), "busbw_avg_gbps": trim_mean(record[3], 0.1),
            "msg_size_bytes": size, "msg_size_str": convert_size(size)}  # fmt: skip


def _check_same_records(comm, snapshot: dict) -> None:
    """One all-gather of every rank's (op, message size, latency count) list, in the order the all-reduces below
    walk it; a ValueError (on every rank alike) when they differ, instead of mismatched all-reduces that hang."""
    layout = [(name, size, len(record[1]))
              for name, sizes in snapshot.items() for size, record in sorted(sizes.items())]  # fmt: skip
    every = [None] * comm.get_world_size()
    comm.all_gather_object(every, layout)
    differing = [rank for rank, theirs in enumerate(every) if theirs != every[0]]
    if differing:
        raise ValueError(f"show_straggler needs the same communication records on every rank, in the same order "
                         f"(op, message size, number of latencies); ranks {differing} differ from rank 0: "
                         f"rank 0 has {every[0]}, rank {differing[0]} has {every[differing[0]]}")  # fmt: skip


def _stragglers(snapshot: dict, print_log: bool) -> dict:
    """Per record: the fastest rank's latencies (an all-reduce MIN over the default group) and this rank's excess."""
    import torch

    import torch.distributed as comm  # the process group deepspeed.comm runs on (no import cycle)
    from ..accelerator import get_accelerator
    from .timer import trim_mean

    if print_log:
        print("_______________________________\nBreakdown with straggler effect\n-------------------------------")
        print(f"{'Comm. Op': <20}{'Message Size': <20}{'Count': <20}{'Total comm lat(ms)': <20}"
              f"{'Total straggler(ms)': <20}{'Avg comm lat(ms)': <20}{'Avg straggler(ms)': <20}")  # fmt: skip
    device = get_accelerator().current_device_name()
    if comm.is_initialized():
        _check_same_records(comm, snapshot)
    out: dict = {}
    for name, sizes in snapshot.items():
        if print_log:
            print(name)
        out[name] = {}
        for size, record in sorted(sizes.items()):
            mine = torch.tensor(record[1], device=device, dtype=torch.float64)
            fastest = mine.clone()
            if comm.is_initialized():  # every rank holds the same records, in the same order, as DeepSpeed needs
                torch.distributed.all_reduce(fastest, op=torch.distributed.ReduceOp.MIN)
            excess = mine - fastest
            row = out[name][size] = {
                "count": record[0], "total_comm_lat_ms": fastest.sum().item(),
                "total_straggler_ms": excess.sum().item(), "avg_comm_lat_ms": trim_mean(fastest.tolist(), 0.1),
                "avg_straggler_ms": trim_mean(excess.tolist(), 0.1), "msg_size_bytes": size,
                "msg_size_str": convert_size(size)}  # fmt: skip
            if print_log:
                print(f"{' ': <20}{row['msg_size_str']: <20}{row['count']: <20}{row['total_comm_lat_ms']: <20.2f}"
                      f"{row['total_straggler_ms']: <20.2f}{row['avg_comm_lat_ms']: <20.2f}"
                      f"{row['avg_straggler_ms']: <20.2f}")  # fmt: skip
    return out
