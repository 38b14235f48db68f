"""Which compression settings each sharding stage honours: notes at translation, errors at initialize."""

from __future__ import annotations

import subprocess
import sys

import pytest

from torsh.compression_rules import (
    compresses_at,
    compression_notes_for_stage,
    effective_error_feedback,
    effective_start_step,
    fsdp_reduce_dtype,
)
from torsh.config import CompressionConfig
from torsh.errors import ConfigError
from torsh.translate import Fidelity


def cfg(**kwargs) -> CompressionConfig:
    return CompressionConfig(**kwargs)


@pytest.mark.parametrize("method", ["powersgd", "topk", "quantize"])
@pytest.mark.parametrize("stage", [2, 3])
def test_bucket_methods_are_unsupported_notes_under_fsdp(method, stage):
    extra = {"topk": {"ratio": 0.01}, "quantize": {"bits": 8}}.get(method, {})
    notes = compression_notes_for_stage(cfg(method=method, **extra), stage)
    assert [(n.source_path, n.fidelity, n.value) for n in notes] == [
        ("compression.method", Fidelity.UNSUPPORTED, method)
    ]
    assert f"sharding.stage {stage}" in notes[0].reason and "stage 0 or 1" in notes[0].reason


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("method", ["fp16", "powersgd", "topk"])
def test_ddp_stages_honour_every_method(method, stage):
    extra = {"topk": {"ratio": 0.01}}.get(method, {})
    assert compression_notes_for_stage(cfg(method=method, period=4, start_step=10, **extra), stage) == []


def test_cast_methods_under_fsdp_are_noted_only_for_a_schedule():
    assert compression_notes_for_stage(cfg(method="bf16"), 3) == []
    notes = compression_notes_for_stage(cfg(method="bf16", period=2, start_step=5), 3)
    assert {n.source_path for n in notes} == {"compression.period", "compression.start_step"}
    assert all(n.fidelity is Fidelity.UNSUPPORTED for n in notes)


@pytest.mark.parametrize("method,extra", [("powersgd", {}), ("topk", {"ratio": 0.01}), ("quantize", {"bits": 4})])
def test_initialize_refuses_bucket_methods_under_fsdp(method, extra):
    from torsh.engine.compression import check_fsdp_compression

    with pytest.raises(ConfigError) as err:
        check_fsdp_compression(cfg(method=method, **extra), None)
    text = str(err.value)
    assert "compression.method" in text and method in text and "stage 0 or 1" in text


@pytest.mark.parametrize("reduce_dtype", [None, "fp16"])
def test_fp16_under_fsdp_is_the_reduce_dtype(reduce_dtype):
    from torsh.engine.compression import check_fsdp_compression

    check_fsdp_compression(cfg(method="fp16"), reduce_dtype)  # returns: the engine reduces in fp16
    assert fsdp_reduce_dtype(cfg(method="fp16"), reduce_dtype) == "fp16"
    check_fsdp_compression(cfg(), "fp32")  # no compression: nothing to check
    assert fsdp_reduce_dtype(cfg(), reduce_dtype) == reduce_dtype


def test_conflicting_reduce_dtype_under_fsdp_is_an_error_that_says_what_to_change():
    from torsh.engine.compression import check_fsdp_compression

    with pytest.raises(ConfigError) as err:
        check_fsdp_compression(cfg(method="bf16"), "fp32")
    text = str(err.value)
    assert "compression.method" in text and "precision.reduce_dtype" in text
    assert "Set precision.reduce_dtype to 'bf16'" in text and "compression.method to 'none'" in text


def test_defaults_follow_torch_and_the_config_docs():
    assert effective_error_feedback(cfg(method="topk", ratio=0.1)) is True
    assert effective_error_feedback(cfg(method="powersgd")) is True
    assert effective_error_feedback(cfg(method="quantize", bits=8)) is False
    # PowerSGD memory needs DDP's rebuilt buckets; without memory it may start at once.
    assert effective_start_step(cfg(method="powersgd")) == 2
    assert effective_start_step(cfg(method="powersgd", start_step=7)) == 7
    assert effective_start_step(cfg(method="powersgd", error_feedback=False, warm_start=False)) == 0


def test_schedule_compresses_from_the_start_every_period():
    schedule = cfg(method="fp16", start_step=3, period=4)
    assert [s for s in range(16) if compresses_at(schedule, s)] == [3, 7, 11, 15]
    assert not any(compresses_at(cfg(), s) for s in range(5))


def test_rules_do_not_import_torch():
    code = "import sys, torsh.compression_rules; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
