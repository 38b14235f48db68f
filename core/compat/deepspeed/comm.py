"""``deepspeed.comm`` on ``torch.distributed``: the same names and signatures (DeepSpeed 0.19.8).

The communication logger (``comms_logger``, :mod:`deepspeed.utils.comms_logging`) is DeepSpeed's: ``configure``
switches it on (from a config's ``comms_logger`` section or by argument), and while it is on each collective here
waits for the device before and after it and records its latency, message size and bandwidths under its
``log_name`` (``prof=True`` profiles one call; ``debug`` adds the calling function to the name); ``log_summary``
prints the table. An ``async_op`` call is timed to its launch, as in DeepSpeed (the host does not wait for it).
``ReduceOp.AVG`` on a backend without it (gloo) is a sum divided by the group size, as DeepSpeed does.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import sys
import time
from enum import Enum

import torch
import torch.distributed as dist
from torch.distributed import P2POp, ProcessGroup  # noqa: F401  (DeepSpeed re-exports them)

from torsh.engine.initialize import init_distributed as _init_distributed

from .utils.comms_logging import CommsLogger, DeepSpeedCommsConfig
from .utils.timer import SynchronizedWallClockTimer

#: The communication logger every collective of this module reports to (DeepSpeed's ``deepspeed.comm.comms_logger``).
comms_logger = CommsLogger()
timers = SynchronizedWallClockTimer()
timer_summary: dict = {}


class ReduceOp(Enum):
    """DeepSpeed's reduction enum; torch's ``dist.ReduceOp`` values are accepted as well."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


def _torch_op(op):
    if isinstance(op, ReduceOp):
        if op is ReduceOp.UNUSED:
            raise ValueError("deepspeed.comm.ReduceOp.UNUSED is not a reduction; use SUM, AVG, MIN, MAX, ...")
        return getattr(dist.ReduceOp, op.name)
    return op


def _is_avg(op) -> bool:
    return op is ReduceOp.AVG or op == dist.ReduceOp.AVG


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500, verbose=True,
                     timeout=datetime.timedelta(minutes=30), init_method=None, dist_init_required=None, config=None,
                     rank=-1, world_size=-1):  # fmt: skip
    """Start the default process group unless one exists (NCCL with a GPU, gloo on CPU). A process group the script
    started itself is used as it is, whatever the environment says (DeepSpeed returns before looking at it)."""
    if dist.is_available() and dist.is_initialized():
        return
    _init_distributed(dist_backend=dist_backend, distributed_port=distributed_port, timeout=timeout,
                      init_method=init_method, dist_init_required=dist_init_required)  # fmt: skip


def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None):
    """Set the communication logger: from ``deepspeed_config`` (a ``DeepSpeedConfig``, or a config dict) when it has
    a ``comms_logger`` section, then each switch given as an argument."""
    if deepspeed_config is not None:
        comms_logger.configure(_comms_config(deepspeed_config))
    for name, value in (("enabled", enabled), ("prof_all", prof_all), ("prof_ops", prof_ops), ("verbose", verbose),
                        ("debug", debug)):  # fmt: skip
        if value is not None:
            setattr(comms_logger, name, value)


def _comms_config(config) -> DeepSpeedCommsConfig:
    if isinstance(getattr(config, "comms_config", None), DeepSpeedCommsConfig):
        return config.comms_config
    as_dict = config if isinstance(config, dict) else getattr(config, "_param_dict", None)
    if not isinstance(as_dict, dict):
        raise TypeError(f"deepspeed.comm.configure(deepspeed_config=...) takes a DeepSpeedConfig or a config dict, "
                        f"not {type(config).__name__}")  # fmt: skip
    return DeepSpeedCommsConfig(as_dict)


#: The argument whose tensors make a call's message size, as DeepSpeed counts it (the first one a function has).
_MESSAGE_ARGUMENTS = ("tensor", "tensors", "input_list", "input_tensor_list", "p2p_op_list")


def _message_bytes(value) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_message_bytes(getattr(item, "tensor", item)) for item in value)
    return value.element_size() * value.nelement() if isinstance(value, torch.Tensor) else 0


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(func):
    """``func`` reporting to :data:`comms_logger`: nothing more than a flag test while the logger is off."""
    signature = inspect.signature(func)
    default_name = signature.parameters["log_name"].default if "log_name" in signature.parameters else func.__name__
    message = next((name for name in _MESSAGE_ARGUMENTS if name in signature.parameters), None)

    @functools.wraps(func)
    def logged(*args, **kwargs):
        if not comms_logger.enabled:
            return func(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs).arguments
        name = arguments.get("log_name", default_name)
        if not comms_logger.should_profile(name, bool(arguments.get("prof", False))):
            try:
                return func(*args, **kwargs)
            finally:
                _synchronize()  # DeepSpeed waits for the device after every call while the logger is on
        if comms_logger.debug:
            name = f"{name} | [Caller Func: {sys._getframe(1).f_code.co_name}]"
        size = _message_bytes(arguments.get(message)) if message else 0
        _synchronize()
        start = time.perf_counter()
        result = func(*args, **kwargs)
        _synchronize()
        comms_logger.append(func.__name__, name, (time.perf_counter() - start) * 1000.0, size)
        return result

    return logged


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group=None) -> None:
    dist.destroy_process_group(group)


def new_group(ranks):
    return dist.new_group(ranks)


def get_world_group():
    return dist.group.WORLD


def get_world_size(group=None) -> int:
    return dist.get_world_size(group)


def get_rank(group=None) -> int:
    return dist.get_rank(group)


def get_local_rank() -> int:
    """This process's rank on its node, from the launcher's environment (DeepSpeed reads ``LOCAL_RANK``)."""
    from torsh.ranks import discover

    return discover().local_rank


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_all_ranks_from_group(group=None) -> list[int]:
    return dist.get_process_group_ranks(group or dist.group.WORLD)


@_timed
def barrier(group=None, async_op=False, device_ids=None, prof=False, log_name="barrier", debug=None):
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


@_timed
def monitored_barrier(group=None, timeout=None, wait_all_ranks=False, prof=False, log_name="monitored_barrier",
                      debug=None):  # fmt: skip
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


@_timed
def broadcast(tensor, src, group=None, async_op=False, prof=False, log_name="broadcast", debug=None):
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


@_timed
def broadcast_object_list(object_list, src, group=None, device=None, prof=False, log_name="broadcast_object_list",
                          debug=None):  # fmt: skip
    return dist.broadcast_object_list(object_list, src=src, group=group, device=device)


@_timed
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="all_reduce", debug=None):
    if _is_avg(op) and dist.get_backend(group) == "gloo":
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor.div_(dist.get_world_size(group))
        return work if async_op else None
    return dist.all_reduce(tensor, op=_torch_op(op), group=group, async_op=async_op)


@_timed
def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None, prof=False, log_name="all_reduce",
                         debug=None):  # fmt: skip
    return all_reduce.__wrapped__(tensor, op=op, group=group)  # one record (the call's)


@_timed
def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
                         log_name="all_reduce", debug=None):  # fmt: skip
    for t in tensors:
        all_reduce.__wrapped__(t, op=op, group=group)


@_timed
def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="reduce", debug=None):
    return dist.reduce(tensor, dst=dst, op=_torch_op(op), group=group, async_op=async_op)


@_timed
def all_gather(tensor_list, tensor, group=None, async_op=False, prof=False, log_name="all_gather", debug=None):
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


@_timed
def all_gather_object(object_list, obj, group=None, prof=False, log_name="all_gather_object", debug=None):
    return dist.all_gather_object(object_list, obj, group=group)


@_timed
def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, prof=False,
                           log_name="all_gather_into_tensor", debug=None):  # fmt: skip
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather_coalesced(output_tensors, input_tensors, group=None, async_op=False):
    for out, inp in zip(output_tensors, input_tensors):
        dist.all_gather_into_tensor(out, inp, group=group)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return False


@_timed
def reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
                          log_name="reduce_scatter_tensor", debug=None):  # fmt: skip
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=_torch_op(op), group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, debug=None):
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


@_timed
def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, prof=False,
                   log_name="reduce_scatter", debug=None):  # fmt: skip
    return dist.reduce_scatter(output, input_list, op=_torch_op(op), group=group, async_op=async_op)


@_timed
def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False,
                      prof=False, log_name="all_to_all_single", debug=None):  # fmt: skip
    return dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=async_op)  # fmt: skip


@_timed
def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False, prof=False, log_name="all_to_all",
               debug=None):  # fmt: skip
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


@_timed
def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, prof=False, log_name="gather", debug=None):
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


@_timed
def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, prof=False, log_name="scatter", debug=None):
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


@_timed
def send(tensor, dst, group=None, tag=0, prof=False, log_name="send", debug=None):
    return dist.send(tensor, dst=dst, group=group, tag=tag)


@_timed
def recv(tensor, src=None, group=None, tag=0, prof=False, log_name="recv", debug=None):
    return dist.recv(tensor, src=src, group=group, tag=tag)


@_timed
def isend(tensor, dst, group=None, tag=0, prof=False, log_name="isend", debug=None):
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


@_timed
def irecv(tensor, src=None, group=None, tag=0, prof=False, log_name="irecv", debug=None):
    return dist.irecv(tensor, src=src, group=group, tag=tag)


@_timed
def batch_isend_irecv(p2p_op_list, prof=False, log_name="batch_isend_irecv", debug=None):
    return dist.batch_isend_irecv(p2p_op_list)


def log_summary(show_straggler=False, return_dict=False):
    """Print the communication log on rank 0 (:meth:`CommsLogger.log_all`); with ``return_dict`` every rank returns
    its summary. Collective (barriers around it; ``show_straggler`` all-reduces the latencies): call on every rank."""
    if not is_initialized():
        return comms_logger.log_all(print_log=True, show_straggler=show_straggler, return_dict=return_dict)
    barrier(log_name="log_summary_barrier")
    result = comms_logger.log_all(print_log=get_rank() == 0, show_straggler=show_straggler, return_dict=return_dict)
    barrier(log_name="log_summary_barrier")
    return result


def reset_log() -> None:
    """Forget the communication records (to summarise each epoch or interval on its own)."""
    comms_logger.reset_data()


def get_world_size_from_launcher() -> int:
    from torsh.ranks import discover

    return discover().world_size


def get_world_rank_from_launcher() -> int:
    from torsh.ranks import discover

    return discover().rank


def get_local_rank_from_launcher() -> int:
    return get_local_rank()


__all__ = [n for n in dir() if not n.startswith("_")
           and n not in ("annotations", "datetime", "Enum", "torch", "dist", "sys", "functools", "inspect", "time")]  # fmt: skip

# DeepSpeed's ``deepspeed.comm`` is a package whose functions live in ``deepspeed.comm.comm``; scripts reach them
# there too (``deepspeed.comm.comm.is_initialized()``, ``from deepspeed.comm import comm``).
comm = sys.modules[__name__]
