"""The migration example: a DeepSpeed script and its one-line torsh twin; ``make run``'s training part; and a
smoke comparison of the two on real DeepSpeed 0.19.8 (when installed)."""

from __future__ import annotations

import json
import os
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


#: Runs several scripts in the ranks of one launch, each unchanged as ``__main__`` (see its docstring).
RUNNER = Path(__file__).resolve().parent / "dropin_scripts" / "_run_cases.py"
STAGES = (0, 3)


def _rank(rank: int, world: int, port: int, spec: str) -> None:
    """One rank, forked from the test process, with the variables torchrun gives its ranks."""
    import runpy
    import warnings

    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      DS_ACCELERATOR="cpu")  # fmt: skip
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    runpy.run_path(str(RUNNER))["main"](spec)


def _run(script: str, tmp: Path) -> dict[int, list[float]]:
    """The example at every stage of STAGES, one after the other in one 2-rank launch; ``{stage: losses}``."""
    import _engine_harness as h

    cases, logs = [], {}
    for stage in STAGES:
        config = json.loads((EXAMPLE / "train_config.json").read_text())
        config["zero_optimization"]["stage"] = stage
        cwd = tmp / f"{script}.{stage}"
        cwd.mkdir()
        (cwd / "config.json").write_text(json.dumps(config))
        logs[stage] = cwd / "losses.json"
        cases.append({"name": f"{script} stage {stage}", "script": str(EXAMPLE / script), "cwd": str(cwd),
                      "args": ["--deepspeed_config", str(cwd / "config.json"), "--steps", "6", "--loss-log",
                               str(logs[stage])]})  # fmt: skip
    spec = tmp / f"{script}.cases.json"
    spec.write_text(json.dumps(cases))
    h.start(_rank, (2, h.free_port(), str(spec)), 2)
    return {stage: json.loads(log.read_text()) for stage, log in logs.items()}


@pytest.fixture(scope="module")
def example_losses(tmp_path_factory) -> dict[str, dict[int, list[float]]]:
    """Per-step losses of the DeepSpeed example on real DeepSpeed and of its torsh twin, at every stage."""
    pytest.importorskip("deepspeed", reason="real DeepSpeed 0.19.8 is needed for the comparison")
    tmp = tmp_path_factory.mktemp("examples")
    return {script: _run(script, tmp) for script in ("train_deepspeed.py", "train_torsh.py")}


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_same_losses_as_real_deepspeed(stage, example_losses):
    reference = example_losses["train_deepspeed.py"][stage]
    ours = example_losses["train_torsh.py"][stage]
    assert len(ours) == len(reference) == 6
    for step, (a, b) in enumerate(zip(ours, reference)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step + 1}: torsh {a} vs DeepSpeed {b}"
