"""The fsdp dialect: FSDP1 and FSDP2 kwargs read, written in either generation, and the FSDP2 snippet."""

from __future__ import annotations

import subprocess
import sys

import pytest
from adapter_validator import assert_accounted, validate_identity

from torsh import adapters
from torsh.config import AUTO, TorshConfig
from torsh.errors import ConfigError
from torsh.translate import Fidelity

FSDP1_DEFAULTS = {"backward_prefetch": "BACKWARD_PRE", "state_dict_type": "FULL_STATE_DICT",
                  "sync_module_states": False, "forward_prefetch": False}  # fmt: skip


def _without_defaults(payload: dict) -> dict:
    """FSDP1 kwargs with the arguments that equal torch's defaults left out (the writer leaves them out)."""
    return {k: v for k, v in payload.items() if FSDP1_DEFAULTS.get(k, object()) != v}


def _fidelity(translation, path: str) -> Fidelity:
    return next(n.fidelity for n in translation.notes if n.source_path == path)


# ---- identity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [
    {"sharding_strategy": "FULL_SHARD"},
    {"sharding_strategy": "SHARD_GRAD_OP", "cpu_offload": {"offload_params": True},
     "auto_wrap_policy": {"transformer_layer_cls": ["LlamaDecoderLayer"]},
     "mixed_precision": {"param_dtype": "torch.bfloat16", "reduce_dtype": "torch.float32",
                         "buffer_dtype": "torch.bfloat16"},
     "backward_prefetch": "BACKWARD_POST", "forward_prefetch": True, "sync_module_states": True,
     "state_dict_type": "SHARDED_STATE_DICT", "limit_all_gathers": False, "use_orig_params": True},
    {"sharding_strategy": "HYBRID_SHARD", "device_mesh": {"shape": [-1, 8], "dim_names": ["replicate", "shard"]}},
    {"sharding_strategy": "_HYBRID_SHARD_ZERO2", "device_mesh": {"shape": [-1, 8], "dim_names": ["r", "s"]},
     "auto_wrap_policy":
     {"min_num_params": 100000000}, "backward_prefetch": None},
])  # fmt: skip
def test_fsdp1_identity(raw):
    validate_identity("fsdp1", raw, normalise=_without_defaults)


@pytest.mark.parametrize("raw", [
    {"fully_shard": {"reshard_after_forward": True}},
    {"fully_shard": {"reshard_after_forward": False, "offload_policy": {"pin_memory": False},
                     "mp_policy": {"param_dtype": "torch.bfloat16", "reduce_dtype": "torch.float32"},
                     "mesh": {"shape": [-1, 8], "dim_names": ["dp_replicate", "dp_shard"]}},
     "apply_to": ["TransformerBlock"], "state_dict_type": "FULL_STATE_DICT"},
    {"fully_shard": {"reshard_after_forward": True, "mp_policy": {"param_dtype": "torch.float16",
                                                                  "cast_forward_inputs": False}},
     "apply_to": {"min_num_params": 1000}},
])  # fmt: skip
def test_fsdp2_identity(raw):
    validate_identity("fsdp2", raw)


# ---- spellings -------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["SHARD_GRAD_OP", "ShardingStrategy.SHARD_GRAD_OP", 2, "2", "shard_grad_op"])
def test_sharding_strategy_spellings(spelling):
    cfg = adapters.read({"sharding_strategy": spelling}, "fsdp").result
    assert (cfg.sharding.stage, cfg.sharding.effective_reshard_after_forward) == (2, False)


@pytest.mark.parametrize("spelling", ["bfloat16", "torch.bfloat16", "bf16", "BFloat16"])
def test_dtype_spellings(spelling):
    cfg = adapters.read({"mixed_precision": {"param_dtype": spelling}}, "fsdp").result
    assert cfg.precision.param_dtype == "bf16"


def test_enum_prefixes_and_integers():
    cfg = adapters.read({"backward_prefetch": "BackwardPrefetch.BACKWARD_POST", "state_dict_type": 3}, "fsdp").result
    assert (cfg.sharding.backward_prefetch, cfg.checkpoint.state_dict_type) == ("backward_post", "sharded")


def test_misspelt_enum_suggests_the_member():
    with pytest.raises(ConfigError) as exc:
        adapters.read({"sharding_strategy": "ShardingStrategy.FULL_SHRAD"}, "fsdp")
    problem = exc.value.problems[0]
    assert problem.path == "sharding_strategy" and problem.suggestion == "FULL_SHARD"


def test_unknown_kwarg_suggests_the_kwarg():
    with pytest.raises(ConfigError) as exc:
        adapters.read({"sharding_strategy": "FULL_SHARD", "limit_all_gather": True}, "fsdp")
    assert exc.value.problems[0].suggestion == "limit_all_gathers"


def test_unknown_dtype_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match="mixed_precision.param_dtype"):
        adapters.read({"mixed_precision": {"param_dtype": "torch.float64"}}, "fsdp")


# ---- semantics and notes ----------------------------------------------------------------------------


def test_fsdp1_defaults_are_made_explicit():
    t = adapters.read({"use_orig_params": True}, "fsdp")
    cfg = t.result
    assert cfg.sharding.stage == 3 and cfg.sharding.backward_prefetch == "backward_pre"
    assert cfg.checkpoint.state_dict_type == "full" and cfg.sharding.sync_module_states is False
    assert _fidelity(t, "sharding_strategy") is Fidelity.DEFAULTED


def test_fsdp1_mixed_precision_casts_the_root_inputs_by_default():
    assert adapters.read({"mixed_precision": {"param_dtype": "bf16"}}, "fsdp").result.precision.cast_forward_inputs
    off = {"mixed_precision": {"param_dtype": "bf16", "cast_root_forward_inputs": False}}
    assert not adapters.read(off, "fsdp").result.precision.cast_forward_inputs


def test_hybrid_shard_without_mesh_is_the_node_resolved_later():
    t = adapters.read({"sharding_strategy": "HYBRID_SHARD"}, "fsdp")
    assert t.result.sharding.hybrid_shard_size is AUTO
    assert _fidelity(t, "device_mesh") is Fidelity.DEFERRED


def test_two_dimensional_mesh_needs_a_hybrid_strategy():
    with pytest.raises(ConfigError, match="HYBRID_SHARD"):
        adapters.read({"sharding_strategy": "FULL_SHARD", "device_mesh": {"shape": [2, 4]}}, "fsdp")


def test_fsdp2_int_reshard_is_hpz_approximately():
    t = adapters.read({"fully_shard": {"reshard_after_forward": 8}}, "fsdp")
    assert (t.result.sharding.stage, t.result.sharding.hybrid_shard_size) == (3, 8)
    assert _fidelity(t, "fully_shard.reshard_after_forward") is Fidelity.APPROXIMATE


@pytest.mark.parametrize("raw, path, fidelity", [
    ({"sharding_strategy": "NO_SHARD"}, "sharding_strategy", Fidelity.APPROXIMATE),
    ({"state_dict_type": "LOCAL_STATE_DICT"}, "state_dict_type", Fidelity.APPROXIMATE),
    ({"mixed_precision": {"keep_low_precision_grads": True}}, "mixed_precision.keep_low_precision_grads",
     Fidelity.UNSUPPORTED),
    ({"ignored_modules": ["model.lm_head"]}, "ignored_modules", Fidelity.UNSUPPORTED),
    ({"limit_all_gathers": True}, "limit_all_gathers", Fidelity.IGNORED),
    ({"fully_shard": {"mp_policy": {"output_dtype": "torch.float32"}}}, "fully_shard.mp_policy.output_dtype",
     Fidelity.UNSUPPORTED),
])  # fmt: skip
def test_options_without_a_torsh_counterpart_are_notes_with_reasons(raw, path, fidelity):
    t = adapters.read(raw, "fsdp")
    note = next(n for n in t.notes if n.source_path == path)
    assert note.fidelity is fidelity and note.reason


def test_runtime_expressions_are_reported_and_kept():
    raw = {"sharding_strategy": "cfg.fsdp.sharding_strategy", "cpu_offload": {"offload_params": "args.offload"},
           "mixed_precision": "cfg.fsdp_precision", "sync_module_states": "train_config.low_cpu_fsdp"}
    t = adapters.read(raw, "fsdp")
    assert_accounted(raw, t)
    dropped = {n.source_path for n in t.notes if n.fidelity is Fidelity.DROPPED}
    assert {"sharding_strategy", "cpu_offload.offload_params", "mixed_precision", "sync_module_states"} <= dropped
    assert t.result.sharding.stage == 3  # FSDP's default, reported as such
    assert t.result.extensions["fsdp"]["sharding_strategy"] == "cfg.fsdp.sharding_strategy"


def test_mixing_generations_is_an_error():
    with pytest.raises(ConfigError, match="one generation"):
        adapters.read({"fully_shard": {}, "sharding_strategy": "FULL_SHARD"}, "fsdp")


# ---- FSDP1 -> FSDP2 ------------------------------------------------------------------------------------


def test_fsdp1_to_fsdp2_reports_every_option_fsdp2_removed():
    raw = {"sharding_strategy": "SHARD_GRAD_OP", "backward_prefetch": "BACKWARD_POST", "forward_prefetch": True,
           "sync_module_states": True, "limit_all_gathers": True, "use_orig_params": True,
           "mixed_precision": {"param_dtype": "torch.bfloat16", "buffer_dtype": "torch.bfloat16"}}
    cfg = adapters.read(raw, "fsdp").result
    written = adapters.write(cfg, "fsdp", version="fsdp2")
    assert written.result["fully_shard"]["reshard_after_forward"] is False
    notes = {n.source_path: n for n in written.notes}
    assert notes["sharding.backward_prefetch"].fidelity is Fidelity.APPROXIMATE
    assert notes["sharding.forward_prefetch"].fidelity is Fidelity.APPROXIMATE
    assert notes["sharding.sync_module_states"].fidelity is Fidelity.APPROXIMATE
    assert notes["precision.buffer_dtype"].fidelity is Fidelity.UNSUPPORTED
    assert notes["extensions.fsdp.limit_all_gathers"].fidelity is Fidelity.DROPPED
    assert "limit_all_gathers" not in written.result and "use_orig_params" not in written.result
    # FSDP1's state dict default (full) is not FSDP2's: it is written out
    assert written.result["state_dict_type"] == "FULL_STATE_DICT"


def test_stage_zero_has_no_fully_shard_equivalent():
    written = adapters.write(TorshConfig(), "fsdp", version="fsdp2")
    assert _fidelity(written, "sharding.stage") is Fidelity.UNSUPPORTED
    assert "reshard_after_forward" not in written.result.get("fully_shard", {})


def test_default_write_is_fsdp2_and_aliases_select_the_generation():
    cfg = TorshConfig.from_dict({"sharding": {"stage": 3}})
    assert "fully_shard" in adapters.write(cfg, "fsdp").result
    assert adapters.write(cfg, "fsdp1").result == {"sharding_strategy": "FULL_SHARD", "sync_module_states": True,
                                                   "state_dict_type": "SHARDED_STATE_DICT"}
    assert adapters.write(cfg, "fsdp2").result == adapters.write(cfg, "fsdp", version="fsdp2").result


def test_sniffing_tells_fsdp_from_accelerate_and_the_aliases_never_claim_a_file():
    assert adapters.sniff({"sharding_strategy": "FULL_SHARD", "mixed_precision": {"param_dtype": "bf16"}}) == "fsdp"
    assert adapters.sniff({"fully_shard": {"reshard_after_forward": True}}) == "fsdp"
    assert adapters.sniff({"mixed_precision": "bf16", "num_processes": 2, "fsdp_config": {}}) == "accelerate"


# ---- the FSDP2 snippet ----------------------------------------------------------------------------------


SNIPPET_CORE = {"sharding": {"stage": 3, "wrap": {"module_classes": ["Block"]}, "sync_module_states": True,
                             "forward_prefetch": True},
                "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32", "cast_forward_inputs": True}}  # fmt: skip


def test_snippet_names_the_mesh_policies_and_modules():
    from torsh.adapters.fsdp import snippet

    text = snippet(TorshConfig.from_dict({**SNIPPET_CORE, "sharding": {**SNIPPET_CORE["sharding"],
                                                                        "hybrid_shard_size": 4}}))
    compile(text, "snippet", "exec")
    assert "init_device_mesh(device_type, (dist.get_world_size() // shard_size, shard_size)" in text
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in text
    assert "shard_classes = {'Block'}" in text and "broadcast_from_rank0=True" in text


_RUN_SNIPPET = r"""
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
    def forward(self, x):
        return self.lin(x)
model = torch.nn.Sequential(Block(), Block())
before = [p.detach().clone() for p in model.parameters()]
exec(os.environ["SNIPPET"])
from torch.distributed.fsdp import FSDPModule
assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model)
out = model(torch.randn(2, 4))
assert out.dtype == torch.bfloat16, out.dtype
after = [p.full_tensor() for p in model.parameters()]
assert all(torch.equal(a, b) for a, b in zip(before, after))
dist.destroy_process_group()
print("ok")
"""


_JOBS = r"""
import contextlib, io, json, os, sys, traceback
import torch.distributed as dist

records = {}
for name, job in json.loads(sys.stdin.read()).items():  # each job as its own script: own globals, stdin, port
    os.environ.update(job["env"])
    sys.stdin = io.StringIO(job["stdin"])
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(job["code"], name, "exec"), {"__name__": "__main__"})
        records[name] = {"stdout": out.getvalue()}
    except BaseException:
        records[name] = {"stdout": out.getvalue(), "error": traceback.format_exc()}
    if dist.is_initialized():
        dist.destroy_process_group()
sys.stdout.write(json.dumps(records) + "\n")
"""


@pytest.fixture(scope="module")
def torch_jobs() -> dict[str, dict]:
    """The module's scripts that run torch (the FSDP2 snippet, torch's FSDP1 built from the written kwargs), each
    on a process group of one rank, in one Python process; ``{job: {"stdout", "error"?}}``."""
    pytest.importorskip("torch", reason="the written configs are run with torch")
    import json
    import socket

    from torsh.adapters.fsdp import snippet

    def port() -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return str(s.getsockname()[1])

    jobs = {
        "snippet": {"code": _RUN_SNIPPET, "stdin": "",
                    "env": {"SNIPPET": snippet(TorshConfig.from_dict(SNIPPET_CORE)), "PORT": port()}},
        "fsdp1": {"code": _BUILD_FSDP1, "stdin": json.dumps([adapters.write(TorshConfig.from_dict(c), "fsdp1").result
                                                              for c in FSDP1_CORES]), "env": {"PORT": port()}},
    }  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", _JOBS], input=json.dumps(jobs), capture_output=True, text=True,
                          env={"PATH": "", "OMP_NUM_THREADS": "1"}, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_snippet_runs_on_one_cpu_rank(torch_jobs):
    job = torch_jobs["snippet"]
    assert "error" not in job and "ok" in job["stdout"], job.get("error")


@pytest.mark.parametrize("dialect", ["fsdp", "fsdp1", "fsdp2", "fairscale", "accelerate"])
def test_dialect_schemas_are_valid_and_served(dialect, capsys):
    import jsonschema

    from torsh import schemas
    from torsh.cli import main

    jsonschema.Draft202012Validator.check_schema(schemas.load(dialect))
    assert main(["schema", dialect]) == 0 and dialect in capsys.readouterr().out


def test_schema_errors_point_at_the_key():
    with pytest.raises(ConfigError) as exc:
        adapters.read({"fully_shard": {"mesh": {"shape": [1, 2, 3]}}}, "fsdp")
    assert exc.value.problems[0].path == "fully_shard.mesh.shape"


# ---- written FSDP1 kwargs are torch's own API --------------------------------------------------------------

_BUILD_FSDP1 = r"""
import functools, json, os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
from torch.distributed import fsdp
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
    def forward(self, x):
        return self.lin(x)

def dtype(name):
    return getattr(torch, name.split(".")[-1]) if name else None

def materialise(kw):  # the JSON spellings -> the objects FullyShardedDataParallel takes
    kw = dict(kw)
    kw["sharding_strategy"] = fsdp.ShardingStrategy[kw["sharding_strategy"]]
    if "mixed_precision" in kw:
        kw["mixed_precision"] = fsdp.MixedPrecision(**{k: dtype(v) if k.endswith("dtype") else v
                                                       for k, v in kw["mixed_precision"].items()})
    if "cpu_offload" in kw:
        kw["cpu_offload"] = fsdp.CPUOffload(**kw["cpu_offload"])
    if "backward_prefetch" in kw:
        kw["backward_prefetch"] = kw["backward_prefetch"] and fsdp.BackwardPrefetch[kw["backward_prefetch"]]
    policy = kw.pop("auto_wrap_policy", {})
    if "transformer_layer_cls" in policy:
        kw["auto_wrap_policy"] = ModuleWrapPolicy({globals()[c] for c in policy["transformer_layer_cls"]})
    elif "min_num_params" in policy:
        kw["auto_wrap_policy"] = functools.partial(size_based_auto_wrap_policy, min_num_params=policy["min_num_params"])
    state_dict_type = fsdp.StateDictType[kw.pop("state_dict_type", "FULL_STATE_DICT")]
    return kw, state_dict_type

for payload in json.loads(sys.stdin.read()):
    kwargs, state_dict_type = materialise(payload)
    model = fsdp.FullyShardedDataParallel(torch.nn.Sequential(Block(), Block()), device_id=torch.device("cpu"),
                                          **kwargs)
    if not payload.get("cpu_offload"):  # FSDP1 offload needs an accelerator at the first forward
        model(torch.randn(2, 4)).float().sum().backward()
        with fsdp.FullyShardedDataParallel.state_dict_type(model, state_dict_type):
            model.state_dict()
dist.destroy_process_group()
print("ok")
"""


FSDP1_CORES = [  # sync_module_states needs a GPU in FSDP1: off here
    {"sharding": {"stage": 2, "sync_module_states": False, "wrap": {"module_classes": ["Block"]},
                  "backward_prefetch": "backward_post"},
     "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "bf16",
                   "cast_forward_inputs": True}},
    {"sharding": {"stage": 3, "sync_module_states": False, "wrap": {"min_num_params": 10},
                  "forward_prefetch": True, "backward_prefetch": "none"},
     "offload": {"params": "cpu", "optimizer": "cpu"}, "checkpoint": {"state_dict_type": "sharded"}},
]  # fmt: skip


@pytest.mark.slow
def test_written_fsdp1_kwargs_build_torch_fsdp(torch_jobs):
    """Checks the written kwargs against torch's FullyShardedDataParallel."""
    job = torch_jobs["fsdp1"]
    assert "error" not in job and "ok" in job["stdout"], job.get("error")


# ---- trainer frameworks' spellings (read only) -----------------------------------------------------------------


def test_hf_trainer_fsdp_options():
    raw = {"fsdp": "hybrid_shard offload auto_wrap", "bf16": True,
           "fsdp_config": {"min_num_params": 1000000, "backward_prefetch": "backward_post"}}
    t = adapters.read(raw, "fsdp")
    assert_accounted(raw, t)
    cfg = t.result
    assert (cfg.sharding.stage, cfg.sharding.hybrid_shard_size, cfg.sharding.wrap.min_num_params) == (3, AUTO, 1000000)
    assert (cfg.offload.params, cfg.sharding.backward_prefetch, cfg.precision.param_dtype) == ("cpu", "backward_post",
                                                                                             "bf16")


def test_framework_settings_are_not_written_as_fsdp_arguments():
    raw = {"fsdp_cpu_offload": True, "compile": True, "custom_sharded_layers": ["output"], "dtype": "bf16"}
    cfg = adapters.read(raw, "fsdp").result
    written = adapters.write(cfg, "fsdp", version="fsdp2")
    assert set(written.result) == {"fully_shard"}
    assert {n.source_path for n in written.notes if n.fidelity is Fidelity.DROPPED} >= {
        "extensions.fsdp.compile", "extensions.fsdp.custom_sharded_layers"}
