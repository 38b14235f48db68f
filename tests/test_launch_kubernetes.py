"""Kubernetes: ``torsh-migrate launch "<line>" --to kubernetes`` writes a Kubeflow ``PyTorchJob`` manifest.

The manifest is checked by the training operator's own API types (its Python SDK, ``kubeflow-training``, generated
from the same Go types as the PyTorchJob CRD, with Kubernetes' ``V1PodTemplateSpec`` for the pods): every key must
be one of theirs, every value of their type, every required field present. The command each pod runs is then given
to torchrun's own parser with the variables the training operator sets in that pod, and a two-pod job is run here
as the operator would run it.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from torsh import adapters
from torsh.adapters import launch
from torsh.adapters._launch_writers import plan
from torsh.errors import ConfigError
from torsh.translate import Fidelity

pytestmark = pytest.mark.slow  # multi-process runs: started first by make test's workers

LINES = [
    "torchrun --nnodes 4 --nproc-per-node 8 train.py --lr 1e-4",
    "deepspeed --num_nodes 2 --num_gpus 4 --master_port 29600 train.py --deepspeed ds.json",
    "NCCL_DEBUG=INFO torchrun --nnodes=2 --nproc_per_node=2 -m pkg.train --epochs 3",
    "torchrun --standalone --nproc-per-node gpu train.py",
    "torchrun --nnodes 1:4 --nproc-per-node 2 --max-restarts 3 --rdzv-id job7 --rdzv-backend c10d "
    "--rdzv-endpoint head:29400 train.py",
    "horovodrun -np 8 -H a:4,b:4 python train.py",
    "python -m torch.distributed.launch --nproc_per_node 2 --use_env train.py",
]


def manifest(line: str) -> tuple[dict, list]:
    written = adapters.write(launch.read(line).result, "launch", version="kubernetes")
    return yaml.safe_load(written.result), written.notes


# --------------------------------------------------------------------------------------------------
# the training operator's API types


def _api_problems(value, type_name: str, path: str, problems: list[str]):
    """Check ``value`` against an OpenAPI type of the Kubeflow or Kubernetes SDK; return the model object built
    from it (its constructor checks required fields and enumerations)."""
    kubeflow = pytest.importorskip("kubeflow.training.models", reason="kubeflow-training (requirements-dev.txt)")
    kubernetes = pytest.importorskip("kubernetes.client.models", reason="kubernetes (requirements-dev.txt)")
    if type_name.startswith("list["):
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list, got {value!r}")
            return None
        return [_api_problems(item, type_name[5:-1], f"{path}[{i}]", problems) for i, item in enumerate(value)]
    if type_name.startswith("dict("):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {value!r}")
            return None
        inner = type_name[5:-1].split(", ", 1)[1]
        return {k: _api_problems(v, inner, f"{path}.{k}", problems) for k, v in value.items()}
    scalars = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}
    if type_name in scalars:
        wrong_bool = type_name in ("int", "float") and isinstance(value, bool)
        if wrong_bool or not isinstance(value, scalars[type_name]):
            problems.append(f"{path}: expected {type_name}, got {value!r}")
        return value
    model = getattr(kubeflow, type_name, None) or getattr(kubernetes, type_name)
    if not isinstance(value, dict):
        problems.append(f"{path}: expected a {type_name} mapping, got {value!r}")
        return None
    by_key = {key: attr for attr, key in model.attribute_map.items()}
    problems += [f"{path}.{key}: not a field of {type_name}" for key in value if key not in by_key]
    kwargs = {by_key[k]: _api_problems(v, model.openapi_types[by_key[k]], f"{path}.{k}", problems)
              for k, v in value.items() if k in by_key}  # fmt: skip
    try:
        return model(**kwargs)
    except ValueError as exc:
        problems.append(f"{path}: {exc}")
        return None


def pytorchjob_problems(job: dict) -> list[str]:
    problems: list[str] = []
    _api_problems(job, "KubeflowOrgV1PyTorchJob", "", problems)
    if (job.get("apiVersion"), job.get("kind")) != ("kubeflow.org/v1", "PyTorchJob"):
        problems.append(f"not a kubeflow.org/v1 PyTorchJob: {job.get('apiVersion')} {job.get('kind')}")
    return problems


def test_the_checker_refuses_what_the_api_refuses():
    job, _ = manifest(LINES[0])
    assert pytorchjob_problems(job) == []
    bad = yaml.safe_load(yaml.safe_dump(job))
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "3"
    bad["spec"]["elasticPolicy"] = {"minReplica": 1}
    del bad["spec"]["runPolicy"]
    del bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"]
    problems = "\n".join(pytorchjob_problems(bad))
    assert "replicas: expected int" in problems
    assert "elasticPolicy.minReplica: not a field" in problems
    assert "run_policy" in problems and "`name`, must not be `None`" in problems


# --------------------------------------------------------------------------------------------------
# the manifests


@pytest.mark.parametrize("line", LINES)
def test_every_manifest_is_a_valid_pytorchjob_with_its_placeholders_named(line):
    job, notes = manifest(line)
    assert pytorchjob_problems(job) == []
    deferred = {n.source_path for n in notes if n.fidelity is Fidelity.DEFERRED}
    assert {"image", "resources"} <= deferred
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        assert container["name"] == "pytorch" and container["command"][0] == "torchrun"
        (port,) = container["ports"]
        assert port["name"] == "pytorchjob-port" and isinstance(port["containerPort"], int)


def test_fixed_nodes_are_a_master_and_workers_and_the_counts_are_exact():
    job, notes = manifest("deepspeed --num_nodes 3 --num_gpus 4 --master_port 29600 train.py --deepspeed ds.json")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 2
    assert job["spec"]["nprocPerNode"] == "4" and "elasticPolicy" not in job["spec"]
    assert specs["Master"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 29600
    assert any(n.source_path == "launch.nnodes" and n.fidelity is Fidelity.EXACT for n in notes)


def test_an_elastic_range_is_an_elastic_policy():
    job, notes = manifest(LINES[4])
    policy = job["spec"]["elasticPolicy"]
    assert policy == {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 4, "maxRestarts": 3, "rdzvId": "job7"}
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Worker"}
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4
    endpoint = next(n for n in notes if n.source_path == "launch.rdzv_endpoint")
    assert endpoint.fidelity is Fidelity.APPROXIMATE  # the operator puts the rendezvous on the first worker


def test_environment_is_the_containers_env():
    job, _ = manifest(LINES[2])
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["env"] == [{"name": "NCCL_DEBUG", "value": "INFO"}]
    assert container["command"][-4:] == ["-m", "pkg.train", "--epochs", "3"]


def test_a_node_count_held_in_a_shell_variable_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"launch.nnodes.*node count as a number"):
        manifest("torchrun --nnodes $NNODES --nproc-per-node 2 train.py")


def test_slurm_settings_are_dropped_with_a_note():
    script = ("#!/bin/bash\n#SBATCH -N 2 --partition=gpu --time=1:00:00\n"
              "srun torchrun --nnodes 2 --nproc-per-node 4 train.py\n")
    job, notes = manifest(script)
    assert pytorchjob_problems(job) == []
    dropped = {n.source_path for n in notes if n.fidelity is Fidelity.DROPPED}
    assert {"extensions.launch.slurm.partition", "extensions.launch.slurm.time"} <= dropped


def test_the_cli_writes_the_manifest_to_stdout_and_all_leaves_schedulers_out(tmp_path):
    from torsh.cli import main

    out = tmp_path / "job.yaml"
    with open(out, "w") as stdout:
        done = subprocess.run([sys.executable, "-m", "torsh.cli", "launch", LINES[0], "--to", "kubernetes"],
                              stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert pytorchjob_problems(yaml.safe_load(out.read_text())) == []
    assert "write kubernetes" in done.stderr
    with contextlib.redirect_stdout(io.StringIO()) as every, contextlib.redirect_stderr(io.StringIO()):
        assert main(["launch", LINES[0], "--to", "all"]) == 0
    written = re.findall(r"^# ---- (\w+)$", every.getvalue(), re.M)
    assert written == ["torchrun", "deepspeed", "horovodrun", "mpirun"]  # the launch lines, no scheduler files


# --------------------------------------------------------------------------------------------------
# the command each pod runs, as torchrun reads it there


def _pod_environments(job: dict) -> list[tuple[list[str], dict[str, str]]]:
    """Each pod's command and the variables the training operator (v1.7 and later) sets in it."""
    spec, name = job["spec"], job["metadata"]["name"]
    pods = []
    for kind in ("Master", "Worker"):
        if kind not in spec["pytorchReplicaSpecs"]:
            continue
        replica = spec["pytorchReplicaSpecs"][kind]
        container = replica["template"]["spec"]["containers"][0]
        total = sum(r["replicas"] for r in spec["pytorchReplicaSpecs"].values())
        port = str(container["ports"][0]["containerPort"])
        for index in range(replica["replicas"]):
            env = {e["name"]: e["value"] for e in container.get("env", [])}
            if "Master" in spec["pytorchReplicaSpecs"]:
                rank = index + (kind == "Worker")
                env |= {"MASTER_ADDR": f"{name}-master-0", "MASTER_PORT": port, "RANK": str(rank),
                        "PET_NPROC_PER_NODE": spec["nprocPerNode"], "PET_NODE_RANK": str(rank)}  # fmt: skip
            if "elasticPolicy" in spec:
                policy = spec["elasticPolicy"]
                env |= {"PET_RDZV_ENDPOINT": f"{name}-worker-0:{port}", "PET_RDZV_BACKEND": policy["rdzvBackend"],
                        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}"}  # fmt: skip
                env |= {"PET_MAX_RESTARTS": str(policy["maxRestarts"])} if "maxRestarts" in policy else {}
                env |= {"PET_RDZV_ID": policy["rdzvId"]} if "rdzvId" in policy else {}
            else:
                env["PET_NNODES"] = str(total)
            command = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), word) for word in container["command"]]
            pods.append((command, env))
    return pods


def _torchrun_args(command: list[str], env: dict[str, str]):
    from torch.distributed import run as torchrun

    saved = dict(os.environ)
    try:
        os.environ.update(env)
        return torchrun.get_args_parser().parse_args(command[1:])  # PET_* defaults are read when parsing
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize("line", LINES)
def test_torchrun_in_each_pod_sees_the_source_topology(line):
    pytest.importorskip("torch")
    source = launch.read(line).result.launch
    job, _ = manifest(line)
    pods = _pod_environments(job)
    for node_rank, (command, env) in enumerate(pods):
        assert not any("$(" in word for word in command), command
        args = _torchrun_args(command, env)
        assert str(args.nproc_per_node) == job["spec"]["nprocPerNode"]
        if "elasticPolicy" in job["spec"]:
            low, high = source.nnodes or 1, source.max_nnodes or source.nnodes or 1
            assert (args.nnodes, args.rdzv_backend) == (f"{low}:{high}", "c10d")
            assert args.rdzv_endpoint == f"torsh-worker-0:{env['PET_RDZV_ENDPOINT'].rsplit(':')[1]}"
        else:
            assert int(args.nnodes) == len(pods) and int(args.node_rank) == node_rank
            assert len(pods) == 1 or args.master_addr == "torsh-master-0"
        assert args.training_script == source.script and args.module == source.module


TRAIN = textwrap.dedent("""
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {t.item():g}", flush=True)
    dist.destroy_process_group()
""")


def test_a_two_pod_job_runs_as_the_operator_runs_it(tmp_path):
    """Both pods' commands, with the operator's variables (the master's service name is this machine), train."""
    pytest.importorskip("torch")
    (tmp_path / "train.py").write_text(TRAIN)
    job, _ = manifest("torchrun --nnodes 2 --nproc-per-node 1 --master-port 29731 train.py")
    procs = []
    for command, env in _pod_environments(job):
        command = [w.replace("torsh-master-0", "127.0.0.1") for w in command]
        procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *command[1:]], cwd=tmp_path,
                                      env={**os.environ, **env, "MASTER_ADDR": "127.0.0.1"}, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))  # fmt: skip
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "rank 0 of 2: 3" in outputs[0] and "rank 1 of 2: 3" in outputs[1]


# --------------------------------------------------------------------------------------------------
# reading manifests


@pytest.mark.parametrize("line", LINES)
def test_a_written_manifest_reads_back_to_the_same_job(line):
    source = launch.read(line).result.launch
    text = str(adapters.write(launch.read(line).result, "launch", version="kubernetes").result)
    again = launch.read(text).result.launch
    for field in ("script", "script_args", "module", "env", "max_nnodes", "max_restarts"):
        assert getattr(again, field) == getattr(source, field), field
    layout = plan(source)
    assert (again.nnodes or 1) == (layout.nnodes or 1)
    assert str(again.nproc_per_node) == str(layout.nproc if layout.nproc is not None else source.nproc_per_node)


MANIFESTS = Path(__file__).parent / "fixtures" / "corpus" / "launch" / "scripts"  # real ones (SOURCES.md)


def test_a_manifest_whose_pods_run_python_is_one_process_per_pod():
    t = launch.read((MANIFESTS / "kubeflow-simple.yaml").read_text())
    L = t.result.launch
    assert (L.nnodes, L.nproc_per_node, L.script, L.script_args) == (2, 1, "/opt/mnist/src/mnist.py", ["--epochs=1"])
    assert t.result.extensions["launch"]["kubernetes.image"] == "docker.io/kubeflowkatib/pytorch-mnist:v1beta1-45c5727"
    torchrun = str(launch.write(t.result, version="torchrun").result)
    assert "--nnodes=2" in torchrun and "--nproc-per-node=1" in torchrun


def test_a_containers_args_follow_its_command():
    pod = {"containers": [{"name": "pytorch", "image": "x", "command": ["python3", "train.py"],
                           "args": ["--backend", "gloo"]}]}  # fmt: skip
    job = {"kind": "PyTorchJob", "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": {"spec": pod}},
                                                                   "Worker": {"replicas": 3, "template": {"spec": pod}}}}}
    L = launch.read(job).result.launch
    assert (L.nnodes, L.script, L.script_args) == (4, "train.py", ["--backend", "gloo"])


def test_an_elastic_manifest_is_an_elastic_torchrun_job():
    t = launch.read((MANIFESTS / "kubeflow-elastic-imagenet.yaml").read_text())
    L = t.result.launch
    assert (L.nnodes, L.max_nnodes, L.max_restarts, L.rdzv_backend) == (1, 3, 100, "c10d")
    assert L.env == {"LOGLEVEL": "DEBUG"} and L.script == "/workspace/examples/imagenet.py"
    job = yaml.safe_load(str(launch.write(t.result, version="kubernetes").result))
    assert pytorchjob_problems(job) == []
    assert job["metadata"]["name"] == "elastic-example-imagenet"
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 3,
                                            "maxRestarts": 100}  # fmt: skip


def test_shell_variables_run_under_bash_and_are_named():
    job, notes = manifest('torchrun --nproc_per_node=${NGPU} -m torchtitan.train --config ${CONFIG} "$@"')
    command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["/bin/bash", "-c"] and "nprocPerNode" not in job["spec"]
    note = next(n for n in notes if n.source_path == "launch" and n.fidelity is Fidelity.DEFERRED)
    assert "${NGPU}" in note.reason and "${CONFIG}" in note.reason
    assert pytorchjob_problems(job) == []


@pytest.mark.parametrize("text, message", [
    ("kind: PyTorchJob\nspec: {}\n", "spec.pytorchReplicaSpecs"),
    ("kind: PyTorchJob\nspec:\n  pytorchReplicaSpecs:\n    Master: {replicas: 1}\n", "container"),
    ("kind: PyTorchJob\nspec:\n  pytorchReplicaSpecs:\n    Master:\n      template:\n        spec:\n"
     "          containers: [{name: pytorch, image: x}]\n", "entry point"),
    ("kind: PyTorchJob\nspec: [\n", "not valid YAML"),
    ("kind: PyTorchJob\nspec:\n  pytorchReplicaSpecs:\n    Master:\n      template:\n        spec:\n"
     "          containers: [{name: pytorch, command: python train.py}]\n", "a list of words"),
    ("kind: PyTorchJob\nspec:\n  pytorchReplicaSpecs:\n    Master:\n      template:\n        spec:\n"
     "          containers: [pytorch]\n", "container"),
    ("kind: PyTorchJob\nspec:\n  pytorchReplicaSpecs:\n    Master:\n      replicas: -2\n      template:\n"
     "        spec:\n          containers: [{name: pytorch, command: [torchrun, t.py]}]\n", "replicas as numbers"),
    ("kind: PyTorchJob\nspec:\n  pytorchReplicaSpecs:\n    Master:\n      replicas: .inf\n      template:\n"
     "        spec:\n          containers: [{name: pytorch, command: [torchrun, t.py]}]\n", "replicas"),
    ("kind: PyTorchJob\nspec:\n  pytorchReplicaSpecs: [Master]\n", "spec.pytorchReplicaSpecs"),
    ("kind: PyTorchJob\n", "spec.pytorchReplicaSpecs"),
])  # fmt: skip
def test_a_broken_manifest_is_a_clear_error(text, message):
    with pytest.raises(ConfigError, match=message):
        launch.read(text)
