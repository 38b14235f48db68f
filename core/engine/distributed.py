"""Process-group start-up: CUDA + NCCL when a GPU is present, CPU + gloo otherwise; reuse an existing group."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torsh.config import CommunicationConfig
from torsh.errors import ConfigError, Problem


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job, and the device it computes on."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


def _discover() -> tuple[int, int, int, str, str]:
    """``(rank, local_rank, world_size, master_addr, master_port)`` from any launcher's environment.

    ``torsh.ranks.discover`` reads torchrun, deepspeed, horovodrun, MPI and Slurm variables; a process started
    without a launcher is rank 0 of 1.
    """
    from torsh.ranks import discover

    found = discover()
    # horovodrun's rendezvous server is not a TCPStore address: then only MASTER_* from the environment
    usable = not found.master_is_horovod_rendezvous
    addr = (found.master_addr if usable else None) or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = (found.master_port if usable else None) or os.environ.get("MASTER_PORT", "29500")
    return found.rank, found.local_rank, found.world_size, addr, str(port)


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
        rank, _, world_size, addr, port = _discover()
        os.environ.setdefault("MASTER_ADDR", addr)
        os.environ.setdefault("MASTER_PORT", str(port or distributed_port))
        backend = _backend(communication.backend)
        kwargs = {}
        if communication.timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=communication.timeout_s)
        dist.init_process_group(backend=backend, init_method=communication.init_method or "env://", rank=rank,
                                world_size=world_size, **kwargs)  # fmt: skip
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _, local_rank, _, _, _ = _discover()
    backend = dist.get_backend()
    if "nccl" in str(backend) and torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return DistInfo(rank, local_rank, world_size, device, str(backend))
