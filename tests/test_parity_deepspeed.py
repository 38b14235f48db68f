"""The parity harness against real DeepSpeed: one launch runs several scenarios; fp32 stages agree."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is installed by requirements-dev.txt in CI")

from torsh import parity  # noqa: E402

BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}  # fmt: skip


@pytest.mark.slow
def test_deepspeed_fp32_stages_agree_and_records_are_complete(tmp_path):
    scenarios = [parity.Scenario(f"s{stage}", {**BASE, "zero_optimization": {"stage": stage}},
                                 model="tiny-transformer", steps=4) for stage in (1, 3)]  # fmt: skip
    seen = []
    results = parity.run(scenarios, "deepspeed", nproc=2, workdir=tmp_path, on_progress=lambda *a: seen.append(a))
    s1, s3 = (results["scenarios"][s.name]["records"] for s in scenarios)
    assert [r["step"] for r in s1] == [1, 2, 3, 4]
    assert all(set(r) == {"step", "loss", "grad_norm", "lr", "loss_scale", "skipped"} for r in s1)
    assert parity.compare(s1, s3, parity.FP32_TOLERANCE).passed
    assert s1[-1]["loss"] < s1[0]["loss"]  # it trains
    assert ("s3", 4, 4) in seen
