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


@pytest.mark.slow
def test_parity_cli_end_to_end(tmp_path, capsys):
    """torsh-migrate parity on a DeepSpeed JSON: both engines, the verdict, a JSON report and a plot."""
    import json

    from torsh.cli import main

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**BASE, "zero_optimization": {"stage": 2}}))
    code = main(["parity", str(config), "--steps", "3", "--plot", str(tmp_path / "p.png"),
                 "--report-file", str(tmp_path / "r.json")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith("PASS: torsh vs deepspeed 0.19.8, fp32, 3 steps")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "pass" and len(report["candidate_records"]) == 3
    assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.slow
def test_torsh_against_torsh_with_another_config(tmp_path, capsys):
    """A DeepSpeed JSON against its FSDP2 translation, both on torsh (no DeepSpeed run in fp32)."""
    import json

    from torsh.cli import main

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**BASE, "zero_optimization": {"stage": 3}}))
    assert main(["convert", str(config), "--to", "torsh", "-o", str(tmp_path / "job.toml")]) == 0
    capsys.readouterr()
    code = main(["parity", str(config), "--reference", "torsh", "--candidate", str(tmp_path / "job.toml"),
                 "--steps", "3"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "torsh (candidate config) vs torsh (reference config)" in out
