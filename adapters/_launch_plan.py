"""What every launch writer shares: the topology resolved once (:func:`plan`: which nodes run how many processes on
which devices), the command types, the writer's state (:class:`_Writer`: the launch section, the notes, what was
written), the option tables that map launch fields to flags, and the notes every launcher gives about hosts, device
filters and the master address. Each launcher family spells the plan in its own module."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torsh.adapters import _cmdline
from torsh.adapters._hostfile import Node, resolve_nodes
from torsh.concepts.launch import DEFAULT_NPROC, HOROVOD_LOG_LEVELS, shell_references
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
