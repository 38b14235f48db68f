"""The horovodrun and mpirun commands: one line for every node, -np and the host list (or a hostfile), no
rendezvous of their own; Horovod's tunables as horovodrun's flags."""

from __future__ import annotations

from typing import Any

from torsh.adapters import _cmdline
from torsh.adapters._hostfile import format_host_list
from torsh.concepts.launch import DEFAULT_PORT, shell_references
from torsh.config import TorshConfig
from torsh.translate import Fidelity, Note

from ._launch_plan import (
    _HOROVODRUN_OPTIONS,
    _Writer,
    LaunchCommand,
    NodeCommand,
    Plan,
    _filter_note,
    _launcher_of,
    _options,
    _port,
    _topology_notes,
)


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
