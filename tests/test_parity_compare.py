"""Parity comparison logic: tolerances, first divergence, calibration, the plot, the CLI without DeepSpeed."""

from __future__ import annotations

import math

import pytest

from torsh import parity
from torsh.cli import main


def records(losses, norms=None, lrs=None, skipped=None):
    n = len(losses)
    norms = norms or [1.0] * n
    lrs = lrs or [1e-3] * n
    skipped = skipped or [False] * n
    return [{"step": i + 1, "loss": losses[i], "grad_norm": norms[i], "lr": lrs[i], "loss_scale": 1.0,
             "skipped": skipped[i]} for i in range(n)]  # fmt: skip


def test_identical_runs_pass():
    run = records([3.0, 2.0, 1.0])
    result = parity.compare(run, run, parity.FP32_TOLERANCE)
    assert result.passed and result.first_divergence is None and result.max_rel_diff["loss"] == 0


def test_first_divergent_step_and_metric_are_named():
    ref = records([3.0, 2.0, 1.0, 0.5], norms=[1.0, 1.0, 1.0, 1.0])
    cand = records([3.0, 2.0, 1.00002, 0.6], norms=[1.0, 1.0, 1.0, 1.5])
    result = parity.compare(ref, cand, parity.FP32_TOLERANCE)
    assert not result.passed
    assert (result.first_divergence.step, result.first_divergence.metric) == (3, "loss")
    assert result.max_rel_diff["grad_norm"] == pytest.approx(1 / 3)


def test_skipped_flag_must_match_and_lr_is_checked():
    ref = records([1.0, 1.0], skipped=[False, True])
    assert parity.compare(ref, records([1.0, 1.0]), parity.FP32_TOLERANCE).first_divergence.metric == "skipped"
    lr = parity.compare(records([1.0], lrs=[1e-3]), records([1.0], lrs=[2e-3]), parity.FP32_TOLERANCE)
    assert lr.first_divergence.metric == "lr"


def test_missing_reference_grad_norm_is_not_compared():
    ref = records([1.0, 0.5], norms=[math.nan, math.nan])
    result = parity.compare(ref, records([1.0, 0.5], norms=[0.3, 0.2]), parity.FP32_TOLERANCE)
    assert result.passed and "no gradient norm" in result.notes[0]


def test_calibration_scales_deepspeeds_own_spread():
    a, b = records([2.0, 1.0]), records([2.0, 1.1])
    tol = parity.calibrate(a, b)
    assert tol["loss"] == pytest.approx(parity.CALIBRATION_FACTOR * (0.1 / 1.1))
    assert parity.calibrate(a, a)["loss"] == parity.LOW_PRECISION_FLOOR["loss"]


@pytest.mark.parametrize(("stage", "expected"), [(0, 1), (1, 0), (2, 0), (3, 0)])
def test_calibration_variant_uses_deepspeeds_other_code_path(stage, expected):
    config = {"zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True}}
    variant = parity.calibration_variant(config)
    assert variant["zero_optimization"]["stage"] == expected
    assert "offload_param" not in variant["zero_optimization"]  # parameter offload needs stage 3
    assert config["zero_optimization"]["stage"] == stage  # the input is not modified
    assert parity.precision_of(variant) == "bf16"


def test_plot_writes_a_png(tmp_path):
    ref, cand = records([3.0, 2.0, 1.0]), records([3.0, 2.1, 1.2])
    comparison = parity.compare(ref, cand, parity.FP32_TOLERANCE)
    report = parity.ParityReport("s", "fp32", "deepspeed 0.19.8", "torsh", comparison, ref, cand)
    parity.plot(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.to_dict()["verdict"] == "fail"


def test_cli_says_how_to_install_deepspeed(monkeypatch, capsys, tmp_path):
    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 2}')
    monkeypatch.setattr(parity, "deepspeed_available", lambda: False)
    assert main(["parity", str(config)]) == 2
    assert "pip install 'torsh-distributed[parity]'" in capsys.readouterr().err
    assert main(["parity", str(tmp_path / "missing.json")]) == 2
