"""Writing the core model's ``launch`` section as a torchrun, deepspeed, horovodrun or mpirun command.

Every writer resolves the same topology first (:func:`plan`: which nodes run how many processes on which
devices, with DeepSpeed's rules for ``--include``/``--exclude``/``--num_nodes``/``--num_gpus`` and Horovod/MPI's
for ``-np``), then spells it in its launcher's vocabulary and notes every launch field it wrote, approximated or
could not express (with the closest equivalent). :func:`worker_environments` lists the variables each worker
process receives from that launcher, so a translation can be checked against ``torsh.ranks.discover``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torsh.adapters._hostfile import Node
from torsh.concepts.launch import DEFAULT_PORT, worker_env
from torsh.config import TorshConfig
from torsh.errors import ConfigError, Problem
from torsh.translate import Note

from ._launch_deepspeed import write_deepspeed
from ._launch_mpi import write_horovodrun, write_mpirun
from ._launch_plan import _Writer, LaunchCommand, NodeCommand, Plan, _port, plan  # noqa: F401 - also imported from here
from ._launch_schedulers import write_kubernetes, write_slurm
from ._launch_torchrun import write_torchrun


WRITERS: dict[str, Callable[[TorshConfig], tuple[LaunchCommand, list[Note]]]] = {
    "torchrun": write_torchrun, "deepspeed": write_deepspeed, "horovodrun": write_horovodrun,
    "mpirun": write_mpirun, "slurm": write_slurm, "kubernetes": write_kubernetes,
}  # fmt: skip
#: The writers that write a job description for a scheduler rather than a command line.
SCHEDULERS = ("slurm", "kubernetes")


# --------------------------------------------------------------------------------------------------
# worker environments


def worker_environments(cfg: TorshConfig, launcher: str = "torchrun") -> list[dict[str, str]]:
    """The variables each worker gets from ``launcher`` (global rank order), beyond the inherited environment; a
    Slurm script's workers are torchrun's.

    Includes ``launch.env``. Raises ConfigError when the topology is not concrete (shell variables, ``gpu``).
    """
    nodes = _concrete_nodes(cfg, launcher)
    shared = _shared_worker_values(cfg, launcher, nodes)
    starter = "torchrun" if launcher in SCHEDULERS else launcher
    envs = []
    for node_rank, node in enumerate(nodes):
        for local in range(node.nproc):
            env = worker_env(starter, rank=len(envs), local=local, nproc=node.nproc, node=node_rank,
                             host=node.host or "localhost",
                             devices=",".join(map(str, node.devices or range(node.nproc))), **shared)  # fmt: skip
            envs.append({**cfg.launch.env, **env})
    return envs


def _shared_worker_values(cfg: TorshConfig, launcher: str, nodes: list[Node]) -> dict[str, Any]:
    """What every worker of the job is told alike: the world and node counts, the rendezvous, the run settings."""
    L = cfg.launch
    addr, port = _port(_Writer(cfg, launcher))
    return {"world": sum(n.nproc for n in nodes), "nnodes": len(nodes), "addr": addr or "127.0.0.1",
            "port": str(port or DEFAULT_PORT), "run_id": L.rdzv_id or "none", "max_restarts": L.max_restarts or 0}


def _concrete_nodes(cfg: TorshConfig, launcher: str) -> list[Node]:
    """The job's nodes; a ConfigError for an unknown launcher or counts known only when the command runs."""
    if launcher not in WRITERS:
        raise ConfigError([Problem("launcher", launcher, f"expected one of {', '.join(WRITERS)}")])
    L = cfg.launch
    nodes = plan(L).nodes
    if nodes is None:
        raise ConfigError([Problem("launch", {"nnodes": L.nnodes, "nproc_per_node": L.nproc_per_node,
                                              "world_size": L.world_size}, "the number of processes is not known "
                                   "until the command runs (a shell variable or gpu/auto)")])  # fmt: skip
    return nodes
