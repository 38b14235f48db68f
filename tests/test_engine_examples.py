"""The migration example: a DeepSpeed script and its one-line torsh twin; ``make run``'s training part; and a
smoke comparison of the two on real DeepSpeed 0.19.8 (when installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "migration_examples" / "deepspeed"


def test_torsh_script_is_the_deepspeed_script_with_one_line_changed():
    ds = (EXAMPLE / "train_deepspeed.py").read_text().splitlines()
    ts = (EXAMPLE / "train_torsh.py").read_text().splitlines()
    changed = [(a, b) for a, b in zip(ds, ts) if a != b]
    assert len(ds) == len(ts) and changed == [("import deepspeed", "import torsh as deepspeed")]



@pytest.mark.slow
def test_demo_converts_the_deepspeed_config_and_trains(capsys):
    from torsh import demo

    assert demo.train(steps=4) == 0
    out = capsys.readouterr().out
    assert "optimizer.type" in out  # the conversion report
    assert "loss curve" in out and "over 4 steps (stage 2, world size 2" in out


def _run(script: str, config: dict, tmp: Path, python: str = sys.executable) -> list[float]:
    cfg, log = tmp / f"{script}.json", tmp / f"{script}.losses.json"
    cfg.write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([python, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
                    str(EXAMPLE / script), "--deepspeed_config", str(cfg), "--steps", "6", "--loss-log", str(log)],
                   env=env, check=True, capture_output=True, timeout=600)  # fmt: skip
    return json.loads(log.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_same_losses_as_real_deepspeed(stage, tmp_path):
    pytest.importorskip("deepspeed", reason="real DeepSpeed 0.19.8 is needed for the comparison")
    config = json.loads((EXAMPLE / "train_config.json").read_text())
    config["zero_optimization"]["stage"] = stage
    reference = _run("train_deepspeed.py", config, tmp_path)
    ours = _run("train_torsh.py", config, tmp_path)
    assert len(ours) == len(reference) == 6
    for step, (a, b) in enumerate(zip(ours, reference)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step + 1}: torsh {a} vs DeepSpeed {b}"
