"""The deepspeed launcher command: one line that reaches the other nodes itself through a hostfile (or one per node
with --no_ssh), with DeepSpeed's rules for --include/--exclude/--num_nodes/--num_gpus and the variables it forwards."""

from __future__ import annotations

from torsh.adapters._hostfile import format_hostfile
from torsh.config import TorshConfig
from torsh.translate import Fidelity, Note

from ._launch_plan import (
    _DEEPSPEED_FORWARDS,
    _Writer,
    LaunchCommand,
    NodeCommand,
    Plan,
    _launcher_of,
    _master_notes,
    _port,
    _topology_notes,
)


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
