"""The Horovod PyTorch API on torch.distributed: replace ``import horovod.torch as hvd`` with
``import torsh.horovod as hvd`` and run the script under torchrun (or horovodrun, mpirun, srun).

As in Horovod, collectives are requests matched across ranks *by name* and run by a background thread
(``_controller``): handles are asynchronous (``poll`` / ``synchronize``), a rank may ``join`` early while the others
go on reducing (it contributes zeros), and ranks that disagree (dtype, shape, broadcast root, operation) get
Horovod's error messages as ``HorovodInternalError`` instead of a hang, an abort or wrong numbers.

What is exact, approximate and unsupported (each function's docstring has the details):

* exact: ``init`` / ``shutdown`` (and ``init`` again after ``shutdown``) / ``is_initialized``, ``size``, ``rank``,
  ``local_rank``, ``local_size``, ``cross_rank``, ``cross_size``, ``is_homogeneous``; ``allreduce`` (Average, Sum,
  Min, Max, Product; pre/postscale), ``allgather`` (uneven first dimensions), ``broadcast``, ``alltoall`` (uneven
  splits), ``reducescatter`` (Horovod's split of the first dimension), their ``_async`` / in-place / ``grouped_``
  forms and their gradients; ``sparse_allreduce_async``; process sets (``add_process_set``, ``remove_process_set``,
  ``ProcessSet``, ``process_set=`` on every collective and on ``DistributedOptimizer``, each on its own
  ``new_group``); ``join``; ``barrier``; ``DistributedOptimizer`` numerics; ``broadcast_parameters``,
  ``broadcast_optimizer_state``, ``broadcast_object``, ``allgather_object``. int16, which gloo lacks, is carried
  in int32 for reductions and cast back (exact, with int16 wrap-around).
* approximate: the optimizer fuses gradients into fixed buckets (``HOROVOD_FUSION_THRESHOLD`` bytes, reverse
  parameter order), where Horovod fuses whatever is ready each cycle (same numbers); ``groups`` is only validated.
  ``TORSH_HOROVOD_CHECKS=0`` skips comparing ranks' requests (dtype, shape, factors, op, root) for speed.
* unsupported (a clear error): ``op=Adasum``, ``init(comm=...)`` and process sets from MPI communicators, the
  timeline (``start_timeline``), ``hvd.elastic``, ``hvd.SyncBatchNorm``.
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
    size,
    start_timeline,
    stop_timeline,
)
from ._controller import HorovodInternalError
from ._lifecycle import init, shutdown
from ._ops import (
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    global_process_set,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    sparse_allreduce_async,
    synchronize,
)
from ._optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters

# Horovod names this module does not provide, and what to do instead (a clear message, not a bare AttributeError).
_NOT_PROVIDED = {
    "elastic": "Horovod elastic training; use torchrun --nnodes MIN:MAX with --max-restarts and reload a checkpoint",
    "SyncBatchNorm": "Horovod's SyncBatchNorm; use torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)",
}


def __getattr__(name: str):
    if name in _NOT_PROVIDED:
        raise AttributeError(f"torsh.horovod does not provide hvd.{name} ({_NOT_PROVIDED[name]})")
    raise AttributeError(f"module 'torsh.horovod' has no attribute {name!r}")

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min", "ProcessSet",
    "Product", "Sum", "add_process_set", "alltoall", "alltoall_async", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "reducescatter", "reducescatter_async", "remove_process_set", "sparse_allreduce_async",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank",
    "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allreduce", "grouped_allreduce_", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank", "rocm_built",
    "shutdown", "size", "start_timeline", "stop_timeline", "synchronize",
]  # fmt: skip
