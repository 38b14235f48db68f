"""The scheduler writers: a Slurm batch script (#SBATCH directives and one srun of the torchrun line per node) and a
Kubeflow PyTorchJob manifest (a torchrun line per pod), with placeholders the report names for what no launch line
says."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from torsh.concepts.launch import DEFAULT_PORT, shell_references
from torsh.config import LaunchConfig, TorshConfig, get_path
from torsh.errors import ConfigError, Problem
from torsh.translate import Fidelity, Note

from ._launch_plan import _LAUNCH_DEFAULTS, LaunchCommand, NodeCommand, Plan, _endpoint, plan
from ._launch_torchrun import write_torchrun


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
