"""The Horovod shim's job state and what it answers: ``size``, ``rank``, ``local_rank`` and friends.

``hvd.init`` (:mod:`._lifecycle`) fills :data:`_state`; ``hvd.shutdown`` clears it. Topology (``local_size``,
``cross_rank``, ``cross_size``) follows Horovod's definitions: the cross communicator groups the processes of equal
local rank, ordered by global rank, so it is exact on heterogeneous clusters too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

_NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


@dataclass
class _State:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool
    owns_group: bool
    launcher: str
    controller: object = None


_state: _State | None = None


def _get() -> _State:
    if _state is None:
        raise ValueError(_NOT_INITIALIZED)
    return _state


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return _state is not None


def size() -> int:
    """Number of processes in the job."""
    return _get().size


def rank() -> int:
    """This process's global rank."""
    return _get().rank


def local_rank() -> int:
    """Rank within this node (selects the GPU)."""
    return _get().local_rank


def local_size() -> int:
    """Processes on this node."""
    return _get().local_size


def cross_rank() -> int:
    """This process's index among the processes with the same local rank (its node index on equal nodes)."""
    return _get().cross_rank


def cross_size() -> int:
    """Number of processes with this local rank (the number of nodes on equal nodes)."""
    return _get().cross_size


def is_homogeneous() -> bool:
    """Every node runs the same number of processes."""
    return _get().homogeneous


def mpi_threads_supported() -> bool:
    """No MPI runtime is involved: always False."""
    _get()
    return False


def mpi_enabled() -> bool:
    """False: collectives run on torch.distributed, not MPI."""
    return False


def mpi_built() -> bool:
    """True when torch was built with MPI support."""
    return dist.is_mpi_available()


def gloo_enabled() -> bool:
    """True when the process group runs on gloo."""
    return dist.is_initialized() and dist.get_backend() == "gloo"


def gloo_built() -> bool:
    """True when torch was built with gloo."""
    return dist.is_gloo_available()


def nccl_built() -> bool:
    """True when torch can use NCCL (Horovod returns the NCCL version; any true value means built)."""
    return dist.is_nccl_available() and torch.cuda.is_available()


def cuda_built() -> bool:
    """True for a CUDA build of torch."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """True for a ROCm build of torch."""
    return getattr(torch.version, "hip", None) is not None


def ddl_built() -> bool:
    """IBM DDL is not used: False."""
    return False


def ccl_built() -> bool:
    """oneCCL is not used: False."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's timeline has no torch.distributed equivalent; use torch.profiler instead."""
    raise NotImplementedError("torsh.horovod has no Horovod timeline; record collectives with torch.profiler")


def stop_timeline() -> None:
    """See :func:`start_timeline`."""
    raise NotImplementedError("torsh.horovod has no Horovod timeline; record collectives with torch.profiler")
