"""Joining and leaving the job for the Horovod shim: ``hvd.init`` and ``hvd.shutdown``.

Where the ranks come from is :func:`torsh.ranks.discover` (torchrun, the deepspeed launcher, horovodrun's
Gloo environment, mpirun, Slurm). How the processes meet:

* a launcher that gives ``MASTER_ADDR``/``MASTER_PORT`` (torchrun, deepspeed, a user's export): rank 0 hosts a
  ``TCPStore`` there;
* horovodrun (Gloo controller): ``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``PORT`` name horovodrun's HTTP key-value
  server, not a TCPStore. Rank 0 opens a TCPStore on a free port of its own host and publishes ``host:port``
  in that key-value server; the other ranks read it from there;
* no launcher at all: a single process (Horovod also runs with one process when started without horovodrun).

The state it starts is :mod:`._basics`' (which the collectives in :mod:`._ops` read); this module sits above both,
so that starting the process sets and resetting the operation counter need no import back into it.
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
from datetime import timedelta

import torch
import torch.distributed as dist

from torsh.engine.distributed import elastic_store
from torsh.engine.distributed import shutdown as _teardown
from torsh.ranks import RankInfo, discover

from . import _basics, _ops
from ._controller import Controller

_KV_SCOPE = "torsh"
_exit_registered = False
_generation = 0  # one key per init() in the rendezvous server, so a re-init after shutdown never reads a stale one


def init(comm=None, process_sets=None) -> None:
    """Join the job: create the default process group (gloo on CPU, nccl with CUDA) or reuse an existing one, and
    start the background thread that matches collectives by name (see ``_controller``).

    ``process_sets`` (a list of ``hvd.ProcessSet``) are registered as by ``hvd.add_process_set``. ``comm`` (an
    MPI communicator or a rank list) has no torch.distributed equivalent here: NotImplementedError.
    """
    global _generation
    if comm is not None:
        raise NotImplementedError("torsh.horovod.init(): comm= is not supported (no MPI communicators); register "
                                  "subsets of ranks with hvd.add_process_set(ranks) instead")  # fmt: skip
    if _basics._state is not None:
        return
    owns = not dist.is_initialized()
    info = discover()
    _generation += 1
    if owns:
        _init_process_group(info)
    state = _topology(info, owns)
    state.controller = Controller(state.rank, state.size)
    _basics._state = state
    global _exit_registered
    if not _exit_registered:  # registered after the process group's exit handler, so it runs before it
        atexit.register(shutdown)
        _exit_registered = True
    _ops._init_process_sets(process_sets)


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


def _topology(info: RankInfo, owns: bool) -> _basics._State:
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
    return _basics._State(rank, size, local_rank, len(same_node), same_local.index(rank), len(same_local),
                  len(set(per_node.values())) == 1, owns, info.launcher)  # fmt: skip


def shutdown() -> None:
    """Leave the job: stop the background thread; destroys the process group only when ``init`` created it."""
    state = _basics._state
    if state is not None and state.controller is not None:
        state.controller.stop()  # also destroys the groups it created
        state.controller = None
        _ops._handles = 0  # as Horovod: unnamed operations are numbered afresh after a shutdown
    if state is not None and state.owns_group and dist.is_initialized():
        # No garbage collection here (init/shutdown cycles stay fast): nothing of ours refers to the group any more,
        # so its gloo threads are joined as it is freed; the exit handler still collects before the interpreter ends.
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - shutdown never raises; the exit handler tears down what is left
            _teardown()
    _basics._state = None
