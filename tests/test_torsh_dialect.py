"""The native dialect: the seed layouts, the core layout, and round trips through every file format."""

from __future__ import annotations

import pytest
from adapter_validator import assert_accounted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torsh import adapters
from torsh.config import AUTO, TorshConfig
from torsh.errors import ConfigError
from torsh.formats import dump_text, load_file, parse_text
from torsh.translate import Fidelity


def test_seed_toml_reads_with_every_key_accounted(examples):
    raw, _ = load_file(examples / "torsh" / "torsh_config.toml")
    t = adapters.read(raw)
    assert t.source == "torsh"
    assert_accounted(raw, t)
    cfg = t.result
    assert cfg.communication.backend == "nccl"
    assert (cfg.launch.master_addr, cfg.launch.master_port, cfg.launch.world_size) == ("localhost", 29500, 8)
    assert cfg.ddp.bucket_cap_mb == 25.0 and cfg.ddp.overlap_comm is True
    assert cfg.compression.method == "none"
    assert (cfg.data.epochs, cfg.batch.micro_batch_size, cfg.optimizer.lr) == (100, 32, 0.001)
    assert cfg.gradients.clip_max_norm == 1.0
    rank = next(n for n in t.notes if n.source_path == "distributed.rank")
    assert rank.fidelity is Fidelity.IGNORED and "launcher" in rank.reason


def test_seed_yaml_reads_with_every_key_accounted(examples):
    raw, _ = load_file(examples / "torsh" / "pytorch_config.yaml")
    t = adapters.read(raw)
    assert_accounted(raw, t)
    assert t.result.communication.init_method == "env://"
    assert t.result.batch.micro_batch_size == 32 and t.result.optimizer.lr == 0.001
    assert not t.lossy


def test_seed_layout_unknown_key_suggests():
    with pytest.raises(ConfigError) as exc:
        adapters.read({"distributed": {"backend": "gloo", "wrold_size": 2}}, "torsh")
    problem = exc.value.problems[0]
    assert problem.path == "distributed.wrold_size" and problem.suggestion == "world_size"


def test_seed_backend_value_is_checked():
    with pytest.raises(ConfigError, match="distributed.backend: unknown value"):
        adapters.read({"distributed": {"backend": "infiniband"}}, "torsh")


def test_core_layout_identity():
    raw = {"sharding": {"stage": 3}, "precision": {"param_dtype": "bf16"}, "batch": {"micro_batch_size": "auto"}}
    t = adapters.read(raw, "torsh")
    assert_accounted(raw, t)
    assert t.result.batch.micro_batch_size is AUTO
    assert adapters.write(t.result, "torsh").result["batch"]["micro_batch_size"] == "auto"


def test_core_layout_errors_use_dotted_paths():
    with pytest.raises(ConfigError) as exc:
        adapters.read({"sharding": {"stage": 4}, "ddp": {"bucket_cap_mb": -1}}, "torsh")
    assert {p.path for p in exc.value.problems} == {"sharding.stage", "ddp.bucket_cap_mb"}


# ---- round trips through TOML / YAML / JSON ------------------------------------------------------

FORMATS = ["toml", "yaml", "json"]


def _roundtrip(cfg: TorshConfig, fmt: str) -> TorshConfig:
    text = dump_text(adapters.write(cfg, "torsh").result, fmt)
    return adapters.read(parse_text(text, fmt), "torsh").result


@pytest.mark.parametrize("fmt", FORMATS)
def test_roundtrip_rich_config(fmt):
    cfg = TorshConfig.from_dict({
        "batch": {"global_batch_size": 64, "micro_batch_size": "auto"},
        "sharding": {"stage": 3, "hybrid_shard_size": 8, "wrap": {"module_classes": ["Block"]}},
        "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32",
                      "loss_scaling": {"mode": "dynamic", "semantics": "deepspeed_zero"}},
        "offload": {"params": "cpu", "optimizer": "cpu"},
        "optimizer": {"name": "AdamW", "lr": "auto", "betas": [0.9, 0.95], "weight_decay": 0.0},
        "scheduler": {"name": "WarmupDecayLR", "total_num_steps": 100, "warmup_num_steps": 10},
        "compression": {"method": "topk", "ratio": 0.01, "error_feedback": True},
        "launch": {"hosts": [{"name": "a", "slots": 8}], "rdzv_conf": {"timeout": "900"}},
        "extensions": {"deepspeed": {"zero_optimization.overlap_comm": True}},
    })  # fmt: skip
    assert _roundtrip(cfg, fmt) == cfg


dtypes = st.sampled_from(["fp32", "bf16", "fp16"])
maybe_auto_int = st.one_of(st.none(), st.just("auto"), st.integers(1, 4096))


@st.composite
def configs(draw) -> TorshConfig:
    stage = draw(st.integers(0, 3))
    method = draw(st.sampled_from(["none", "fp16", "bf16", "powersgd", "topk", "quantize"]))
    compression = {"method": method, "period": draw(st.integers(1, 8))}
    if method == "topk":
        compression["ratio"] = draw(st.floats(0.001, 1.0))
    if method == "quantize":
        compression["bits"] = draw(st.sampled_from([2, 4, 8]))
    if method == "powersgd":
        compression["rank"] = draw(st.integers(1, 8))
    scheduler = draw(st.sampled_from([
        None,
        {"name": "WarmupLR", "warmup_num_steps": draw(st.integers(1, 10_000)),
         "warmup_type": draw(st.sampled_from(["log", "linear"]))},
        {"name": "WarmupCosineLR", "total_num_steps": draw(st.integers(1, 10_000)),
         "cos_min_ratio": draw(st.floats(0, 1))},
        {"name": "CosineAnnealingLR", "kwargs": {"T_max": draw(st.integers(1, 100))}},
    ]))  # fmt: skip
    return TorshConfig.from_dict({
        "batch": {"global_batch_size": draw(maybe_auto_int), "micro_batch_size": draw(maybe_auto_int),
                  "gradient_accumulation_steps": draw(maybe_auto_int)},
        "sharding": {"stage": stage,
                     "reshard_after_forward": draw(st.sampled_from([None, True, False])) if stage >= 2 else None},
        "precision": {"param_dtype": draw(dtypes), "reduce_dtype": draw(st.one_of(st.none(), dtypes)),
                      "grad_accum_dtype": draw(st.one_of(st.none(), dtypes))},
        "optimizer": draw(st.one_of(st.none(), st.builds(dict, name=st.sampled_from(["AdamW", "SGD"]),
                                                         lr=st.floats(0, 1), weight_decay=st.floats(0, 1)))),
        "scheduler": scheduler,
        "gradients": {"clip_max_norm": draw(st.one_of(st.none(), st.floats(0, 10))),
                      "reduce_op": draw(st.sampled_from(["mean", "sum"]))},
        "compression": compression,
        "data": {"drop_last": draw(st.booleans()), "seed": draw(st.integers(0, 2**31))},
        "launch": {"nnodes": draw(st.one_of(st.none(), st.integers(1, 64))),
                   "script_args": draw(st.lists(st.text(min_size=1, max_size=8), max_size=3))},
    })  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs())
def test_roundtrip_property(fmt, cfg):
    assert _roundtrip(cfg, fmt) == cfg
