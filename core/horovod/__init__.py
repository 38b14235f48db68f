"""The Horovod PyTorch API on torch.distributed: replace ``import horovod.torch as hvd`` with
``import torsh.horovod as hvd`` and run the script under torchrun (or horovodrun, mpirun, srun).

What is exact, approximate and unsupported (each function's docstring has the details):

* exact: ``init`` / ``shutdown`` / ``is_initialized``, ``size``, ``rank``, ``local_rank``, ``local_size``,
  ``cross_rank``, ``cross_size``, ``is_homogeneous``; ``DistributedOptimizer`` numerics (Average as
  prescale 1/f, sum, postscale f/size; Sum, Min, Max, Product; ``Compression.none`` / ``fp16``;
  ``backward_passes_per_step`` accumulation; ``named_parameters`` checks; ``synchronize`` /
  ``skip_synchronize``; ``zero_grad`` and over-accumulation errors); ``allreduce`` / ``allreduce_``,
  ``allgather`` (uneven first dimensions), ``broadcast`` / ``broadcast_`` and their gradients;
  ``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object``, ``allgather_object``,
  ``barrier``, the ``*_async`` / ``synchronize`` / ``poll`` handles.
* approximate: gradients are fused into fixed buckets (``HOROVOD_FUSION_THRESHOLD`` bytes, reverse
  parameter order) launched in bucket order from the backward hooks, where Horovod fuses whatever is ready
  each cycle (same numbers; a bucket waits for the ones before it); ``groups`` is only validated; sparse
  gradients are reduced densely; ``join`` returns the last rank but joined ranks do not serve others'
  allreduces.
* unsupported (a clear error): ``op=Adasum``, process sets other than the global one, ``init(comm=...)``,
  the timeline (``start_timeline``), ``hvd.elastic``.
"""

try:  # a clear error naming the extra when PyTorch is missing (the rest of this package needs it)
    import torch  # noqa: F401
except ModuleNotFoundError as _exc:
    from torsh import _torch_missing

    raise _torch_missing("torsh.horovod", _exc) from None

from ._basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from ._ops import (
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    global_process_set,
    grouped_allreduce,
    grouped_allreduce_,
    join,
    poll,
    synchronize,
)
from ._optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters

# Horovod names this module does not provide, and what to do instead (a clear message, not a bare AttributeError).
_NOT_PROVIDED = {
    "elastic": "Horovod elastic training; use torchrun --nnodes MIN:MAX with --max-restarts and reload a checkpoint",
    "add_process_set": "process sets; every collective runs over all ranks",
    "remove_process_set": "process sets; every collective runs over all ranks",
    "alltoall": "alltoall; use torch.distributed.all_to_all_single",
    "reducescatter": "reducescatter; use torch.distributed.reduce_scatter_tensor",
    "grouped_reducescatter": "reducescatter; use torch.distributed.reduce_scatter_tensor",
    "grouped_allgather": "grouped allgather; call hvd.allgather on each tensor",
    "SyncBatchNorm": "Horovod's SyncBatchNorm; use torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)",
}


def __getattr__(name: str):
    if name in _NOT_PROVIDED:
        raise AttributeError(f"torsh.horovod does not provide hvd.{name} ({_NOT_PROVIDED[name]})")
    raise AttributeError(f"module 'torsh.horovod' has no attribute {name!r}")

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "Max", "Min", "ProcessSet", "Product", "Sum",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allreduce", "grouped_allreduce_", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank", "rocm_built",
    "shutdown", "size", "start_timeline", "stop_timeline", "synchronize",
]  # fmt: skip
