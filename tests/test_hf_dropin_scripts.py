"""Hugging Face scripts whose optimizer and scheduler are built by the Trainer or the script, run unchanged under
``torsh run`` without DeepSpeed and under real DeepSpeed 0.19.8 on 2 CPU ranks, with the harness of
tests/test_dropin_scripts.py: the per-step losses agree (fp32, 1e-5 relative), the learning rates are the
warm-up's, and the weights moved as far as DeepSpeed's.

- ``trainer_zero3`` (tests/dropin_scripts/hf_trainer_client_optim.py): ``Trainer`` with
  ``TrainingArguments(deepspeed=<dict>)``, a config without ``optimizer``/``scheduler``, the Trainer's default
  optimizer (a fused AdamW: it crashed at ZeRO-2/3, "fused and foreach cannot be True together") and
  ``optim="adamw_torch"``.
- ``accelerate_scheduler_zero2`` (tests/dropin_scripts/hf_accelerate_scheduler.py): a warm-up scheduler built
  before ``accelerator.prepare`` on the script's optimizer (not passed to ``initialize``): it stepped an optimizer
  that no longer stepped, and the run trained nothing at lr 0 while the scheduler reported a rising lr.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_dropin_scripts import BLOCKER, EXIT_ABORT, SCRIPTS, TOLERANCE, _env, _relative

pytest.importorskip("transformers", reason="these cases need transformers (requirements-dev.txt installs it)")
pytest.importorskip("accelerate", reason="these cases need accelerate (requirements-dev.txt installs it)")

#: case -> (script in tests/dropin_scripts, arguments)
CASES = {"trainer_zero3": ("hf_trainer_client_optim", ["--zero_stage", "3"]),
         "accelerate_scheduler_zero2": ("hf_accelerate_scheduler", ["--zero_stage", "2"])}  # fmt: skip


def _launch(launcher: list[str], case: str, tmp: Path, env: dict, *, reference: bool = False) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "result.json"
    script, args = CASES[case]
    cmd = [*launcher, "--nproc-per-node", "2", str(SCRIPTS / f"{script}.py"), *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    if out.exists() and (proc.returncode == 0 or (reference and EXIT_ABORT in proc.stderr)):
        return json.loads(out.read_text())  # real DeepSpeed may abort at exit after writing its record
    pytest.fail(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def _both(case: str, tmp_path: Path) -> tuple[dict, dict | None]:
    blocker = tmp_path / "blocker" / "deepspeed"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(BLOCKER)
    ours = _launch([sys.executable, "-m", "torsh.run"], case, tmp_path / "torsh", _env(str(tmp_path / "blocker")))
    assert ours["deepspeed_version"] == "0.19.8+torsh" and ours["real_deepspeed_modules"] == 0
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return ours, None
    theirs = _launch([sys.executable, "-m", "torch.distributed.run"], case, tmp_path / "deepspeed", _env(),
                     reference=True)
    assert theirs["real_deepspeed_modules"] > 0
    return ours, theirs


def _same_losses(case: str, ours: list[float], theirs: list[float]) -> float:
    assert len(ours) == len(theirs) > 0
    worst = max(_relative(a, b) for a, b in zip(ours, theirs))
    assert worst <= TOLERANCE["fp32"], f"{case}: losses differ by {worst:.3g}:\n{ours}\n{theirs}"
    return worst


@pytest.mark.slow
def test_trainer_builds_optimizer_and_scheduler_and_trains_as_under_deepspeed(tmp_path):
    ours, theirs = _both("trainer_zero3", tmp_path)
    for optim, expected in (("default", "adamw_torch_fused"), ("adamw_torch", "adamw_torch")):
        run = ours["runs"][optim]
        assert run["optim"] == expected and run["fused"] is (expected == "adamw_torch_fused")
        assert run["lrs"][0] == 0.0 and run["lrs"][3] == pytest.approx(5e-3)  # warm-up from 0, then decay
        assert run["moved"] > 1e-3  # trained (the weights stayed bit-identical when the scheduler drove nothing)
        if theirs is None:
            continue
        ref = theirs["runs"][optim]
        worst = _same_losses(f"trainer {optim}", run["losses"], ref["losses"])
        assert run["lrs"] == pytest.approx(ref["lrs"]) and run["moved"] == pytest.approx(ref["moved"], rel=1e-3)
        print(f"trainer_zero3 {optim}: {len(run['losses'])} steps, worst relative loss difference {worst:.2e}, "
              f"weights moved {run['moved']:.3g} (DeepSpeed {ref['moved']:.3g})")
    if theirs is None:
        pytest.skip("DeepSpeed 0.19.8 (requirements-dev.txt) is not installed: not compared")


@pytest.mark.slow
def test_scheduler_built_before_prepare_drives_the_optimizer_that_steps(tmp_path):
    ours, theirs = _both("accelerate_scheduler_zero2", tmp_path)
    assert ours["reported"][0] == 0.0 and max(ours["reported"]) > 0
    assert ours["held"] == pytest.approx(ours["reported"])  # the lr used at every step is the one reported
    assert ours["moved"] > 1e-3
    if theirs is None:
        pytest.skip("DeepSpeed 0.19.8 (requirements-dev.txt) is not installed: not compared")
    worst = _same_losses("accelerate_scheduler_zero2", ours["losses"], theirs["losses"])
    assert ours["reported"] == pytest.approx(theirs["reported"]) and ours["held"] == pytest.approx(theirs["held"])
    assert ours["moved"] == pytest.approx(theirs["moved"], rel=1e-3)
    print(f"accelerate_scheduler_zero2: {len(ours['losses'])} steps, worst relative loss difference {worst:.2e}, "
          f"weights moved {ours['moved']:.3g} (DeepSpeed {theirs['moved']:.3g})")
