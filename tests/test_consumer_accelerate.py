"""Every Accelerate YAML torsh writes is accepted by Accelerate 1.15 and means what the source meant.

All files (corpus, migration examples, "auto" fixtures) x every Accelerate backend: the YAML goes through
``accelerate launch``'s own parser and validation and the environment it gives the processes, and the plugin
Accelerate builds from that environment is compared with the source config (distributed type, process and
machine counts, mixed precision, FSDP version / sharding / offload / wrap policy / prefetch, DeepSpeed stage and
offload) - unless the write report declares that value lossy. A sample is run for real: ``accelerate launch
--config_file X`` starts a 2-process CPU probe that reports the state Accelerate built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="Accelerate (pinned in requirements-dev.txt) checks the written YAML")

from consumers.accelerate_view import launch_view  # noqa: E402

from torsh import adapters  # noqa: E402
from torsh.config import AUTO, TorshConfig  # noqa: E402
from torsh.contract import config_world_size  # noqa: E402
from torsh.errors import ConfigError  # noqa: E402
from torsh.formats import dump_text  # noqa: E402
from torsh.translate import Fidelity  # noqa: E402

pytestmark = pytest.mark.slow  # multi-process runs: started first by make test's workers

HERE = Path(__file__).parent
ROOTS = (HERE / "fixtures" / "corpus", HERE.parent / "migration_examples", HERE / "fixtures" / "consumer" / "auto")
FILES = sorted(p for base in ROOTS for p in base.rglob("*") if p.suffix in (".json", ".yaml", ".yml", ".toml", ".conf"))
BACKENDS = (None, "fsdp1", "fsdp2", "deepspeed", "ddp")
_DDP_TYPES = {"MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU", "NO"}
_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def readable(path: Path):
    try:
        return adapters.load(path)
    except ConfigError:
        return None


def write(cfg: TorshConfig, backend: str | None, tmp_path: Path):
    written = adapters.write(cfg, "accelerate", version=backend)
    out = tmp_path / "accelerate.yaml"
    out.write_text(dump_text(written.result, "yaml"), encoding="utf-8")
    return written, out


def lossy(written, *prefixes: str) -> bool:
    """The write report says the value under one of these core paths is not carried exactly."""
    return any(n.lossy and n.source_path.startswith(prefixes) for n in written.notes)


def check_meaning(cfg: TorshConfig, written, view: dict) -> None:
    """What Accelerate built against what the source config says."""
    data = written.result
    kind = data["distributed_type"]
    assert view["distributed_type"] == kind
    stated = config_world_size(cfg)
    if stated is not None:
        assert view["num_processes"] == stated[0]
    else:  # not in the file: the report names the flag that accelerate launch then needs
        assert "num_processes" not in data
        assert any("--num_processes" in n.reason for n in written.notes)
    assert view["num_machines"] == (cfg.launch.nnodes if isinstance(cfg.launch.nnodes, int) else 1)
    dtype = cfg.precision.param_dtype
    if not lossy(written, "precision.param_dtype"):
        assert view["mixed_precision"] == ("no" if dtype is AUTO else _PRECISION[dtype])
    check_parallelism(cfg, written, view)
    s = cfg.sharding
    if kind == "FSDP":
        check_fsdp(cfg, written, view["fsdp"])
    elif kind == "DEEPSPEED":
        ds = view["deepspeed"]
        assert ds["zero_stage"] == s.stage and ds["config"]["zero_optimization"]["stage"] == s.stage
        if not lossy(written, "offload"):
            assert ds["offload_param_device"] == cfg.offload.params
            assert ds["offload_optimizer_device"] == cfg.offload.optimizer
    else:
        assert kind in _DDP_TYPES
        assert s.stage == 0 or lossy(written, "sharding.stage")


def check_parallelism(cfg: TorshConfig, written, view: dict) -> None:
    """Accelerate's ParallelismConfig against the source's degrees: what Accelerator() checks (the sizes multiply to
    the process count; context parallelism only with its FSDP2 plugin, state.py) and the degrees themselves."""
    parallelism = view.get("parallelism")
    if parallelism is None:
        return
    if parallelism["total_size"] > 1 and "num_processes" in written.result:  # (else the launch flag gives it)
        assert parallelism["total_size"] == view["num_processes"], parallelism
    if parallelism["cp"] > 1:
        assert view["distributed_type"] == "FSDP" and view["fsdp"]["version"] == 2
    for name in ("tp", "cp", "sp"):
        if not lossy(written, f"parallelism.{name}"):
            assert parallelism[name] == getattr(cfg.parallelism, name), (name, parallelism)


def check_fsdp(cfg: TorshConfig, written, fsdp: dict) -> None:
    s = cfg.sharding
    version = written.result["fsdp_config"]["fsdp_version"]
    assert fsdp["version"] == version
    if not lossy(written, "sharding.stage", "sharding.hybrid_shard_size", "sharding.reshard_after_forward"):
        reshard = bool(s.effective_reshard_after_forward) if s.stage >= 2 else False
        if version == 2:
            assert fsdp["reshard_after_forward"] is reshard
        else:
            expected = ("FULL_SHARD" if reshard else "SHARD_GRAD_OP") if s.stage else "NO_SHARD"
            if s.hybrid_shard_size is not None:
                expected = "HYBRID_SHARD" if reshard else "_HYBRID_SHARD_ZERO2"
            assert fsdp["sharding_strategy"] == expected
    if not lossy(written, "offload"):
        assert fsdp["cpu_offload"] is (cfg.offload.params == "cpu")
    kept = cfg.extensions.get("accelerate", {}).get("fsdp_config.fsdp_auto_wrap_policy")
    if s.wrap.module_classes:
        assert fsdp["auto_wrap_policy"] == "transformer_auto_wrap_policy"
        assert fsdp["transformer_cls_names_to_wrap"] == list(s.wrap.module_classes)
    elif s.wrap.min_num_params:
        assert fsdp["auto_wrap_policy"] == "size_based_auto_wrap_policy"
        assert fsdp["min_num_params"] == s.wrap.min_num_params
    elif s.stage >= 2 and kept != "NO_WRAP":
        # per-layer units (the model's _no_split_modules), never the whole model as one unit
        assert fsdp["auto_wrap_policy"] == "transformer_auto_wrap_policy"
        assert any(n.source_path == "sharding.wrap" and "fsdp_transformer_layer_cls_to_wrap" in n.reason
                   for n in written.notes) or kept == "TRANSFORMER_BASED_WRAP"  # fmt: skip
    if version == 1 and not lossy(written, "sharding.backward_prefetch"):
        expected = {None: "BACKWARD_PRE", "backward_pre": "BACKWARD_PRE", "backward_post": "BACKWARD_POST",
                    "none": None}[s.backward_prefetch]  # fmt: skip
        assert fsdp["backward_prefetch"] == expected


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name[:60])
def test_accelerate_accepts_every_yaml_torsh_writes_and_builds_the_same_plugin(path, tmp_path):
    read = readable(path)
    if read is None:
        pytest.skip("not a config torsh reads (a ConfigError, covered by the property test)")
    for backend in BACKENDS:
        written, out = write(read.result, backend, tmp_path)
        extra = [] if "num_processes" in written.result else ["--num_processes", "2"]
        view = launch_view(out, *extra)  # raises what accelerate launch raises for a file it refuses
        check_meaning(read.result, written, view)


@pytest.mark.parametrize(("stage", "parallelism"), [  # (dp_replicate is HSDP: stages 2 and 3 only)
    *((stage, par) for stage in (0, 1, 2, 3) for par in ({"cp": 2}, {"cp": 2, "tp": 2})),
    *((stage, {"cp": 2, "dp_replicate": 2}) for stage in (2, 3))])  # fmt: skip
def test_accelerate_accepts_the_context_parallelism_torsh_writes(stage, parallelism, tmp_path):
    """A native context-parallel config on 8 processes, at every stage and backend: Accelerate's launcher and its
    ParallelismConfig take the file, the sizes multiply to num_processes, and cp_size is there unless the report
    says it is not (Accelerate runs cp with its FSDP2 plugin only)."""
    cfg = TorshConfig.from_dict({"parallelism": parallelism, "sharding": {"stage": stage},
                                 "launch": {"nproc_per_node": 8}})  # fmt: skip
    for backend in BACKENDS:
        written, out = write(cfg, backend, tmp_path)
        check_meaning(cfg, written, launch_view(out))


def test_deepspeed_sources_give_accelerate_the_process_count():
    # train_batch_size / (micro batch x accumulation) is the number of data-parallel ranks
    cfg = adapters.read({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                         "zero_optimization": {"stage": 3}}, "deepspeed").result  # fmt: skip
    written = adapters.write(cfg, "accelerate")
    assert written.result["num_processes"] == 4


def test_zero3_to_accelerate_fsdp_wraps_per_layer_and_prefetches():
    cfg = adapters.read({"train_batch_size": 8, "zero_optimization": {"stage": 3}}, "deepspeed").result
    for backend in ("fsdp1", "fsdp2"):
        written = adapters.write(cfg, "accelerate", version=backend)
        fsdp = written.result["fsdp_config"]
        assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        note = next(n for n in written.notes if n.source_path == "sharding.wrap")
        assert note.fidelity is Fidelity.APPROXIMATE and "same numerics" not in note.reason
        if backend == "fsdp1":
            assert fsdp["fsdp_backward_prefetch"] == "BACKWARD_PRE"


def test_yaml_with_removed_ipex_config_is_reported_and_not_written_back(tmp_path):
    raw = {"distributed_type": "MULTI_CPU", "num_processes": 2, "ipex_config": {"ipex": True}}
    read = adapters.read(raw, "accelerate")
    assert any(n.source_path == "ipex_config.ipex" and n.fidelity is Fidelity.DROPPED for n in read.notes)
    written, out = write(read.result, None, tmp_path)
    assert "ipex_config" not in written.result
    launch_view(out)


# ---- the real launcher, for a sample ------------------------------------------------------------------------

PROBE = '''
import json, os, sys
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
acc = Accelerator()
state = acc.state
out = {"distributed_type": str(state.distributed_type).split(".")[-1], "num_processes": state.num_processes,
       "process_index": state.process_index, "mixed_precision": os.environ.get("ACCELERATE_MIXED_PRECISION"),
       "world_size_env": os.environ.get("WORLD_SIZE")}
if os.environ.get("ACCELERATE_USE_FSDP") == "true":
    # Accelerate runs FSDP on accelerators only (on CPU its state is MULTI_CPU): the plugin is built here from the
    # launcher's environment exactly as Accelerator() builds it on a GPU node.
    fsdp = FullyShardedDataParallelPlugin()
    out["fsdp"] = {"version": fsdp.fsdp_version, "reshard_after_forward": fsdp.reshard_after_forward,
                   "wrap": getattr(fsdp.auto_wrap_policy, "__name__", str(fsdp.auto_wrap_policy))}
ds = getattr(state, "deepspeed_plugin", None)
if ds is not None:
    out["deepspeed"] = {"zero_stage": ds.zero_stage}
acc.wait_for_everyone()
with open(os.path.join(sys.argv[1], f"rank{state.process_index}.json"), "w") as f:
    json.dump(out, f, default=str)
'''

#: (source, backend): DeepSpeed ZeRO-2 and ZeRO-3 (offload) jobs on Accelerate's FSDP2 backend, a DDP job. Not here:
#: Accelerate's DeepSpeed backend and FSDP1 need an accelerator to start (on CPU the DeepSpeed state never forms
#: and the FSDP1 plugin asks for a current device); their YAML is checked through the launcher's environment above.
LAUNCH_SAMPLE = [("migration_examples/deepspeed/zero2_bf16_adamw_warmupdecay.json", "fsdp2"),
                 ("migration_examples/deepspeed/zero3_cpu_offload.json", "fsdp2"),
                 ("tests/fixtures/corpus/accelerate/huggingface__trl__multi_gpu.yaml", "ddp")]  # fmt: skip


@pytest.mark.parametrize("source, backend", LAUNCH_SAMPLE, ids=[f"{Path(s).stem[:20]}-{b}" for s, b in LAUNCH_SAMPLE])
def test_accelerate_launch_runs_the_written_yaml_on_two_cpu_processes(source, backend, tmp_path):
    cfg = adapters.load(HERE.parent / source).result
    # two processes on this machine: the process count is the one thing set for the test run
    cfg = cfg.resolve_deferred({"launch.world_size": 2, "launch.nnodes": None, "launch.nproc_per_node": None})
    written, out = write(cfg, backend, tmp_path)
    data = {**written.result, "use_cpu": True, "main_process_port": 0}
    out.write_text(dump_text(data, "yaml"), encoding="utf-8")
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "ACCELERATE_USE_CPU": "true"}
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(out), str(probe), str(tmp_path)]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert [r["process_index"] for r in ranks] == [0, 1]
    for state in ranks:
        assert state["num_processes"] == 2
        assert state["mixed_precision"] == _PRECISION[cfg.precision.param_dtype]
        assert state["distributed_type"] == "MULTI_CPU" and state["world_size_env"] == "2"
        if backend == "fsdp2":
            assert state["fsdp"]["version"] == 2
            assert state["fsdp"]["reshard_after_forward"] is bool(cfg.sharding.effective_reshard_after_forward)
            assert state["fsdp"]["wrap"] == "transformer_auto_wrap_policy"
        else:
            assert "fsdp" not in state
