"""Generated DeepSpeed configs: read -> write -> read is a fixed point, and DeepSpeed accepts every export."""

from __future__ import annotations

import os

import pytest
from adapter_validator import assert_accounted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torsh import adapters

optional = st.none()


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


precision = st.sampled_from([{}, {"bf16": {"enabled": True}}, {"fp16": {"enabled": True}},
                             {"fp16": {"enabled": True, "loss_scale": 128.0, "hysteresis": 3}},
                             {"fp16": {"enabled": False, "initial_scale_power": 8}, "bf16": {"enabled": True}},
                             {"bfloat16": {"enabled": True, "check_grad_overflow": False}}])  # fmt: skip
optimizer = st.one_of(st.none(), st.builds(
    lambda t, lr, wd, mode, torch_adam: {"type": t, "params": _drop_none(
        {"lr": lr, "weight_decay": wd, "adam_w_mode": mode, "torch_adam": torch_adam})},
    st.sampled_from(["Adam", "AdamW", "adam"]), st.floats(1e-6, 1e-2), st.one_of(optional, st.floats(0, 0.3)),
    st.one_of(optional, st.booleans()), st.one_of(optional, st.booleans())))  # fmt: skip
scheduler = st.one_of(st.none(), st.sampled_from([
    {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}},
    {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_max_lr": 1e-3}},
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "cos_min_ratio": 0.1}},
    {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}},
    {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 5}},
    {"type": "StepLR", "params": {"step_size": 3}}]))  # fmt: skip
zero = st.builds(lambda stage, opt, param, pin, hpz: _drop_none({
    "stage": stage, "offload_optimizer": {"device": opt, "pin_memory": pin} if opt else None,
    "offload_param": {"device": param} if param else None, "zero_hpz_partition_size": hpz}),
    st.integers(0, 3), st.sampled_from([None, "cpu", "none"]), st.sampled_from([None, "cpu"]), st.booleans(),
    st.sampled_from([None, 1, 2]))  # fmt: skip
configs = st.builds(
    lambda p, o, s, z, clip, comm, accum: _drop_none({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, **p, "optimizer": o,
        "scheduler": s, "zero_optimization": z, "gradient_clipping": clip, "communication_data_type": comm,
        "data_types": {"grad_accum_dtype": accum} if accum else None}),
    precision, optimizer, scheduler, zero, st.sampled_from([None, 0.0, 0.5, 1.0]),
    st.sampled_from([None, "fp32", "bf16"]), st.sampled_from([None, "fp32"]))  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
def test_read_write_read_is_a_fixed_point(raw):
    first = adapters.read(raw, "deepspeed")
    assert_accounted(raw, first)
    again = adapters.read(adapters.write(first.result, "deepspeed").result, "deepspeed").result
    assert again.model_dump() == first.result.model_dump()


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs)
def test_deepspeed_accepts_every_export(raw):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is needed to check exports against its parser")
    from deepspeed.runtime.config import DeepSpeedConfig

    DeepSpeedConfig(adapters.write(adapters.read(raw, "deepspeed").result, "deepspeed").result)
