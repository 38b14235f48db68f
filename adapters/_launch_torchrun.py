"""The torchrun command: one per node (or one line for every node when they run the same), with its rendezvous,
counts and device selection, from the plan of :mod:`torsh.adapters._launch_plan`."""

from __future__ import annotations

from typing import Any

from torsh.adapters._hostfile import Node
from torsh.concepts.launch import DEFAULT_PORT
from torsh.config import TorshConfig
from torsh.translate import Fidelity, Note

from ._launch_plan import (
    _TORCHRUN_OPTIONS,
    _Writer,
    LaunchCommand,
    NodeCommand,
    Plan,
    _filter_note,
    _master_notes,
    _options,
    _port,
    _topology_notes,
    _uniform,
)


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
