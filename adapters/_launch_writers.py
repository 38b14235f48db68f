"""Writing the core model's ``launch`` section as a torchrun, deepspeed, horovodrun or mpirun command.

Every writer resolves the same topology first (:func:`plan`: which nodes run how many processes on which
devices, with DeepSpeed's rules for ``--include``/``--exclude``/``--num_nodes``/``--num_gpus`` and Horovod/MPI's
for ``-np``), then spells it in its launcher's vocabulary and notes every launch field it wrote, approximated or
could not express (with the closest equivalent). :func:`worker_environments` lists the variables each worker
process receives from that launcher, so a translation can be checked against ``torsh.ranks.discover``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torsh.adapters import _cmdline
from torsh.adapters._hostfile import Node, format_host_list, format_hostfile, resolve_nodes
from torsh.concepts.launch import DEFAULT_NPROC, DEFAULT_PORT, HOROVOD_LOG_LEVELS, shell_references, worker_env
from torsh.config import LaunchConfig, TorshConfig, get_path, iter_leaves
from torsh.errors import ConfigError, Problem
from torsh.translate import Fidelity, Note

_LAUNCH_DEFAULTS = dict(iter_leaves(LaunchConfig().model_dump()))
_LOCAL_RANK_FIX = ("make the script read the LOCAL_RANK variable, or accept every spelling with "
                   "torsh.launch_args.add_local_rank_argument(parser)")  # fmt: skip
# Variables the deepspeed launcher forwards to other nodes by itself (runner.py EXPORT_ENVS + CUDA's NCCL).
_DEEPSPEED_FORWARDS = ("NCCL", "PYTHON", "MV2", "UCX", "MLFLOW")


@dataclass(frozen=True)
class NodeCommand:
    """The command one node runs (or, for launchers that reach other nodes themselves, the head node)."""

    host: str | None
    """Where to run it; None: any node / the local machine."""
    argv: tuple[str, ...]
    """The launcher's argv (program first)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """``VAR=value`` assignments in front of the command."""

    def shell(self, wrapper: str = "", redirect: str = "") -> str:
        """The command as one shell line."""
        parts = [f"{k}={_cmdline.quote(v)}" for k, v in self.env.items()]
        parts += [wrapper] if wrapper else []
        parts += [_cmdline.join(self.argv)] + ([redirect] if redirect else [])
        return " ".join(parts)


class LaunchCommand(str):
    """A translated launch: the text to run (one line per node when nodes run their own command), plus its parts."""

    launcher: str
    commands: tuple[NodeCommand, ...]
    files: Mapping[str, str]

    def __new__(cls, text: str, *, launcher: str, commands: tuple[NodeCommand, ...],
                files: Mapping[str, str] | None = None) -> LaunchCommand:  # fmt: skip
        obj = super().__new__(cls, text)
        obj.launcher, obj.commands, obj.files = launcher, commands, dict(files or {})
        return obj


# --------------------------------------------------------------------------------------------------
# topology


@dataclass
class Plan:
    """The resolved topology: concrete nodes when every number is known, else the symbolic values."""

    nodes: list[Node] | None
    nnodes: Any
    nproc: Any
    world_size: Any


def plan(launch: LaunchConfig) -> Plan:
    """Which nodes run how many processes, following the launchers' own rules."""
    hosts = [(h.name, h.slots) for h in launch.hosts]
    symbolic = _symbolic_plan(launch, hosts)
    if _decided_when_run(launch, hosts):
        return symbolic
    if not hosts and launch.include:
        hosts = [(h, None) for h in _filter_hosts(launch.include)]
    return (_host_plan(launch, hosts) if hosts else _unnamed_plan(launch)) or symbolic


def _decided_when_run(launch: LaunchConfig, hosts: list) -> bool:
    """A count in a shell variable or gpu/auto/cpu (known when the command runs), or all hosts but some of
    hosts that are not known."""
    counts = (launch.nnodes, launch.world_size, launch.nproc_per_node)
    return not all(v is None or isinstance(v, int) for v in counts) or (not hosts and bool(launch.exclude))


def _unnamed_plan(launch: LaunchConfig) -> Plan | None:
    """Nodes that are not named (torchrun): the same process count on each (None when it is not known)."""
    nnodes = launch.nnodes or 1
    if isinstance(launch.nproc_per_node, int):
        nodes = [Node(None, launch.nproc_per_node)] * nnodes
    elif launch.world_size is not None and launch.world_size % nnodes == 0:
        nodes = [Node(None, launch.world_size // nnodes)] * nnodes
    else:
        return None
    return Plan(nodes, nnodes, nodes[0].nproc, sum(n.nproc for n in nodes))


def _symbolic_plan(launch: LaunchConfig, hosts: list) -> Plan:
    """The counts as written (shell variables, gpu); on one node the world size is its process count."""
    symbolic = Plan(None, launch.nnodes, launch.nproc_per_node, launch.world_size)
    one_host = not hosts or (len(hosts) == 1 and not shell_references(hosts[0][0]))
    if symbolic.nproc is None and symbolic.world_size is not None and launch.nnodes in (None, 1) and one_host:
        symbolic.nproc = symbolic.world_size
    return symbolic


def _host_plan(launch: LaunchConfig, hosts: list) -> Plan | None:
    """The nodes of named hosts (None when their process counts are left to the launcher)."""
    if launch.nproc_per_node is None and launch.world_size is None and any(s is None for _, s in hosts) and not (
            launch.include and all(":" in part for part in launch.include.split("@"))):
        return None
    nodes = resolve_nodes(hosts, include=launch.include, exclude=launch.exclude, num_nodes=launch.nnodes,
                          nproc_per_node=launch.nproc_per_node, world_size=launch.world_size)
    return Plan(nodes, len(nodes), _uniform(nodes), sum(n.nproc for n in nodes))


def _filter_hosts(spec: str) -> list[str]:
    return [part.split(":")[0] for part in spec.split("@")]


def _uniform(nodes: list[Node]) -> int | None:
    counts = {n.nproc for n in nodes}
    return counts.pop() if len(counts) == 1 else None


# --------------------------------------------------------------------------------------------------
# the writer's bookkeeping


class _Writer:
    """Notes for one write; ``done`` collects the launch fields accounted for."""

    def __init__(self, cfg: TorshConfig, target: str):
        self.cfg, self.launch, self.target = cfg, cfg.launch, target
        self.notes: list[Note] = []
        self.done: set[str] = set()
        self.plan = plan(cfg.launch)
        self.ext = dict(cfg.extensions.get("launch", {}))

    def note(self, path: str, fidelity: Fidelity, reason: str = "", target: str | None = None) -> None:
        self.notes.append(Note(path, target, get_path(self.cfg, path), fidelity, reason))
        self.done.add(path)

    def set(self, path: str) -> bool:
        """The launch field differs from its default (a user-visible setting)."""
        return get_path(self.cfg, path) != _LAUNCH_DEFAULTS.get(path.removeprefix("launch."), None)

    def finish(self, argv_per_node: list[NodeCommand], files: dict[str, str] | None = None) -> LaunchCommand:
        """Account for every remaining field and extension, and build the LaunchCommand."""
        self.notes += [note for key, value in self.ext.items() if (note := self._extension(key, value))]
        if (_launcher_of(self.ext) == "accelerate" != self.target
                and self.launch.env.get("ACCELERATE_USE_DEEPSPEED") == "true"):  # fmt: skip
            # accelerate's DeepSpeed launcher (prepare_deepspeed_cmd_env) puts its working directory on PYTHONPATH
            self.notes.append(Note("launch.env.PYTHONPATH", None, ".", Fidelity.APPROXIMATE, "accelerate launch "
                                   "puts its working directory first on PYTHONPATH for DeepSpeed jobs; "
                                   f"{self.target} does not (the script's own folder is importable either way): "
                                   "set PYTHONPATH=. when the script imports modules from the working directory"))
        self._remaining()
        same_launcher = _launcher_of(self.ext) == self.target
        wrapper = self.ext.get("wrapper", "") if same_launcher else ""
        if same_launcher and self.ext.get("program") is not None:  # the source's spelling of this launcher
            program = self.ext["program"].split()
            argv_per_node = [NodeCommand(c.host, (*program, *c.argv[1:]), c.env) for c in argv_per_node]
        return LaunchCommand("\n".join(self._lines(argv_per_node, wrapper)), launcher=self.target,
                             commands=tuple(argv_per_node), files=files)  # fmt: skip

    def _lines(self, commands: list[NodeCommand], wrapper: str) -> list[str]:
        """The shell text: each command, under a comment naming its node when there are several (or a host)."""
        lines = []
        for cmd in commands:
            if len(commands) > 1 or (cmd.host and self.target == "torchrun"):
                lines.append(f"# on {cmd.host or 'each node'}")
            lines.append(cmd.shell(wrapper, self.ext.get("redirect", "")))
        return lines

    def _extension(self, key: str, value: Any) -> Note | None:
        """What becomes of a kept part of the source command (None: written back by option_flags)."""
        path = f"extensions.launch.{key}"
        if key == "launcher":
            return Note(path, None, value, Fidelity.IGNORED, "the source launcher")
        if key in ("program", "wrapper"):
            if _launcher_of(self.ext) == self.target:
                return Note(path, key, value, Fidelity.EXACT, "")
            return Note(path, None, value, Fidelity.DROPPED, f"belongs to the source launcher, not {self.target}")
        if key == "redirect" or self.target in ("horovodrun", "mpirun"):
            return Note(path, key, value, Fidelity.EXACT)
        if key in ("python", "python_flags"):
            return Note(path, None, value, Fidelity.DROPPED, f"{self.target} starts Python itself")
        source = key.split(".")[0]
        var = _cmdline.ACCELERATE_OPTION_ENV.get(key.removeprefix("accelerate.")) if source == "accelerate" else None
        if source != self.target and var is not None and var in self.launch.env:
            return Note(path, "environment", value, Fidelity.EXACT, f"as {var}, which accelerate launch exports for it")
        if source != self.target:
            return Note(path, None, value, Fidelity.DROPPED, f"a {source} option with no {self.target} counterpart")
        return None

    def _remaining(self) -> None:
        data = self.cfg.model_dump(exclude={"extensions"})
        defaults = dict(iter_leaves(TorshConfig().model_dump(exclude={"extensions"})))
        for path, value in iter_leaves(data):
            if path in self.done or any(path.startswith(d + ".") for d in self.done) or value == defaults.get(path):
                continue
            if path.startswith(("launch.", "communication.")):
                self.notes.append(Note(path, None, value, Fidelity.UNSUPPORTED, f"{self.target} has no option for "
                                       "this"))  # fmt: skip
            else:
                self.notes.append(Note(path, None, value, Fidelity.DROPPED, "not part of a launch command"))

    def option_flags(self) -> list[str]:
        """This launcher's options kept from a source command of the same launcher."""
        table: dict[str, str] = {}
        for spelling, (dest, _) in _cmdline.LAUNCHER_FLAGS[self.target].items():
            if dest not in table or len(spelling) > len(table[dest]):
                table[dest] = spelling
        flags = []
        for key, value in self.ext.items():
            launcher, _, dest = key.partition(".")
            if launcher == self.target and dest in table:
                repeated = isinstance(value, list) and dest in ("x", "mca", "network_interface")
                for item in value if repeated else [value]:
                    flags += _spelled(table[dest], item)
        return flags

    def script(self, run_python: bool) -> list[str]:
        """The script and its arguments; ``run_python``: the launcher runs a command, so Python is spelled."""
        L = self.launch
        if L.script is None:
            raise ConfigError([Problem("launch.script", None, "a launch command needs the training script")])
        self.done |= {"launch.script", "launch.script_args", "launch.module", "launch.no_python"}
        self.notes.append(Note("launch.script", "script", L.script, Fidelity.EXACT))
        if L.script_args:
            self.notes.append(Note("launch.script_args", "script_args", L.script_args, Fidelity.EXACT))
        if not run_python or L.no_python:
            return [L.script, *L.script_args]
        python = [self.ext.get("python", "python"), *self.ext.get("python_flags", [])]
        return [*python, *(["-m"] if L.module else []), L.script, *L.script_args]

    def local_rank(self, passes: str | None, fix: str = _LOCAL_RANK_FIX) -> None:
        """Note how the script learns its local rank under this launcher compared with the source launcher."""
        wanted = self.launch.local_rank_argv
        self.done.add("launch.local_rank_argv")
        if wanted == passes:
            if wanted is not None:
                self.notes.append(Note("launch.local_rank_argv", None, wanted, Fidelity.EXACT,
                                       f"{self.target} appends {wanted}=N too"))  # fmt: skip
            return
        got = f"{self.target} passes {passes}=N" if passes else f"{self.target} passes no local-rank argument"
        had = f"the script received {wanted}=N" if wanted else "the script read LOCAL_RANK"
        self.notes.append(Note("launch.local_rank_argv", None, wanted, Fidelity.APPROXIMATE, f"{had}; {got}: {fix}"))

    def hosts_unknown_here(self) -> bool:
        """Hosts held in a shell variable (``-H $HOSTS``): noted as unsupported for a launcher that must list them
        (with the process count, which cannot be split over them either)."""
        names = [h.name for h in self.launch.hosts if shell_references(h.name)]
        if not names:
            return False
        self.note("launch.hosts", Fidelity.UNSUPPORTED, f"the hosts are in {', '.join(names)}, known only when the "
                  f"script runs; {self.target} needs each host (and its process count) written out")
        if self.plan.nproc is None and self.launch.world_size is not None:
            self.note("launch.world_size", Fidelity.UNSUPPORTED, f"{self.target} counts processes per node: the "
                      "process count cannot be split over hosts that are not known here")
        return True

    def devices_env(self, nodes: list[Node] | None) -> dict[str, str] | None:
        """CUDA_VISIBLE_DEVICES when every node uses the same device subset; None when they differ."""
        sets = {n.devices for n in nodes or []}
        if sets in (set(), {None}):
            return {}
        if len(sets) == 1:
            return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, sets.pop()))}
        return None

    def env_notes(self, target: str, reason: str = "") -> None:
        for name in self.launch.env:
            self.notes.append(Note(f"launch.env.{name}", target, self.launch.env[name], Fidelity.EXACT, reason))
        if self.launch.forward_env:
            self.notes.append(Note("launch.forward_env", target, self.launch.forward_env, Fidelity.EXACT,
                                   f"{self.target} workers inherit the launching shell's environment"))
        self.done |= {"launch.env", "launch.forward_env"}


def _spelled(spelling: str, item: Any) -> list[str]:
    """One kept option with its value: a switch alone, a value (or several) after it."""
    if item is True:
        return [spelling]
    if isinstance(item, list):
        return [spelling, *map(str, item)]
    if str(item).startswith("-") and spelling.startswith("--"):
        # a value that looks like an option (--mpi-args="-gpu") must be joined with "=", or the launcher's argparse
        # takes it for a flag and refuses the line
        return [f"{spelling}={item}"]
    return [spelling, str(item)]


def _launcher_of(ext: Mapping[str, Any]) -> str | None:
    """The launcher a config was read from (kept in ``extensions.launch.launcher``)."""
    return ext.get("launcher")


def _port(w: _Writer) -> tuple[Any, Any]:
    """Master address and port: explicit, else from a rendezvous endpoint, else the first host / 29500."""
    L = w.launch
    addr, port = L.master_addr, L.master_port
    if L.rdzv_endpoint and (addr is None or port is None):
        host, endpoint_port = _endpoint(L.rdzv_endpoint)
        addr = addr or host
        port = endpoint_port if port is None else None if port == 0 else port
    if addr is None and w.plan.nodes and w.plan.nodes[0].host:
        addr = w.plan.nodes[0].host
    return addr, port


def _endpoint(endpoint: str) -> tuple[str, Any]:
    """A rendezvous endpoint's host and port (None for none, or for c10d's 0 = any free port: a static rendezvous
    needs a real one)."""
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
    number = int(port) if port.isdigit() else (port or None)
    return host, None if number == 0 else number


# --------------------------------------------------------------------------------------------------
# the four writers


@dataclass(frozen=True)
class Option:
    """A core field a launcher takes as one option: ``--flag=value``, or ``--flag`` alone for a switch."""

    path: str
    flag: str
    spell: Callable[[Any], Any] | None = str
    """How the value is written (returning None when the launcher takes no such value); None: a switch, written
    when the field is true."""
    fidelity: Fidelity = Fidelity.EXACT
    reason: str = ""
    needs: str = ""
    """A core field that must be set too (a timeline's mark_cycles needs its filename)."""


def _whole_mib(value: int) -> Any:
    return int(round(value / (1024 * 1024)))


#: The core fields each launcher takes as one option each, in the order they are written.
_TORCHRUN_OPTIONS = (Option("launch.rdzv_backend", "--rdzv-backend"), Option("launch.rdzv_endpoint", "--rdzv-endpoint"),
                     Option("launch.rdzv_id", "--rdzv-id"),
                     Option("launch.rdzv_conf", "--rdzv-conf", lambda conf: ",".join(f"{k}={v}" for k, v in
                                                                                    conf.items())),
                     Option("launch.max_restarts", "--max-restarts"))  # fmt: skip
_HOROVODRUN_OPTIONS = (
    Option("communication.fusion_threshold_bytes", "--fusion-threshold-mb", _whole_mib),
    Option("communication.cycle_time_ms", "--cycle-time-ms", lambda ms: f"{ms:g}"),
    Option("communication.hierarchical_allreduce", "--hierarchical-allreduce", None),
    Option("communication.hierarchical_allgather", "--hierarchical-allgather", None),
    Option("communication.timeout_s", "--gloo-timeout-seconds", int, Fidelity.APPROXIMATE, "Horovod's Gloo timeout"),
    Option("monitoring.timeline.filename", "--timeline-filename"),
    Option("monitoring.timeline.mark_cycles", "--timeline-mark-cycles", None, needs="monitoring.timeline.filename"),
    Option("monitoring.log_level", "--log-level", lambda level: str(level).upper() if str(level).upper() in
           HOROVOD_LOG_LEVELS or shell_references(str(level)) else None),
)  # fmt: skip


def _options(w: _Writer, table: tuple[Option, ...]) -> list[str]:
    """The options of ``table`` whose core fields are set, each noted."""
    args = []
    for option in table:
        value = get_path(w.cfg, option.path)
        if _not_written(w, option, value):
            continue
        spelt = None if option.spell is None else option.spell(value)
        if option.spell is not None and spelt is None:
            w.note(option.path, Fidelity.DROPPED, f"{option.flag} does not take this value")
            continue
        args.append(option.flag if option.spell is None else f"{option.flag}={spelt}")
        w.note(option.path, *_option_fidelity(option, value), option.flag)
    return args


def _not_written(w: _Writer, option: Option, value: Any) -> bool:
    """Unset, a switch that is off, or an option whose companion field is unset."""
    return value in (None, "", {}) or (option.spell is None and not value) or bool(
        option.needs and not get_path(w.cfg, option.needs))


def _option_fidelity(option: Option, value: Any) -> tuple[Fidelity, str]:
    if option.spell is _whole_mib and value % (1024 * 1024):
        return Fidelity.APPROXIMATE, "whole MiB"
    return option.fidelity, option.reason


def write_torchrun(cfg: TorshConfig) -> tuple[LaunchCommand, list[Note]]:
    """One torchrun command per node (or one for every node when they run the same line)."""
    w = _Writer(cfg, "torchrun")
    L = cfg.launch
    dynamic = L.rdzv_backend not in (None, "static")
    standalone, nnodes = _torchrun_counts(w)
    addr, port = _port(w)
    common = standalone + _torchrun_common(w) + _endpoint_from_master(w, dynamic, addr, port)
    legacy = w.ext.get("program") == "python -m torch.distributed.launch"
    unknown_hosts = w.hosts_unknown_here()
    _topology_notes(w, "--nnodes/--nproc-per-node")
    w.env_notes("environment", "set in front of torchrun; workers inherit it")
    w.local_rank("--local-rank" if legacy and L.local_rank_argv is not None else None)
    script = w.script(run_python=False)
    _filter_note(w, per_node_devices=True)
    nnodes, ranks = _torchrun_nodes(w, nnodes, dynamic)
    commands: list[NodeCommand] = []
    for node_rank, node in ranks:
        argv = _torchrun_topology(w, nnodes, node_rank, node, None if dynamic else (addr, port))
        commands.append(NodeCommand(node.host if node else None, (*argv, *common, *script),
                                    {**L.env, **_visible_devices(node)}))  # fmt: skip
    _master_notes(w, "--master-addr/--master-port" if not dynamic else "--rdzv-endpoint")
    if L.hosts and not unknown_hosts:
        _torchrun_hosts_note(w, len(commands))
    return w.finish(commands), w.notes


def _visible_devices(node: Node | None) -> dict[str, str]:
    """A node's device selection (``--include host:0,1``) as the variable its torchrun runs under."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, node.devices))} if node and node.devices else {}


def _torchrun_hosts_note(w: _Writer, commands: int) -> None:
    where = "each command names its host" if commands > 1 else "start the command on each host"
    w.notes.append(Note("launch.hosts", None, [h.name for h in w.launch.hosts], Fidelity.EXACT,
                        f"torchrun runs once per node: {where}"))
    w.done.add("launch.hosts")


def _torchrun_counts(w: _Writer) -> tuple[list[str], Any]:
    """--standalone, and the node count (MIN:MAX for an elastic range)."""
    L, p = w.launch, w.plan
    if L.standalone:
        w.note("launch.standalone", Fidelity.EXACT, target="--standalone")
    nnodes = p.nnodes if p.nodes is None else len(p.nodes)
    if L.max_nnodes is not None:
        nnodes = f"{nnodes}:{L.max_nnodes}"
        w.note("launch.max_nnodes", Fidelity.EXACT, target="--nnodes")
    return ["--standalone"] if L.standalone else [], nnodes


def _torchrun_topology(w: _Writer, nnodes: Any, node_rank: Any, node: Node | None, master: tuple | None) -> list[str]:
    """torchrun and the options that place one node: counts, and with a static rendezvous (``master``: its
    address and port) the node rank and rank 0's address."""
    multi = nnodes not in (None, 1)
    argv = ["torchrun", *([f"--nnodes={nnodes}"] if multi else [])]
    nproc = node.nproc if node is not None else w.plan.nproc
    if nproc is None and multi:
        nproc = _nproc_from_world(w, nnodes)
    argv += [f"--nproc-per-node={nproc}"] if nproc is not None else []
    return argv if master is None else argv + _static_master(w, multi, node_rank, master)


def _static_master(w: _Writer, multi: bool, node_rank: Any, master: tuple) -> list[str]:
    """A static rendezvous: on several nodes the node rank and rank 0's address (a variable when unknown); on one,
    the address and port as given."""
    addr, port = master
    if multi:
        return [f"--node-rank={node_rank}", f"--master-addr={addr if addr is not None else '$MASTER_ADDR'}",
                f"--master-port={port if port is not None else DEFAULT_PORT}"]
    argv = [f"--master-addr={addr}"] if addr is not None and w.launch.master_addr is not None else []
    return argv + ([f"--master-port={port}"] if port is not None else [])


def _endpoint_from_master(w: _Writer, dynamic: bool, addr: Any, port: Any) -> list[str]:
    """A dynamic rendezvous without an endpoint meets at the source's rank-0 address (accelerate launch
    --rdzv_backend c10d --main_process_ip)."""
    if not dynamic or w.launch.rdzv_endpoint is not None or addr is None:
        return []
    return [f"--rdzv-endpoint={addr}:{port if port is not None else DEFAULT_PORT}"]


def _nproc_from_world(w: _Writer, nnodes: Any) -> str | None:
    """A process count known only when the command runs, over a node count: the shell divides them."""
    if w.launch.world_size is None or w.launch.max_nnodes is not None:
        return None
    nproc = f"$(( {w.launch.world_size} / {nnodes} ))"
    w.notes = [n for n in w.notes if n.source_path != "launch.world_size"]
    w.note("launch.world_size", Fidelity.EXACT, f"torchrun counts per node: {nproc}", "--nproc-per-node")
    return nproc


def _torchrun_common(w: _Writer) -> list[str]:
    """The options every node's torchrun command shares (after --standalone)."""
    L = w.launch
    common = _options(w, _TORCHRUN_OPTIONS) + w.option_flags()
    common += ["-m"] if L.module else ["--no-python"] if L.no_python else []
    if w.ext.get("program") == "python -m torch.distributed.launch" and L.local_rank_argv is None:
        common.append("--use-env")
    return common


def _torchrun_nodes(w: _Writer, nnodes: Any, dynamic: bool) -> tuple[Any, list[tuple[Any, Node | None]]]:
    """The node count and the (node rank, node) of each command: one per node when the source ran one per node
    (deepspeed --no_ssh) or the nodes differ; else one for all, with $NODE_RANK for a static rendezvous."""
    L, p = w.launch, w.plan
    if L.node_rank is not None:
        return _one_node(w, nnodes)
    if _per_host_commands(p, dynamic):
        return nnodes, list(enumerate(p.nodes))
    static_multi = nnodes not in (None, 1) and not dynamic
    if static_multi:
        w.notes.append(Note("launch.nnodes", "--node-rank", nnodes, Fidelity.APPROXIMATE, "the hosts are not "
                            "known: run this on every node with NODE_RANK=0..N-1 and MASTER_ADDR=node 0"))
    return nnodes, [("$NODE_RANK" if static_multi else 0, p.nodes[0] if p.nodes else None)]


def _per_host_commands(p: Plan, dynamic: bool) -> bool:
    """Named hosts get a command each, unless a dynamic rendezvous lets one line serve nodes that are alike."""
    if p.nodes is None or len(p.nodes) < 2 or not all(n.host for n in p.nodes):
        return False
    return not dynamic or _uniform(p.nodes) is None or any(n.devices for n in p.nodes)


def _one_node(w: _Writer, nnodes: Any) -> tuple[Any, list[tuple[Any, Node | None]]]:
    """The source runs one command per node (deepspeed --no_ssh --node_rank=N): so does torchrun."""
    L, p = w.launch, w.plan
    if nnodes is None:
        nnodes = len(L.hosts) if L.hosts else "$NNODES"
        if not L.hosts:
            w.notes.append(Note("launch.node_rank", "--nnodes", L.node_rank, Fidelity.APPROXIMATE,
                                "the node count is in the hostfile, which was not given: set NNODES"))
    known = p.nodes and isinstance(L.node_rank, int) and L.node_rank < len(p.nodes)
    return nnodes, [(L.node_rank, p.nodes[L.node_rank] if known else None)]


def _filter_note(w: _Writer, per_node_devices: bool) -> None:
    """--include/--exclude: applied when the hosts are known, else the closest equivalent is named."""
    L, nodes = w.launch, w.plan.nodes
    w.done |= {"launch.include", "launch.exclude"}
    if not (L.include or L.exclude):
        return
    path, value = ("launch.include", L.include) if L.include else ("launch.exclude", L.exclude)
    if nodes is None:
        w.notes.append(Note(path, None, value, Fidelity.UNSUPPORTED, f"{w.target} cannot filter hosts or devices "
                            "and the hostfile's hosts were not given (pass --hostfile); closest: start it only on "
                            "the selected hosts with CUDA_VISIBLE_DEVICES set to the selected device ids"))
    elif not any(n.devices for n in nodes):
        w.notes.append(Note(path, "hosts", value, Fidelity.EXACT, "applied: only the selected hosts are used"))
    elif per_node_devices or w.devices_env(nodes) is not None:
        w.notes.append(Note(path, "CUDA_VISIBLE_DEVICES", value, Fidelity.APPROXIMATE, f"{w.target} cannot choose "
                            "devices; CUDA_VISIBLE_DEVICES selects the same ids (as deepspeed itself does)"))
    else:
        w.notes.append(Note(path, None, value, Fidelity.UNSUPPORTED, f"{w.target} cannot give hosts different "
                            "device sets; closest: CUDA_VISIBLE_DEVICES set per host (e.g. in ~/.bashrc)"))


def _torchrun_hostfile_note(w: _Writer) -> None:
    listed = bool(w.launch.hosts)
    w.note("launch.hostfile", Fidelity.EXACT if listed else Fidelity.APPROXIMATE, "torchrun reads no hostfile: one "
           "command per host" + ("" if listed else "; its hosts were not given (pass --hostfile to torsh-migrate), "
                                 "so the commands cannot be listed per host"))


def _topology_notes(w: _Writer, target: str) -> None:
    """Node count, processes per node, world size and node rank, as far as the writer has not noted them."""
    L = w.launch
    if L.hostfile and w.target == "torchrun":
        _torchrun_hostfile_note(w)
    for key in ("nnodes", "nproc_per_node", "world_size", "node_rank"):
        if w.set(f"launch.{key}") and f"launch.{key}" not in w.done:
            w.note(f"launch.{key}", Fidelity.EXACT, "", target)
    if L.nproc_per_node is None and L.world_size is None and not L.hosts and "launch.nproc_per_node" not in w.done:
        w.note("launch.nproc_per_node", Fidelity.APPROXIMATE, "the source command does not say how many processes "
               f"(its launcher's config or default decides); {w.target}'s default applies: {DEFAULT_NPROC[w.target]}")


def _master_notes(w: _Writer, target: str) -> None:
    for key in ("master_addr", "master_port"):
        if getattr(w.launch, key) is not None:
            w.note(f"launch.{key}", Fidelity.EXACT, target=target)


def _local_world_size(w: _Writer, p: Plan) -> dict[str, str]:
    """LOCAL_WORLD_SIZE for a job read from torchrun or accelerate launch, whose workers had it: the deepspeed
    launcher sets LOCAL_SIZE instead, so a script reading LOCAL_WORLD_SIZE would fail (found by running both)."""
    sizes = {n.nproc for n in p.nodes or ()}
    if _launcher_of(w.ext) not in ("torchrun", "accelerate") or len(sizes) != 1 or "LOCAL_WORLD_SIZE" in w.launch.env:
        return {}
    size = str(sizes.pop())
    w.notes.append(Note("launch.nproc_per_node", "LOCAL_WORLD_SIZE", size, Fidelity.EXACT, "set for the workers as "
                        "the source launcher did; deepspeed itself sets only LOCAL_SIZE"))  # fmt: skip
    return {"LOCAL_WORLD_SIZE": size}


def write_deepspeed(cfg: TorshConfig) -> tuple[LaunchCommand, list[Note]]:
    """One deepspeed command that reaches the other nodes itself (hostfile), or one per node with --no_ssh."""
    w = _Writer(cfg, "deepspeed")
    L, p = cfg.launch, w.plan
    files: dict[str, str] = {}
    multi = (p.nodes is not None and len(p.nodes) > 1) or (p.nodes is None and p.nnodes not in (None, 1))
    hosts = _deepspeed_hosts(w)
    argv = ["deepspeed", *_deepspeed_hostfile(w, hosts, multi, files)]
    w.done.add("launch.hosts")
    argv += _deepspeed_counts(w, hosts, multi)
    if L.max_nnodes is not None:
        w.note("launch.max_nnodes", Fidelity.UNSUPPORTED, "the deepspeed launcher has no elastic range; it starts "
               "the minimum (--num_nodes); torchrun --nnodes=MIN:MAX is the elastic equivalent")
    _topology_notes(w, "--num_nodes/--num_gpus")
    argv += _deepspeed_rendezvous(w, multi)
    argv += ["--module"] if L.module else ["--no_python"] if L.no_python else []
    if L.local_rank_argv is None:
        argv.append("--no_local_rank")
        w.done.add("launch.local_rank_argv")
        w.notes.append(Note("launch.local_rank_argv", "--no_local_rank", None, Fidelity.EXACT,
                            "the script reads LOCAL_RANK as before; deepspeed would otherwise append --local_rank"))
    else:
        w.local_rank("--local_rank", "the underscore spelling differs: accept both with "
                     "torsh.launch_args.add_local_rank_argument(parser)")
    argv += [f for f in w.option_flags() if f not in argv]
    env = _deepspeed_env(w, multi, files)
    argv += w.script(run_python=False)
    return w.finish([NodeCommand(None, tuple(argv), env)], files), w.notes


def _deepspeed_hosts(w: _Writer) -> list[tuple[str, int | None]]:
    """The hosts to list: none when they are only known at run time, or are just the local machine."""
    L = w.launch
    hosts = [(h.name, h.slots) for h in L.hosts]
    if not L.hostfile and w.hosts_unknown_here():
        return []
    if not L.hostfile and hosts in ([("localhost", None)], [("127.0.0.1", None)]):
        w.note("launch.hosts", Fidelity.EXACT, "the local machine: deepspeed runs there without a hostfile")
        return []
    return hosts


def _deepspeed_hostfile(w: _Writer, hosts: list, multi: bool, files: dict[str, str]) -> list[str]:
    """--hostfile: the source's, or one written for the hosts (placeholders when they are not named)."""
    L, p = w.launch, w.plan
    if L.hostfile:
        w.note("launch.hostfile", Fidelity.EXACT, target="--hostfile")
        if hosts:
            w.notes.append(Note("launch.hosts", "--hostfile", [h.name for h in L.hosts], Fidelity.EXACT,
                                f"listed in {L.hostfile}"))
        return [f"--hostfile={L.hostfile}"]
    if not (multi or hosts):
        return []
    named = _hostfile_lines(p, hosts)
    files["hostfile"] = format_hostfile(named)
    w.notes.append(_written_hostfile_note(w, named, bool(hosts)))
    return ["--hostfile=hostfile"]


def _written_hostfile_note(w: _Writer, named: list[tuple[str, int | None]], hosts_named: bool) -> Note:
    """What the generated hostfile holds: the hosts, or what is left to fill in (slots, host names)."""
    names = [h.name for h in w.launch.hosts]
    if any(slots is None for _, slots in named):
        return Note("launch.hosts", "hostfile", names, Fidelity.APPROXIMATE,
                    "deepspeed's hostfile needs slots=N on every line: fill them in")
    if hosts_named:
        return Note("launch.hosts", "hostfile", names, Fidelity.EXACT, "written to the hostfile")
    return Note("launch.nnodes", "hostfile", w.plan.nnodes, Fidelity.APPROXIMATE, "deepspeed needs a hostfile "
                "naming the nodes: fill in the host names in the generated one")


def _hostfile_lines(p: Plan, hosts: list) -> list[tuple[str, int | None]]:
    """(host, slots) for a written hostfile: the resolved nodes when a host lacks slots (deepspeed requires
    slots=N), the hosts, or placeholders for nodes that are not named."""
    if p.nodes and hosts and any(slots is None for _, slots in hosts):
        return [(n.host, n.nproc) for n in p.nodes]
    return hosts or _placeholder_lines(p)


def _placeholder_lines(p: Plan) -> list[tuple[str, int | None]]:
    """(host, slots) for nodes that are not named: <host-i>, with the counts that are known."""
    if p.nodes:
        return [(n.host or f"<host-{i}>", n.nproc) for i, n in enumerate(p.nodes)]
    count = p.nnodes if isinstance(p.nnodes, int) else 2
    return [(f"<host-{i}>", p.nproc if isinstance(p.nproc, int) else None) for i in range(count)]


def _deepspeed_counts(w: _Writer, hosts: list, multi: bool) -> list[str]:
    """--include/--exclude, or --num_nodes/--num_gpus (an -np below the slots becomes --include)."""
    L, p, nodes = w.launch, w.plan, w.plan.nodes
    selected = _deepspeed_selection(w, hosts)
    if selected is not None:
        return selected
    fewer = nodes and len(nodes) < len(hosts)
    return ([f"--num_nodes={p.nnodes}"] if multi and L.nnodes is not None or fewer else []) + _num_gpus(w, hosts)


def _deepspeed_selection(w: _Writer, hosts: list) -> list[str] | None:
    """--include/--exclude as given, or an --include of the first slots when -np fills fewer than the hosts have."""
    L, nodes = w.launch, w.plan.nodes
    if L.include or L.exclude:
        return _filter_as_given(w)
    if not (nodes and hosts and L.world_size) or all(n.nproc == (s or n.nproc) for n, (_, s) in zip(nodes, hosts)):
        return None
    w.notes.append(Note("launch.world_size", "--include", L.world_size, Fidelity.EXACT,
                        "fewer processes than slots: the first slots of each host, as -np fills them"))
    w.done.add("launch.world_size")
    return ["--include=" + "@".join(f"{n.host}:{','.join(map(str, range(n.nproc)))}" for n in nodes)]


def _filter_as_given(w: _Writer) -> list[str]:
    L = w.launch
    w.note("launch.include" if L.include else "launch.exclude", Fidelity.EXACT, target="--include/--exclude")
    w.done |= {"launch.include", "launch.exclude"}
    return [f"--include={L.include}" if L.include else f"--exclude={L.exclude}"]


def _num_gpus(w: _Writer, hosts: list) -> list[str]:
    """--num_gpus, unless deepspeed's default (every device, or the hostfile's slots) gives the same count."""
    nproc = w.plan.nproc
    if nproc in ("gpu", "auto"):
        w.note("launch.nproc_per_node", Fidelity.EXACT, "deepspeed uses every device by default")
    elif nproc == "cpu":
        w.note("launch.nproc_per_node", Fidelity.UNSUPPORTED, "deepspeed starts one process per accelerator")
    elif nproc is not None and not (hosts and all(s == nproc for _, s in hosts) and not w.launch.nproc_per_node):
        return [f"--num_gpus={nproc}"]
    return []


def _deepspeed_rendezvous(w: _Writer, multi: bool) -> list[str]:
    """--no_ssh/--node_rank and --master_addr/--master_port; torchrun's rendezvous settings have no equivalent."""
    L = w.launch
    addr, port = _port(w)
    args = ["--no_ssh", f"--node_rank={L.node_rank}"] if L.node_rank is not None else []
    if addr is not None and (L.master_addr is not None or multi or L.node_rank is not None):
        args.append(f"--master_addr={addr}")
    if port is not None:
        args.append(f"--master_port={port}")
    _master_notes(w, "--master_addr/--master_port")
    _static_rendezvous_notes(w)
    return args


def _static_rendezvous_notes(w: _Writer) -> None:
    """torchrun's rendezvous settings, which deepspeed's static rendezvous has no place for."""
    L = w.launch
    for key in ("rdzv_backend", "rdzv_endpoint"):
        if getattr(L, key) is not None:
            w.note(f"launch.{key}", Fidelity.APPROXIMATE, "deepspeed has a static rendezvous only: its address is "
                   "--master_addr/--master_port and rank order follows the hostfile")
    for key in ("rdzv_id", "rdzv_conf", "max_restarts"):
        if w.set(f"launch.{key}"):
            w.note(f"launch.{key}", Fidelity.UNSUPPORTED, "the deepspeed launcher has no rendezvous id, "
                   "settings or restarts")
    if L.standalone:
        w.note("launch.standalone", Fidelity.EXACT, "single-node deepspeed runs locally")


def _deepspeed_env(w: _Writer, multi: bool, files: dict[str, str]) -> dict[str, str]:
    """The environment in front of the command, or in .deepspeed_env for the other nodes of a multi-node job."""
    L = w.launch
    env = {**_local_world_size(w, w.plan), **L.env}
    if not (multi and (env or L.forward_env)):
        w.env_notes("environment", "set in front of deepspeed; its workers inherit it")
        return env
    forwarded = [k for k in L.forward_env if not k.startswith(_DEEPSPEED_FORWARDS)]
    lines = [f"{k}={v}" for k, v in env.items()] + [f"{k}=${{{k}}}" for k in forwarded]
    files[".deepspeed_env"] = "".join(line + "\n" for line in lines)
    w.env_notes(".deepspeed_env", "deepspeed exports the lines of .deepspeed_env on every node")
    if forwarded:
        w.notes.append(Note("launch.forward_env", ".deepspeed_env", L.forward_env, Fidelity.APPROXIMATE,
                            "written as NAME=${NAME}: replace with the value, deepspeed does not expand it"))
    return {}


def _command_launcher(cfg: TorshConfig, target: str) -> tuple[_Writer, list[str], dict[str, str]]:
    """What horovodrun and mpirun share: -np, hosts, device selection, no rendezvous of their own."""
    w = _Writer(cfg, target)
    L, p = cfg.launch, w.plan
    world = _process_count(w)
    args = ["-np", str(world)] if world is not None else []
    _topology_notes(w, "-np")
    env = dict(L.env)
    env.update(w.devices_env(p.nodes) or {})
    _filter_note(w, per_node_devices=False)
    args += _host_list(w, world)
    w.done |= {"launch.hosts", "launch.hostfile"}
    _one_command_notes(w, target)
    return w, args, env


def _one_command_notes(w: _Writer, target: str) -> None:
    """horovodrun and mpirun start every node from one command: what torchrun-style settings become there, and
    which rank variables the workers get."""
    L = w.launch
    if L.node_rank is not None:
        w.note("launch.node_rank", Fidelity.DROPPED, f"{target} starts all nodes from one command on one host")
    if L.max_nnodes is not None:
        w.note("launch.max_nnodes", Fidelity.UNSUPPORTED, "an elastic range needs horovodrun --min-np/--max-np with "
               "--host-discovery-script (a script printing the current hosts)")
    if w.set("launch.max_restarts"):
        w.note("launch.max_restarts", Fidelity.UNSUPPORTED, "restarts exist only in elastic horovodrun "
               "(--reset-limit)")
    if L.standalone:
        w.note("launch.standalone", Fidelity.EXACT, "a single-node job")
    names = "HOROVOD_RANK, HOROVOD_LOCAL_RANK, HOROVOD_SIZE" if target == "horovodrun" else "OMPI_COMM_WORLD_*"
    source = _launcher_of(w.ext)
    if source != target and (source, target) != ("horovodrun", "mpirun"):  # hvd.init() also works under mpirun
        reason = (f"{target} sets no RANK, LOCAL_RANK or WORLD_SIZE (only {names}): a script reading them must use "
                  "torsh.ranks.discover()" + (" or hvd.init()" if target == "horovodrun" else ""))
        w.notes.append(Note("launch", None, ["RANK", "LOCAL_RANK", "WORLD_SIZE"], Fidelity.APPROXIMATE, reason))


def _process_count(w: _Writer) -> Any:
    """-np: the world size, or nodes x processes per node (a shell product when they are variables)."""
    p = w.plan
    if p.world_size is not None:
        return p.world_size
    if p.nproc in ("gpu", "auto", "cpu"):
        w.note("launch.nproc_per_node", Fidelity.UNSUPPORTED, f"{w.target} needs a process count (-np N); "
               f"'{p.nproc}' is decided by torchrun at start-up")
        return None
    if p.nproc is None:
        return None
    if p.nnodes in (None, 1):
        return p.nproc
    return f"$(({_cmdline.quote(str(p.nnodes))} * {_cmdline.quote(str(p.nproc))}))" if p.nodes is None else None


def _host_list(w: _Writer, world: Any) -> list[str]:
    """-H host:N,... (or the hostfile): every node is started from this one command. The first way that applies."""
    for way in (_resolved_hosts, _hosts_as_written, _hostfile_option, _placeholder_hosts):
        args = way(w, world)
        if args is not None:
            return args
    return []


def _resolved_hosts(w: _Writer, world: Any) -> list[str] | None:
    named = [(n.host, n.nproc) for n in w.plan.nodes or [] if n.host]
    if not named or (len(named) == 1 and named[0][0] == "localhost"):
        return None
    w.notes.append(Note("launch.hosts", "-H", [h for h, _ in named], Fidelity.EXACT))
    if w.launch.hostfile:
        w.note("launch.hostfile", Fidelity.EXACT, "its hosts are listed with -H", "-H")
    return ["-H", format_host_list(named)]


def _hosts_as_written(w: _Writer, world: Any) -> list[str] | None:
    """A count or a host held in a shell variable: -H as the source wrote it (one host's slots: the count)."""
    hosts = w.launch.hosts
    if w.plan.nodes is not None or not hosts:
        return None
    single = _one_literal_host(hosts, world)
    w.notes.append(Note("launch.hosts", "-H", [h.name for h in hosts], Fidelity.EXACT, "a single host's "
                        "slots are the process count" if single else ""))  # fmt: skip
    return ["-H", ",".join(f"{h.name}:{h.slots or world}" if h.slots or single else h.name for h in hosts)]


def _one_literal_host(hosts: list, world: Any) -> bool:
    """One host named literally and a known process count: the host's slots are that count."""
    return len(hosts) == 1 and world is not None and not shell_references(hosts[0].name)


def _hostfile_option(w: _Writer, world: Any) -> list[str] | None:
    if not w.launch.hostfile:
        return None
    mpirun = w.target == "mpirun"
    w.note("launch.hostfile", Fidelity.EXACT if mpirun else Fidelity.APPROXIMATE,
           "" if mpirun else "horovodrun's parser fails on blank lines and comments in it")
    return ["-hostfile" if mpirun else "--hostfile", w.launch.hostfile]


def _placeholder_hosts(w: _Writer, world: Any) -> list[str] | None:
    """Several nodes whose hosts are not named: <host-i> placeholders to fill in, when the counts are known."""
    p = w.plan
    if not (p.nodes and len(p.nodes) > 1 or p.nnodes not in (None, 1)):
        return None
    count = len(p.nodes) if p.nodes else p.nnodes
    if isinstance(count, int) and isinstance(p.nproc, int):
        w.notes.append(Note("launch.nnodes", "-H", p.nnodes, Fidelity.APPROXIMATE, f"{w.target} starts every "
                            "node from one command and needs the host names: fill in -H"))  # fmt: skip
        return ["-H", ",".join(f"<host-{i}>:{p.nproc}" for i in range(count))]
    w.notes.append(Note("launch.nnodes", None, p.nnodes, Fidelity.UNSUPPORTED, f"{w.target} needs the hosts "
                        "and their process counts (-H host:N,...); they are only known at run time here"))
    return []


def write_horovodrun(cfg: TorshConfig) -> tuple[LaunchCommand, list[Note]]:
    """One horovodrun command for every node; Horovod's tunables as its flags."""
    w, args, env = _command_launcher(cfg, "horovodrun")
    for key in ("master_addr", "master_port", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf"):
        if w.set(f"launch.{key}"):
            w.note(f"launch.{key}", Fidelity.DROPPED, "horovodrun runs its own rendezvous server "
                   "(HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT, read by torsh.ranks.discover)")
    tunables = _options(w, _HOROVODRUN_OPTIONS)
    w.env_notes("environment", "horovodrun forwards the launching shell's environment to every worker")
    w.local_rank(None, "use hvd.local_rank(), LOCAL_RANK is not set either: torsh.ranks.discover() reads "
                 "HOROVOD_LOCAL_RANK")
    argv = ["horovodrun", *args, *tunables, *[f for f in w.option_flags() if f not in tunables]]
    argv += w.script(run_python=True)
    return w.finish([NodeCommand(None, tuple(argv), env)]), w.notes


def write_mpirun(cfg: TorshConfig) -> tuple[LaunchCommand, list[Note]]:
    """One mpirun command for every node, exporting the environment and torch's rendezvous address with -x."""
    w, args, env = _command_launcher(cfg, "mpirun")
    exports = [f"{k}={v}" for k, v in env.items()] + list(cfg.launch.forward_env)
    w.env_notes("-x", "exported to every rank with -x")
    exports += _mpirun_rendezvous(w)
    w.local_rank(None, "mpirun sets OMPI_COMM_WORLD_LOCAL_RANK, not LOCAL_RANK: use torsh.ranks.discover()")
    kept = w.option_flags()
    argv = ["mpirun", *args]
    for item in exports:
        argv += ["-x", item]
    argv += [f for f in kept if f not in argv or f == "-x"]
    argv += w.script(run_python=True)
    return w.finish([NodeCommand(None, tuple(argv), {})]), w.notes


def _local_or_placeholder(p: Plan) -> str:
    """Rank 0's address when none is given: this machine for a single-node job, else a placeholder to fill in."""
    single = p.nodes is not None and len(p.nodes) == 1 and p.nodes[0].host in (None, "localhost")
    return "127.0.0.1" if single or p.nnodes in (None, 1) else "<host-0>"


def _mpirun_rendezvous(w: _Writer) -> list[str]:
    """MASTER_ADDR/MASTER_PORT for torch's env:// rendezvous (mpirun has none), unless launch.env sets them."""
    L = w.launch
    addr, port = _port(w)
    rendezvous = {"MASTER_ADDR": addr if addr is not None else _local_or_placeholder(w.plan),
                  "MASTER_PORT": port or DEFAULT_PORT}
    for key in ("master_addr", "master_port"):
        if getattr(L, key) is not None:
            w.note(f"launch.{key}", Fidelity.EXACT, "-x " + key.upper())
    w.notes.append(Note("launch", "-x MASTER_ADDR/MASTER_PORT", rendezvous, Fidelity.DEFAULTED, "mpirun has no "
                        "rendezvous: exported so torch.distributed's env:// finds rank 0's store"))  # fmt: skip
    for key in ("rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf"):
        if w.set(f"launch.{key}"):
            w.note(f"launch.{key}", Fidelity.APPROXIMATE if key == "rdzv_endpoint" else Fidelity.DROPPED,
                   "static rendezvous at MASTER_ADDR/MASTER_PORT")
    return [f"{k}={v}" for k, v in rendezvous.items() if k not in L.env]


#: The #SBATCH values a Slurm script needs that no launch line says: placeholders the report names.
SLURM_PLACEHOLDERS = {"time": "<HH:MM:SS>", "partition": "<partition>"}
_SLURM_ENDPOINT = "$head_node"


def _slurm_notes(cfg: TorshConfig, managed: dict[str, Any], notes: list[Note]) -> list[Note]:
    """The torchrun writer's notes without those about what Slurm manages, and notes for those fields instead."""
    L = cfg.launch
    notes = [n for n in notes if not n.source_path.startswith(tuple(f"launch.{k}" for k in managed
                                                                    if k != "nproc_per_node"))]
    if L.nnodes is not None:
        notes.append(Note("launch.nnodes", "#SBATCH --nodes", L.nnodes, Fidelity.EXACT))
    for key in ("hosts", "hostfile", "include", "exclude", "master_addr", "master_port", "node_rank", "rdzv_backend",
                "rdzv_endpoint", "rdzv_id"):
        note = _slurm_managed_note(key, get_path(cfg, f"launch.{key}"), managed)
        if note is not None:
            notes.append(note)
    return notes


def _slurm_managed_note(key: str, value: Any, managed: dict[str, Any]) -> Note | None:
    """A node-choosing or rendezvous setting under Slurm: Slurm's own rendezvous read back, or left to Slurm."""
    if key.startswith("rdzv") and value == managed[key]:  # the rendezvous of a Slurm script read back
        return Note(f"launch.{key}", f"torchrun --{key.replace('_', '-')}", value, Fidelity.EXACT)
    if value in (None, [], False) or key == "master_port":
        return None
    return Note(f"launch.{key}", None, value, Fidelity.APPROXIMATE, "Slurm picks the nodes (sbatch --nodelist / "
                "--exclude choose them) and torchrun meets on the first one")


def write_slurm(cfg: TorshConfig) -> tuple[LaunchCommand, list[Note]]:
    """An sbatch script: one task per node, each running torchrun (``srun``), which starts the node's processes
    and meets the others through a c10d rendezvous on the job's first node."""
    L, p = cfg.launch, plan(cfg.launch)
    nnodes = p.nnodes if p.nnodes is not None else 1
    nproc = p.nproc if p.nproc is not None else L.nproc_per_node
    port = L.master_port if isinstance(L.master_port, int) else DEFAULT_PORT
    managed = {"nnodes": "$SLURM_NNODES", "max_nnodes": None, "hosts": [], "hostfile": None, "include": None,
               "exclude": None, "node_rank": None, "master_addr": None, "master_port": None, "world_size": None,
               "nproc_per_node": nproc, "rdzv_backend": "c10d", "rdzv_endpoint": f"{_SLURM_ENDPOINT}:{port}",
               "rdzv_id": "$SLURM_JOB_ID", "standalone": False}  # fmt: skip
    directives, others = _split_kept_slurm(cfg.extensions.get("launch", {}))
    inner, notes = write_torchrun(cfg.model_copy(update={"launch": L.model_copy(update=managed),
                                                         "extensions": {**cfg.extensions, "launch": others}}))
    notes = _slurm_notes(cfg, managed, notes)
    sbatch = {"job-name": "torsh", **directives, "nodes": nnodes, "ntasks-per-node": 1}
    notes += _sbatch_placeholders(sbatch) + _kept_directive_notes(directives)
    lines = ["#!/bin/bash", *(f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={v}" for k, v in sbatch.items()),
             "", "set -euo pipefail",
             "# torchrun on every node meets the others on the first one (c10d rendezvous)",
             'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             *(command.shell("srun") for command in inner.commands)]  # fmt: skip
    return LaunchCommand("\n".join(lines), launcher="slurm", commands=inner.commands, files=inner.files), notes


def _split_kept_slurm(kept: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A source script's #SBATCH directives (``slurm.*``), and the rest of its kept command without its srun."""
    directives = {k.removeprefix("slurm."): v for k, v in kept.items() if k.startswith("slurm.")}
    others = {k: v for k, v in kept.items() if not k.startswith("slurm.") and not (k == "wrapper" and v == "srun")}
    return directives, others


def _sbatch_placeholders(sbatch: dict[str, Any]) -> list[Note]:
    """Fill the #SBATCH values a launch line does not say with placeholders (in ``sbatch``), each noted."""
    notes = []
    for key, placeholder in SLURM_PLACEHOLDERS.items():
        if key not in sbatch:
            sbatch[key] = placeholder
            notes.append(Note(f"slurm.{key}", f"#SBATCH --{key}", placeholder, Fidelity.DEFERRED, f"not in a launch "
                              f"line: replace {placeholder} with your cluster's {key}"))  # fmt: skip
    return notes


def _kept_directive_notes(directives: dict[str, Any]) -> list[Note]:
    return [Note(f"extensions.launch.slurm.{k}", f"#SBATCH --{k}", v, Fidelity.EXACT, "kept from the source script")
            for k, v in directives.items() if k not in ("nodes", "ntasks-per-node")]  # fmt: skip


#: The PyTorchJob values no launch line says: placeholders the report names.
KUBERNETES_PLACEHOLDERS = {"image": "<image>"}
#: The Kubeflow training operator's names: the container it configures, and the port its rendezvous uses.
_PYTORCHJOB_CONTAINER, _PYTORCHJOB_PORT = "pytorch", "pytorchjob-port"
_PYTORCHJOB_MANAGED = ("nnodes", "max_nnodes", "hosts", "hostfile", "include", "exclude", "node_rank", "master_addr",
                       "master_port", "world_size", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
                       "standalone")  # fmt: skip


def write_kubernetes(cfg: TorshConfig) -> tuple[LaunchCommand, list[Note]]:
    """A Kubeflow ``PyTorchJob`` manifest: one pod per node, each running torchrun for its node's processes.

    A fixed node count becomes a Master pod and N-1 Worker pods; torchrun meets on the master through the
    variables the training operator sets in every pod (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` = the pod's
    index), which Kubernetes expands in the command (``$(VAR)``). An elastic range (``--nnodes MIN:MAX``) or a
    dynamic rendezvous becomes Worker pods under an ``elasticPolicy``; the operator then hands torchrun the
    rendezvous endpoint, backend, node range and restarts as ``PET_*`` variables.
    """
    L, p = cfg.launch, plan(cfg.launch)
    nnodes = _pytorchjob_nodes(L, p)
    nproc = p.nproc if p.nproc is not None else L.nproc_per_node
    elastic = L.max_nnodes is not None or L.rdzv_backend not in (None, "static")
    kept = cfg.extensions.get("launch", {})
    inner, notes = _pod_torchrun(cfg, nproc)
    notes += _kubernetes_notes(cfg, elastic, kept)
    container = _pytorchjob_container(cfg, inner.commands[0], nnodes if not elastic else None, notes)
    spec = _pytorchjob_spec(L, nnodes, nproc, elastic, container, notes)
    manifest = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                "metadata": {"name": kept.get("kubernetes.name", "torsh")}, "spec": spec}  # fmt: skip
    import yaml  # only here: reading a config does not load a YAML writer

    text = yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False, width=1000)
    return LaunchCommand(text.rstrip("\n"), launcher="kubernetes", commands=inner.commands, files=inner.files), notes


def _pytorchjob_nodes(L: LaunchConfig, p: Plan) -> int:
    """The pods: a node count as a number (a PyTorchJob's replicas cannot wait for the shell)."""
    nnodes = p.nnodes if p.nnodes is not None else 1
    if not isinstance(nnodes, int) or not (L.max_nnodes is None or isinstance(L.max_nnodes, int)):
        raise ConfigError([Problem("launch.nnodes", nnodes if L.max_nnodes is None else f"{nnodes}:{L.max_nnodes}",
                                   "a PyTorchJob needs the node count as a number (its pod replicas): give "
                                   "--nnodes N (or MIN:MAX) in the launch line")])  # fmt: skip
    return nnodes


def _pod_torchrun(cfg: TorshConfig, nproc: Any) -> tuple[LaunchCommand, list[Note]]:
    """The torchrun line one pod runs for its processes, and its notes (what the PyTorchJob carries left out)."""
    kept = cfg.extensions.get("launch", {})
    others = {k: v for k, v in kept.items() if not k.startswith(("slurm.", "kubernetes."))
              and k not in ("wrapper", "program")}  # fmt: skip
    managed = {key: _LAUNCH_DEFAULTS.get(key) for key in _PYTORCHJOB_MANAGED}
    inner, notes = write_torchrun(cfg.model_copy(update={
        "launch": cfg.launch.model_copy(update={**managed, "nproc_per_node": nproc}),
        "extensions": {**cfg.extensions, "launch": others}}))  # fmt: skip
    return inner, [n for n in notes if not n.source_path.startswith(tuple(f"launch.{k}" for k in _PYTORCHJOB_MANAGED))]


def _pytorchjob_spec(L: LaunchConfig, nnodes: int, nproc: Any, elastic: bool, container: dict[str, Any],
                     notes: list[Note]) -> dict[str, Any]:  # fmt: skip
    """The job's spec: processes per pod, and a Master with Workers or Workers under an elastic policy."""
    spec: dict[str, Any] = {} if nproc is None or shell_references(nproc) else {"nprocPerNode": str(nproc)}
    if nproc is None:
        notes.append(Note("launch.nproc_per_node", "spec.nprocPerNode", None, Fidelity.DEFERRED, "not in the launch "
                          "line: the training operator's default applies (auto: one process per GPU, else one); "
                          "set spec.nprocPerNode to choose"))  # fmt: skip
    spec["runPolicy"] = {"cleanPodPolicy": "None"}
    if not elastic:
        workers = {"Worker": _replica(nnodes - 1, container)} if nnodes > 1 else {}
        return spec | {"pytorchReplicaSpecs": {"Master": _replica(1, container), **workers}}
    high = L.max_nnodes if L.max_nnodes is not None else nnodes
    policy = {"rdzvBackend": "c10d", "minReplicas": nnodes, "maxReplicas": high}
    policy |= {"maxRestarts": L.max_restarts} if isinstance(L.max_restarts, int) and L.max_restarts else {}
    policy |= {"rdzvId": str(L.rdzv_id)} if L.rdzv_id is not None else {}
    return spec | {"elasticPolicy": policy, "pytorchReplicaSpecs": {"Worker": _replica(high, container)}}


def _pytorchjob_container(cfg: TorshConfig, command: NodeCommand, fixed_nodes: int | None,
                          notes: list[Note]) -> dict[str, Any]:  # fmt: skip
    """The pod's container: torchrun (placed on the Master pod for ``fixed_nodes`` > 1), its variables, the port."""
    L = cfg.launch
    argv = list(command.argv)
    variables = shell_references(argv)
    if fixed_nodes is not None and fixed_nodes > 1:
        argv[1:1] = [f"--nnodes={fixed_nodes}", "--node-rank=$(RANK)", "--master-addr=$(MASTER_ADDR)",
                     "--master-port=$(MASTER_PORT)"]  # fmt: skip
    if variables:  # a pod's command is not run by a shell: give it one, for the variables the line uses
        argv = ["/bin/bash", "-c", NodeCommand(None, tuple(argv)).shell()]
        notes.append(Note("launch", "spec.pytorchReplicaSpecs.*.template.spec.containers[0].env", variables,
                          Fidelity.DEFERRED, f"the command uses {', '.join(variables)}: set them in the container's "
                          "env (a pod's command runs under bash -c for them)"))  # fmt: skip
    image = cfg.extensions.get("launch", {}).get("kubernetes.image", KUBERNETES_PLACEHOLDERS["image"])
    container: dict[str, Any] = {"name": _PYTORCHJOB_CONTAINER, "image": image, "command": argv, "ports": [
        {"name": _PYTORCHJOB_PORT, "containerPort": _pytorchjob_port(L, elastic=fixed_nodes is None)}]}  # fmt: skip
    if command.env:
        container["env"] = [{"name": k, "value": str(v)} for k, v in command.env.items()]
    return container


def _pytorchjob_port(L: LaunchConfig, elastic: bool) -> int:
    """The port the operator's rendezvous uses: the master's (fixed size) or the rendezvous endpoint's (elastic)."""
    if elastic:
        port = _endpoint(L.rdzv_endpoint)[1] if L.rdzv_endpoint else None
    else:
        port = L.master_port
    return port if isinstance(port, int) else DEFAULT_PORT


def _replica(count: int, container: dict[str, Any]) -> dict[str, Any]:
    """A replica spec of ``count`` pods running ``container`` (a copy each: the YAML is written without anchors)."""
    return {"replicas": count, "restartPolicy": "OnFailure",
            "template": {"spec": {"containers": [copy.deepcopy(container)]}}}  # fmt: skip


def _kubernetes_notes(cfg: TorshConfig, elastic: bool, kept: Mapping[str, Any]) -> list[Note]:
    """Notes for the launch fields the PyTorchJob (rather than torchrun's options) carries, and for its placeholders."""
    notes = _kubernetes_placeholders(kept) + _kubernetes_rendezvous(cfg.launch, elastic)
    for key in ("hosts", "hostfile", "include", "exclude", "master_addr", "master_port", "node_rank",
                "rdzv_endpoint", "rdzv_conf", "world_size"):  # fmt: skip
        value = get_path(cfg, f"launch.{key}")
        if value not in (None, [], {}, False) and not any(n.source_path == f"launch.{key}" for n in notes):
            notes.append(Note(f"launch.{key}", None, value, Fidelity.APPROXIMATE, "Kubernetes places the pods "
                              "(nodeSelector / affinity choose the nodes) and the training operator gives torchrun "
                              "the rendezvous address"))  # fmt: skip
    notes += [Note(f"extensions.launch.{k}", None, kept[k], Fidelity.DROPPED, "each pod runs torchrun itself")
              for k in ("wrapper", "program") if kept.get(k) is not None]  # fmt: skip
    notes += [Note(f"extensions.launch.{k}", None, v, Fidelity.DROPPED, "a Slurm setting: Kubernetes schedules "
                   "with the pod's resources, nodeSelector and the operator's schedulingPolicy")
              for k, v in kept.items() if k.startswith("slurm.")]  # fmt: skip
    return notes


def _kubernetes_placeholders(kept: Mapping[str, Any]) -> list[Note]:
    """The image and name (kept from a manifest read, else placeholders) and the pods' resources (a placeholder)."""
    container = "spec.pytorchReplicaSpecs.*.template.spec.containers[0]"
    if "kubernetes.image" in kept:
        notes = [Note("extensions.launch.kubernetes.image", f"{container}.image", kept["kubernetes.image"],
                      Fidelity.EXACT)]  # fmt: skip
    else:
        notes = [Note("image", f"{container}.image", "<image>", Fidelity.DEFERRED, "not in a launch line: replace "
                      "<image> with an image holding your code, torch and torsh")]  # fmt: skip
    if "kubernetes.name" in kept:
        notes.append(Note("extensions.launch.kubernetes.name", "metadata.name", kept["kubernetes.name"],
                          Fidelity.EXACT))
    notes.append(Note("resources", f"{container}.resources", None, Fidelity.DEFERRED, "not in a launch line: request "
                      "each pod's GPUs (limits nvidia.com/gpu: the processes per node), CPUs and memory"))  # fmt: skip
    return notes


def _kubernetes_counts(L: LaunchConfig, elastic: bool) -> list[Note]:
    """Where the node counts went: the replicas, or the elastic policy's range."""
    notes = []
    if L.nnodes is not None:
        target = "spec.elasticPolicy.minReplicas" if elastic else "spec.pytorchReplicaSpecs (Master + Workers)"
        notes.append(Note("launch.nnodes", target, L.nnodes, Fidelity.EXACT))
    if L.max_nnodes is not None:
        notes.append(Note("launch.max_nnodes", "spec.elasticPolicy.maxReplicas", L.max_nnodes, Fidelity.EXACT))
    if L.standalone:
        notes.append(Note("launch.standalone", None, True, Fidelity.EXACT, "one pod, whose torchrun meets on itself"))
    return notes


def _kubernetes_rendezvous(L: LaunchConfig, elastic: bool) -> list[Note]:
    """Where the node counts, the rendezvous and the port went in the PyTorchJob."""
    policy, port = "spec.elasticPolicy", "spec.pytorchReplicaSpecs.*.template.spec.containers[0].ports[pytorchjob-port]"
    notes = _kubernetes_counts(L, elastic) + _kubernetes_ports(L, elastic, port)
    if L.rdzv_backend is not None:
        other = L.rdzv_backend not in ("static", "c10d")
        notes.append(Note("launch.rdzv_backend", f"{policy}.rdzvBackend" if elastic else None, L.rdzv_backend,
                          Fidelity.APPROXIMATE if other else Fidelity.EXACT,
                          "the training operator's rendezvous is c10d on the first worker" if other else
                          "" if elastic else "torchrun meets on the Master pod"))  # fmt: skip
    if L.rdzv_id is not None:
        notes.append(Note("launch.rdzv_id", f"{policy}.rdzvId" if elastic else None, L.rdzv_id,
                          Fidelity.EXACT if elastic else Fidelity.DROPPED,
                          "" if elastic else "a fixed-size job meets on the Master pod, without a run id"))
    return notes


def _kubernetes_ports(L: LaunchConfig, elastic: bool, port: str) -> list[Note]:
    """The master's port (fixed size) or the rendezvous endpoint's (elastic): the container's port."""
    if isinstance(L.master_port, int) and not elastic:
        return [Note("launch.master_port", port, L.master_port, Fidelity.EXACT, "the training operator's MASTER_PORT")]
    if L.rdzv_endpoint and elastic and isinstance(_endpoint(L.rdzv_endpoint)[1], int):
        return [Note("launch.rdzv_endpoint", port, L.rdzv_endpoint, Fidelity.APPROXIMATE, "the rendezvous port; the "
                     "training operator puts the rendezvous on the first worker pod")]  # fmt: skip
    return []


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
