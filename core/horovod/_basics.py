"""Process-group start-up and topology for the Horovod shim: ``init``, ``size``, ``rank`` and friends.

Where the ranks come from is :func:`torsh.ranks.discover` (torchrun, the deepspeed launcher, horovodrun's
Gloo environment, mpirun, Slurm). How the processes meet:

* a launcher that gives ``MASTER_ADDR``/``MASTER_PORT`` (torchrun, deepspeed, a user's export): rank 0 hosts a
  ``TCPStore`` there;
* horovodrun (Gloo controller): ``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``PORT`` name horovodrun's HTTP key-value
  server, not a TCPStore. Rank 0 opens a TCPStore on a free port of its own host and publishes ``host:port``
  in that key-value server; the other ranks read it from there;
* no launcher at all: a single process (Horovod also runs with one process when started without horovodrun).

Topology (``local_size``, ``cross_rank``, ``cross_size``) is computed from what every rank reports at
``init``, with Horovod's definitions: the cross communicator groups the processes of equal local rank, ordered
by global rank. So it is exact on heterogeneous clusters too.
"""

from __future__ import annotations

import atexit
import collections
import os
import socket
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from torsh.engine.distributed import elastic_store, register_exit_handler
from torsh.engine.distributed import shutdown as _teardown
from torsh.ranks import RankInfo, discover

_KV_SCOPE = "torsh"
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
_exit_registered = False
_generation = 0  # one key per init() in the rendezvous server, so a re-init after shutdown never reads a stale one


def init(comm=None, process_sets=None) -> None:
    """Join the job: create the default process group (gloo on CPU, nccl with CUDA) or reuse an existing one, and
    start the background thread that matches collectives by name (see ``_controller``).

    ``process_sets`` (a list of ``hvd.ProcessSet``) are registered as by ``hvd.add_process_set``. ``comm`` (an
    MPI communicator or a rank list) has no torch.distributed equivalent here: NotImplementedError.
    """
    global _state, _generation
    if comm is not None:
        raise NotImplementedError("torsh.horovod.init(): comm= is not supported (no MPI communicators); register "
                                  "subsets of ranks with hvd.add_process_set(ranks) instead")  # fmt: skip
    if _state is not None:
        return
    owns = not dist.is_initialized()
    info = discover()
    _generation += 1
    if owns:
        _init_process_group(info)
    state = _topology(info, owns)
    from ._controller import Controller
    from ._ops import _init_process_sets

    state.controller = Controller(state.rank, state.size)
    _state = state
    global _exit_registered
    if not _exit_registered:  # registered after the process group's exit handler, so it runs before it
        atexit.register(shutdown)
        _exit_registered = True
    _init_process_sets(process_sets)


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _timeout() -> timedelta:
    # horovodrun --gloo-timeout-seconds; torch's own default otherwise.
    seconds = os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS")
    return timedelta(seconds=float(seconds)) if seconds else timedelta(minutes=10)


def _init_process_group(info: RankInfo) -> None:
    backend = _backend()
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    if info.world_size == 1 and info.master_addr is None:
        store = dist.HashStore()
    elif info.sources.get("master_addr") == "HOROVOD_GLOO_RENDEZVOUS_ADDR":
        store = _store_via_horovod_rendezvous(info)
    else:
        if info.master_addr is None or info.master_port is None:
            from torsh.errors import ConfigError, Problem

            raise ConfigError([Problem("MASTER_ADDR / MASTER_PORT", None, f"{info.launcher} started {info.world_size} "
                                       "processes but gave no rendezvous address; export MASTER_ADDR and MASTER_PORT "
                                       "(rank 0's host and a free port) or launch with torchrun")],
                              source="torsh.horovod.init")  # fmt: skip
        # Under torchrun the agent serves one store for the whole job: meet under this restart attempt's namespace,
        # or a restarted job reads the addresses of the killed attempt's processes.
        store = elastic_store(info.world_size, _timeout())
        if store is not None:  # one namespace per init(): a re-init after shutdown must not read the last one's keys
            store = dist.PrefixStore(f"horovod{_generation}/", store)
        else:
            store = dist.TCPStore(info.master_addr, info.master_port, info.world_size, info.rank == 0,
                                  timeout=_timeout())  # fmt: skip
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size, timeout=_timeout())
    register_exit_handler()


def _store_via_horovod_rendezvous(info: RankInfo) -> dist.Store:
    """Meet through horovodrun's HTTP key-value server (GET/PUT ``/<scope>/<key>``)."""
    url = f"http://{info.master_addr}:{info.master_port}/{_KV_SCOPE}/store{_generation}"
    deadline = time.monotonic() + _timeout().total_seconds()
    if info.rank == 0:
        # Not waiting for the workers here: they can only connect after the address below is published.
        store = dist.TCPStore("0.0.0.0", 0, info.world_size, True, timeout=_timeout(), wait_for_workers=False)
        host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        if host in ("localhost", "127.0.0.1"):
            host = "127.0.0.1"
        body = f"{host}:{store.port}".encode()
        request = urllib.request.Request(url, data=body, method="PUT", headers={"Content-Length": str(len(body))})
        urllib.request.urlopen(request, timeout=10).close()
        return store
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                host, port = response.read().decode().rsplit(":", 1)
            return dist.TCPStore(host, int(port), info.world_size, False, timeout=_timeout())
        except urllib.error.HTTPError as exc:  # 404 until rank 0 has published
            if exc.code != 404 or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _topology(info: RankInfo, owns: bool) -> _State:
    rank, size = dist.get_rank(), dist.get_world_size()
    local_rank = info.local_rank if info.world_size == size else rank
    # A node is named by the launcher's node rank, else by a checksum of the host name (an int fits a tensor).
    node = info.node_rank if info.node_rank is not None and info.world_size == size else zlib.crc32(
        socket.gethostname().encode())
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([local_rank, node], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine)
    everyone = [(int(t[0]), int(t[1])) for t in gathered]
    same_node = [r for r, (_, n) in enumerate(everyone) if n == node]
    same_local = [r for r, (lr, _) in enumerate(everyone) if lr == local_rank]
    per_node = collections.Counter(n for _, n in everyone)
    return _State(rank, size, local_rank, len(same_node), same_local.index(rank), len(same_local),
                  len(set(per_node.values())) == 1, owns, info.launcher)  # fmt: skip


def _get() -> _State:
    if _state is None:
        raise ValueError(_NOT_INITIALIZED)
    return _state


def shutdown() -> None:
    """Leave the job: stop the background thread; destroys the process group only when ``init`` created it."""
    global _state
    if _state is not None and _state.controller is not None:
        _state.controller.stop()  # also destroys the groups it created
        _state.controller = None
        from . import _ops

        _ops._handles = 0  # as Horovod: unnamed operations are numbered afresh after a shutdown
    if _state is not None and _state.owns_group and dist.is_initialized():
        # No garbage collection here (init/shutdown cycles stay fast): nothing of ours refers to the group any more,
        # so its gloo threads are joined as it is freed; the exit handler still collects before the interpreter ends.
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - shutdown never raises; the exit handler tears down what is left
            _teardown()
    _state = None


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
