"""Process-group lifecycle: start-up (CUDA + NCCL when a GPU is present, CPU + gloo otherwise; reuse an existing
group; a fresh rendezvous namespace per torchrun restart) and shutdown at interpreter exit in a safe order."""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torsh.config import CommunicationConfig
from torsh.errors import ConfigError, Problem

log = logging.getLogger("torsh.engine")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job, and the device it computes on."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


def _discover() -> tuple[int, int, int, str, str | None]:
    """``(rank, local_rank, world_size, master_addr, master_port)`` from any launcher's environment.

    ``torsh.ranks.discover`` reads torchrun, deepspeed, horovodrun, MPI and Slurm variables; a process started
    without a launcher is rank 0 of 1. The port is None when no launcher set one (``distributed_port`` decides).
    """
    from torsh.ranks import discover

    found = discover()
    # horovodrun's rendezvous server is not a TCPStore address: then only MASTER_* from the environment
    usable = not found.master_is_horovod_rendezvous
    addr = (found.master_addr if usable else None) or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = (found.master_port if usable else None) or os.environ.get("MASTER_PORT")
    return found.rank, found.local_rank, found.world_size, addr, str(port) if port else None


def _backend(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(communication: CommunicationConfig | None = None, *, dist_init_required: bool | None = None,
                     distributed_port: int = 29500) -> DistInfo:  # fmt: skip
    """Initialise the default process group unless one exists (DeepSpeed's ``init_distributed`` rules).

    ``dist_init_required=None`` initialises only when needed; ``False`` requires an existing group.
    """
    communication = communication or CommunicationConfig()
    if not dist.is_initialized():
        if dist_init_required is False:
            raise ConfigError([Problem("dist_init_required", False, "no torch.distributed process group is "
                                       "initialised; call torch.distributed.init_process_group first or pass "
                                       "dist_init_required=None")])  # fmt: skip
        _init_process_group(communication, distributed_port)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _, local_rank, _, _, _ = _discover()
    backend = dist.get_backend()
    return DistInfo(rank, local_rank, world_size, _device(str(backend), local_rank), str(backend))


def _init_process_group(communication: CommunicationConfig, distributed_port: int) -> None:
    """The default process group from the launcher's environment: under torchrun on the agent's store
    (:func:`elastic_store`), else by ``communication.init_method`` (``env://`` by default)."""
    rank, _, world_size, addr, port = _discover()
    os.environ.setdefault("MASTER_ADDR", addr)
    # as DeepSpeed's init_distributed: the launcher's port when it set one, else distributed_port
    os.environ.setdefault("MASTER_PORT", port or str(distributed_port))
    backend = _backend(communication.backend)
    kwargs = {}
    if communication.timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=communication.timeout_s)
    store = None
    if communication.init_method in (None, "env://"):
        store = elastic_store(world_size, kwargs.get("timeout"))
    if store is not None:
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, **kwargs)
    else:
        dist.init_process_group(backend=backend, init_method=communication.init_method or "env://", rank=rank,
                                world_size=world_size, **kwargs)  # fmt: skip


def local_device() -> torch.device:
    """This process's device as :func:`init_distributed` chooses it (its GPU under NCCL, made current; else the
    CPU), for code that runs before or beside an engine (``zero.Init`` builds modules there)."""
    backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else _backend("auto")
    return _device(backend, _discover()[1])


def _device(backend: str, local_rank: int) -> torch.device:
    """This rank's device: its GPU under NCCL (made current), else the CPU."""
    if "nccl" in backend and torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


# --- torchrun restarts --------------------------------------------------------------------------------------------


def elastic_store(world_size: int, timeout: datetime.timedelta | None = None) -> dist.Store | None:
    """Under torchrun: the agent's store, seen through a namespace of this restart attempt; None elsewhere.

    torchrun (static and c10d rendezvous alike) hosts one TCPStore in its agent for the whole job and tells the
    workers to use it (``TORCHELASTIC_USE_AGENT_STORE=True``, the same ``MASTER_PORT`` in every attempt). torch's
    ``env://`` rendezvous connects to it with no per-attempt prefix, so after a restart the keys the killed attempt
    wrote are still there: gloo reads the listening address of a dead process and either fails at once
    (``connectFullMesh failed ... Connection refused``) or both ranks wait for each other until the process-group
    timeout (30 minutes by default). Keys under ``torsh/<run id>/attempt<N>/`` are new in every attempt.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None  # no launcher store (or each attempt's rank 0 hosts a new one): env:// is right
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    from torch.distributed.constants import default_pg_timeout

    client = dist.TCPStore(addr, int(port), world_size, is_master=False, timeout=timeout or default_pg_timeout)
    return dist.PrefixStore(f"torsh/{run_id}/attempt{attempt}/", client)


# --- shutdown at exit ---------------------------------------------------------------------------------------------

_teardowns: list[weakref.ReferenceType] = []
_exit_handler_registered = False
_GIL_HANDOFF_S = 0.02


def on_shutdown(callback: Callable[[], object]) -> None:
    """Run ``callback`` (an engine's ``destroy``) at :func:`shutdown`, before the process group goes.

    Held weakly (a bound method through ``weakref.WeakMethod``): registering never keeps an engine alive.
    Callbacks run newest first.
    """
    ref = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else weakref.ref(callback)
    _teardowns.append(ref)


def shutdown(*, destroy_group: bool = True) -> None:
    """Tear down torch.distributed state in a safe order; idempotent, never raises, needs no other rank.

    1. the callbacks given to :func:`on_shutdown` (engines release DDP reducers, FSDP states, hooks);
    2. a garbage collection, so that modules nobody references any more drop their process-group references;
    3. unless ``destroy_group`` is False: ``destroy_process_group()`` (local: no barrier, no collective) and
       another collection, so that gloo's worker threads are joined now, while the interpreter is whole.

    Registered with :mod:`atexit` by :func:`init_distributed`. Left to interpreter finalisation instead, the
    process group's C++ destructor may never run, or a gloo thread may drop the last reference to a Python-owned
    tensor while the interpreter is being torn down: the process then dies with ``terminate called without an
    active exception`` (SIGABRT) although training finished.
    """
    while _teardowns:
        callback = _teardowns.pop()()
        if callback is None:
            continue
        try:
            callback()
        except Exception as exc:  # noqa: BLE001 - at exit: report and go on tearing down
            log.warning("shutdown: %s failed: %s: %s", getattr(callback, "__qualname__", callback),
                        type(exc).__name__, exc)  # fmt: skip
    gc.collect()
    if destroy_group and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001
            log.warning("shutdown: destroy_process_group failed: %s: %s", type(exc).__name__, exc)
    gc.collect()
    # A group something still references (a layer holding its sequence or expert group) keeps its gloo threads
    # after the destroy. Such a thread releases the tensors of the collective it just ran after the caller has
    # moved on, and needs the GIL to do it; waiting for the GIL once finalisation has begun aborts the process.
    # Releasing the GIL here for a moment lets it finish first.
    time.sleep(_GIL_HANDOFF_S)


def _shutdown_at_exit() -> None:
    # A script that died of an uncaught exception may have queued collectives its peers will never join: a
    # destroy would wait for them. The process group is then left as torch leaves it, and the launcher's failure
    # handling takes over (the exit status is non-zero anyway).
    failed = getattr(sys, "last_value", None) is not None
    shutdown(destroy_group=not failed)


def register_exit_handler() -> None:
    """Run :func:`shutdown` at interpreter exit (once, however often called). Done when this module is imported:
    whatever of torsh holds a process group (an engine, a Horovod context, a Ulysses or MoE layer over a group the
    script made itself) imports it first, so the group is torn down in a safe order at exit however it was
    started."""
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(_shutdown_at_exit)
        _exit_handler_registered = True


register_exit_handler()


_GROUPS: dict[tuple[int, ...], object] = {}
"""The process groups :func:`own_group` made, by their ranks, in :data:`_GROUPS_IN`."""
_GROUPS_IN: object = None


def own_group(partition: list[list[int]]) -> tuple[object, tuple[int, ...]]:
    """This rank's group of ``partition`` (lists of global ranks that together hold every rank) and its ranks.
    Collective: every rank makes every group of the partition, in one order, as torch requires; a group of the same
    ranks made before in the current default group (by any caller, for any parallelism) is reused."""
    global _GROUPS_IN
    if _GROUPS_IN is not dist.group.WORLD:  # a new default group: the old groups died with the old one
        _GROUPS.clear()
        _GROUPS_IN = dist.group.WORLD
    me, mine = dist.get_rank(), None
    for ranks in partition:
        key = tuple(ranks)
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(list(key))
        if me in key:
            mine = (_GROUPS[key], key)
    if mine is None:
        raise ValueError(f"rank {me} is in no group of {partition}")
    return mine
