"""Where am I in the job? Rank discovery from whichever launcher started this process.

``discover(environ, argv)`` is a pure function of an environment mapping and an argument list (defaulting to
``os.environ`` and ``sys.argv``); it never imports torch and never touches ``torch.distributed``. The engine and
the Horovod shim call it before creating a process group.

Every launcher's vocabulary is one row of :data:`LAUNCHERS`; the order of that table **is** the precedence,
declared once. A launcher is *present* when one of its marker variables is set. The first present launcher
wins; the ones below it are not consulted, because launchers nest legitimately (``srun torchrun`` has Slurm's
variables describing one task per node *and* torchrun's describing eight workers per node; ``mpirun`` inside a
Slurm allocation leaves the batch step's ``SLURM_PROCID=0`` in every rank's environment). Why this order:

1. ``torchrun`` (and ``torch.distributed.launch``, which is torchrun's agent): the innermost launcher when nested
   under Slurm or MPI, so it must beat them.
2. ``deepspeed``: the DeepSpeed launcher sets the torchrun-style names plus Horovod-style ``CROSS_RANK``,
   ``CROSS_SIZE``, ``LOCAL_SIZE`` and passes ``--local_rank=N`` in argv (recognised by ``CROSS_*``: a
   ``LOCAL_SIZE`` alone is also DeepSpeed's CPU accelerator's device count, which users export themselves).
3. ``env``: bare ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (accelerate, custom spawners, a user exporting them).
   Above the MPI rows because a user who exports them under ``mpirun -x`` means them.
4. ``horovodrun`` (Gloo controller): ``HOROVOD_RANK`` ... and the Gloo rendezvous server's address.
5. ``openmpi``, ``mvapich``, ``mpich`` (also Intel MPI and other PMI launchers): the MPI runtimes' own names.
6. ``slurm``: last, because ``SLURM_PROCID`` is also set (to 0, in every process) when another launcher runs
   inside an ``sbatch`` script.

Missing or contradictory values are one :class:`~torsh.errors.ConfigError` naming the variables. When no
launcher is present the process is a single-process job (``launcher="none"``).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from torsh.errors import ConfigError, Problem

__all__ = ["LAUNCHERS", "PRECEDENCE", "LauncherVars", "RankInfo", "discover", "local_rank_from_argv"]


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job, and which launcher said so."""

    rank: int
    """Global rank, ``0 <= rank < world_size``."""
    local_rank: int
    """Rank within this node (selects the accelerator)."""
    world_size: int
    """Number of processes in the job."""
    local_world_size: int | None
    """Processes on this node. None: the launcher does not say (bare ``RANK``/``WORLD_SIZE``)."""
    node_rank: int | None
    """Index of this node. None: the launcher does not say and it cannot be derived."""
    num_nodes: int | None
    """Number of nodes. None: the launcher does not say and it cannot be derived."""
    master_addr: str | None
    """Address of the rendezvous (rank 0's store). None: the launcher does not provide one."""
    master_port: int | None
    """Port of the rendezvous. None: the launcher does not provide one."""
    launcher: str
    """Which row of :data:`LAUNCHERS` matched (``torchrun``, ``torch.distributed.launch``, ``deepspeed``, ``env``,
    ``horovodrun``, ``openmpi``, ``mvapich``, ``mpich``, ``slurm``), or ``none`` for a single process."""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    """Field name -> the variable (or derivation) its value came from, for messages and debugging."""

    @property
    def is_distributed(self) -> bool:
        """More than one process."""
        return self.world_size > 1

    def torch_env(self) -> dict[str, str]:
        """The ``env://`` variables ``torch.distributed.init_process_group`` reads, for this process.

        Master address/port are included only when they name a place for rank 0's TCPStore. Under ``horovodrun``
        without MASTER_ADDR/MASTER_PORT they name Horovod's HTTP rendezvous server on the launching host (a
        key-value store, not a TCPStore, and its port is taken), so they are left out: the caller must agree on a
        store address another way (for example through that key-value store).
        """
        env = {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(self.world_size)}
        if self.local_world_size is not None:
            env["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        if self.master_is_horovod_rendezvous:
            return env
        if self.master_addr is not None:
            env["MASTER_ADDR"] = self.master_addr
        if self.master_port is not None:
            env["MASTER_PORT"] = str(self.master_port)
        return env

    @property
    def master_is_horovod_rendezvous(self) -> bool:
        """master_addr/master_port are horovodrun's Gloo rendezvous server, not a free TCPStore address."""
        return str(self.sources.get("master_port", "")).startswith("HOROVOD_GLOO_RENDEZVOUS")


@dataclass(frozen=True)
class LauncherVars:
    """One launcher's vocabulary: for each RankInfo field, the variables to read, first present wins."""

    name: str
    """The launcher name reported in ``RankInfo.launcher``."""
    markers: tuple[str, ...]
    """Any of these set means this launcher started the process."""
    rank: tuple[str, ...]
    world_size: tuple[str, ...]
    local_rank: tuple[str, ...]
    local_world_size: tuple[str, ...] = ()
    node_rank: tuple[str, ...] = ()
    num_nodes: tuple[str, ...] = ()
    master_addr: tuple[str, ...] = ("MASTER_ADDR",)
    master_port: tuple[str, ...] = ("MASTER_PORT",)
    local_rank_in_argv: bool = False
    """The launcher also passes ``--local_rank=N`` (or ``--local-rank``) to the script."""
    derive_node: bool = False
    """Node rank / count are not given; derive them as ``rank // local_world_size`` (block placement, the
    default of mpirun and srun) when every node holds the same number of processes."""
    special: Mapping[str, Callable[[Mapping[str, str]], tuple[str, str] | None]] = field(default_factory=dict)
    """Field -> a reader for values that need parsing (Slurm's compressed lists); returns (value, source)."""


def _slurm_tasks_on_this_node(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """Slurm's ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` (``"4(x2),3"``) at ``SLURM_NODEID``."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        text, node = environ.get(name), environ.get("SLURM_NODEID")
        if not text or node is None or not node.strip().isdigit():
            continue
        counts: list[str] = []
        for part in text.split(","):
            match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
            if not match:
                raise ConfigError([Problem(name, text, "expected Slurm's tasks-per-node list such as '4(x2),3'")])
            counts += [match.group(1)] * int(match.group(2) or 1)
        if int(node) < len(counts):
            return counts[int(node)], f"{name}[SLURM_NODEID]"
    return None


def _slurm_first_host(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The first host of ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST`` (``"gpu[003-004,9]"`` -> ``gpu003``)."""
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        text = environ.get(name, "").strip()
        match = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", text)
        if match:
            return match.group(1) + (match.group(2) or ""), f"{name} (first host)"
    return None


#: The precedence, declared once: the first launcher whose marker is set wins (the module docstring says why).
LAUNCHERS: tuple[LauncherVars, ...] = (
    LauncherVars("torchrun", markers=("TORCHELASTIC_RUN_ID", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT"),
                 rank=("RANK",), world_size=("WORLD_SIZE",), local_rank=("LOCAL_RANK",),
                 local_world_size=("LOCAL_WORLD_SIZE",), node_rank=("GROUP_RANK",),
                 num_nodes=("GROUP_WORLD_SIZE",), local_rank_in_argv=True),
    # not LOCAL_SIZE alone: DeepSpeed's CPU accelerator also reads it as its device count, set by hand
    LauncherVars("deepspeed", markers=("CROSS_RANK", "CROSS_SIZE"),
                 rank=("RANK",), world_size=("WORLD_SIZE",), local_rank=("LOCAL_RANK",),
                 local_world_size=("LOCAL_SIZE",), node_rank=("CROSS_RANK",), num_nodes=("CROSS_SIZE",),
                 local_rank_in_argv=True),
    LauncherVars("env", markers=("RANK", "WORLD_SIZE", "LOCAL_RANK"),
                 rank=("RANK",), world_size=("WORLD_SIZE",), local_rank=("LOCAL_RANK",),
                 local_world_size=("LOCAL_WORLD_SIZE",), local_rank_in_argv=True),
    LauncherVars("horovodrun", markers=("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"),
                 rank=("HOROVOD_RANK",), world_size=("HOROVOD_SIZE",), local_rank=("HOROVOD_LOCAL_RANK",),
                 local_world_size=("HOROVOD_LOCAL_SIZE",), node_rank=("HOROVOD_CROSS_RANK",),
                 num_nodes=("HOROVOD_CROSS_SIZE",),
                 master_addr=("MASTER_ADDR", "HOROVOD_GLOO_RENDEZVOUS_ADDR"),
                 master_port=("MASTER_PORT", "HOROVOD_GLOO_RENDEZVOUS_PORT")),
    LauncherVars("openmpi", markers=("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                 rank=("OMPI_COMM_WORLD_RANK",), world_size=("OMPI_COMM_WORLD_SIZE",),
                 local_rank=("OMPI_COMM_WORLD_LOCAL_RANK",), local_world_size=("OMPI_COMM_WORLD_LOCAL_SIZE",),
                 derive_node=True),
    LauncherVars("mvapich", markers=("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
                 rank=("MV2_COMM_WORLD_RANK",), world_size=("MV2_COMM_WORLD_SIZE",),
                 local_rank=("MV2_COMM_WORLD_LOCAL_RANK",), local_world_size=("MV2_COMM_WORLD_LOCAL_SIZE",),
                 derive_node=True),
    LauncherVars("mpich", markers=("PMI_RANK", "PMI_SIZE"),
                 rank=("PMI_RANK",), world_size=("PMI_SIZE",), local_rank=("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
                 local_world_size=("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"), derive_node=True),
    LauncherVars("slurm", markers=("SLURM_PROCID",),
                 rank=("SLURM_PROCID",), world_size=("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
                 local_rank=("SLURM_LOCALID",), local_world_size=("SLURM_NTASKS_PER_NODE",),
                 node_rank=("SLURM_NODEID",),
                 num_nodes=("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
                 special={"local_world_size": _slurm_tasks_on_this_node, "master_addr": _slurm_first_host}),
)  # fmt: skip

#: Launcher names in precedence order (highest first).
PRECEDENCE: tuple[str, ...] = tuple(row.name for row in LAUNCHERS)

_FIELDS = ("rank", "world_size", "local_rank", "local_world_size", "node_rank", "num_nodes", "master_addr",
           "master_port")  # fmt: skip
_REQUIRED = ("rank", "world_size", "local_rank")
_LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")


def local_rank_from_argv(argv: Sequence[str]) -> tuple[int, str] | None:
    """The ``--local_rank=N`` / ``--local_rank N`` / ``--local-rank=N`` a launcher appended, and its spelling.

    ``argv[0]`` (the program) is skipped. Raises ConfigError when the value is not a non-negative integer.
    """
    args = list(argv[1:])
    for i, arg in enumerate(args):
        for flag in _LOCAL_RANK_FLAGS:
            if arg == flag or arg.startswith(flag + "="):
                value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
                if not value.isdigit():
                    raise ConfigError([Problem(f"argv {flag}", value, "expected a non-negative integer local rank")])
                return int(value), flag
    return None


def discover(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> RankInfo:
    """Rank, local rank, world size, node, rendezvous address and launcher of this process.

    ``environ`` and ``argv`` default to ``os.environ`` and ``sys.argv``. The first launcher of :data:`LAUNCHERS`
    whose marker variable is set is read; missing, malformed or contradictory values raise one ConfigError
    naming every variable involved. With no launcher variables at all, a single process (rank 0 of 1).
    """
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    for row in LAUNCHERS:
        present = [m for m in row.markers if environ.get(m, "") != ""]
        if present:
            return _read_row(row, environ, argv)
    from_argv = local_rank_from_argv(argv)
    if from_argv is not None and from_argv[0] != 0:
        raise ConfigError([Problem(f"argv {from_argv[1]}", from_argv[0], "a local rank was passed but no launcher "
                                   "variables are set (RANK, WORLD_SIZE, ...); start the script with a launcher")])
    return RankInfo(0, 0, 1, 1, 0, 1, None, None, "none", MappingProxyType({}))


def _read_row(row: LauncherVars, environ: Mapping[str, str], argv: Sequence[str]) -> RankInfo:
    problems: list[Problem] = []
    values: dict[str, int | str | None] = {}
    sources: dict[str, str] = {}
    for name in _FIELDS:
        raw, source = None, None
        for var in getattr(row, name):
            if environ.get(var, "") != "":
                raw, source = environ[var], var
                break
        if raw is None and name in row.special:
            found = row.special[name](environ)
            if found is not None:
                raw, source = found
        if raw is None:
            values[name] = None
            continue
        sources[name] = source
        if name == "master_addr":
            values[name] = raw.strip()
            continue
        text = raw.strip()
        if not text.isdigit():
            problems.append(Problem(source, raw, f"{row.name}: expected a non-negative integer ({name})"))
            continue
        values[name] = int(text)

    launcher = row.name
    if row.local_rank_in_argv:
        from_argv = local_rank_from_argv(argv)
        if from_argv is not None:
            argv_rank, flag = from_argv
            if values["local_rank"] is None:
                values["local_rank"], sources["local_rank"] = argv_rank, f"argv {flag}"
            elif values["local_rank"] != argv_rank:
                problems.append(Problem(f"{sources['local_rank']} / argv {flag}", (values["local_rank"], argv_rank),
                                        "the environment and the command line disagree on the local rank"))
            if row.name == "torchrun":
                # torchrun never passes it; torch.distributed.launch (without --use-env) does.
                launcher = "torch.distributed.launch"

    missing = [n for n in _REQUIRED if values.get(n) is None and n not in sources]
    if missing:
        names = ", ".join(" or ".join(getattr(row, n)) for n in missing)
        present = ", ".join(f"{m}={environ[m]}" for m in row.markers if environ.get(m, "") != "")
        problems.append(Problem(names, None, f"{row.name} launch detected ({present}) but {names} "
                                f"{'is' if len(missing) == 1 else 'are'} not set; start the script with the "
                                "launcher or export the missing variable(s)"))  # fmt: skip
    if problems:
        raise ConfigError(problems, source="rank discovery")

    if row.derive_node:
        _derive_nodes(values, sources, row)
    _check_consistent(values, sources, row.name)
    return RankInfo(
        rank=values["rank"], local_rank=values["local_rank"], world_size=values["world_size"],
        local_world_size=values["local_world_size"], node_rank=values["node_rank"], num_nodes=values["num_nodes"],
        master_addr=values["master_addr"], master_port=values["master_port"], launcher=launcher,
        sources=MappingProxyType(sources),
    )  # fmt: skip


def _derive_nodes(values: dict, sources: dict, row: LauncherVars) -> None:
    lws, ws = values["local_world_size"], values["world_size"]
    if lws and ws and ws % lws == 0:
        values["node_rank"] = values["rank"] // lws
        values["num_nodes"] = ws // lws
        sources["node_rank"] = f"{sources['rank']} // {sources['local_world_size']} (assumes block placement)"
        sources["num_nodes"] = f"{sources['world_size']} // {sources['local_world_size']} (assumes equal nodes)"


def _check_consistent(values: dict, sources: dict, launcher: str) -> None:
    """Each bound a real launcher guarantees; a violation means stale or hand-set variables."""
    checks = [
        ("world_size", None, lambda v: v["world_size"] >= 1, "must be at least 1"),
        ("rank", "world_size", lambda v: v["rank"] < v["world_size"], "rank must be smaller than the world size"),
        ("local_rank", "local_world_size", lambda v: v["local_world_size"] is None
         or v["local_rank"] < v["local_world_size"], "local rank must be smaller than the local world size"),
        ("local_world_size", "world_size", lambda v: v["local_world_size"] is None
         or 1 <= v["local_world_size"] <= v["world_size"], "local world size must be between 1 and the world size"),
        ("local_rank", "world_size", lambda v: v["local_rank"] < v["world_size"],
         "local rank must be smaller than the world size"),
        ("node_rank", "num_nodes", lambda v: v["node_rank"] is None or v["num_nodes"] is None
         or v["node_rank"] < v["num_nodes"], "node rank must be smaller than the number of nodes"),
        ("num_nodes", "world_size", lambda v: v["num_nodes"] is None or 1 <= v["num_nodes"] <= v["world_size"],
         "number of nodes must be between 1 and the world size"),
        ("master_port", None, lambda v: v["master_port"] is None or v["master_port"] <= 65535,
         "a port is at most 65535"),
    ]  # fmt: skip
    problems = []
    for a, b, ok, reason in checks:
        if not ok(values):
            names = " / ".join(sources.get(n, n) for n in (a, b) if n)
            shown = {sources.get(n, n): values[n] for n in (a, b) if n}
            problems.append(Problem(names, shown, f"{launcher}: {reason}"))
    if problems:
        raise ConfigError(problems, source="rank discovery")
