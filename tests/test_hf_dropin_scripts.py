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

import sys

import pytest

from test_dropin_scripts import BLOCKER, TOLERANCE, _env, _launch_all, _relative

pytest.importorskip("transformers", reason="these cases need transformers (requirements-dev.txt installs it)")
pytest.importorskip("accelerate", reason="these cases need accelerate (requirements-dev.txt installs it)")

#: case -> (script in tests/dropin_scripts, arguments, precision, config): test_dropin_scripts' case table
CASES = {"trainer_zero3": ("hf_trainer_client_optim", ["--zero_stage", "3"], "fp32", None),
         "accelerate_scheduler_zero2": ("hf_accelerate_scheduler", ["--zero_stage", "2"], "fp32", None)}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, dict | None]]:
    """Both cases under ``torsh run`` without DeepSpeed, then under real DeepSpeed: one launch for each side (the
    harness of tests/test_dropin_scripts.py); ``{case: (ours, theirs or None without DeepSpeed)}``."""
    tmp = tmp_path_factory.mktemp("hf")
    blocker = tmp / "blocker" / "deepspeed"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(BLOCKER)
    ours = _launch_all([sys.executable, "-m", "torsh.run"], list(CASES), tmp / "torsh", _env(str(tmp / "blocker")),
                       cases=CASES)  # fmt: skip
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return {case: (ours[case], None) for case in CASES}
    theirs = _launch_all([sys.executable, "-m", "torch.distributed.run"], list(CASES), tmp / "deepspeed", _env(),
                         reference=True, cases=CASES)  # fmt: skip
    return {case: (ours[case], theirs[case]) for case in CASES}


def _both(case: str, runs: dict) -> tuple[dict, dict | None]:
    ours, theirs = runs[case]
    for record in (ours, theirs):
        if isinstance(record, str):  # the launch failed at this case
            pytest.fail(record)
    assert ours["deepspeed_version"] == "0.19.8+torsh" and ours["real_deepspeed_modules"] == 0
    if theirs is not None:
        assert theirs["real_deepspeed_modules"] > 0
    return ours, theirs


def _same_losses(case: str, ours: list[float], theirs: list[float]) -> float:
    assert len(ours) == len(theirs) > 0
    worst = max(_relative(a, b) for a, b in zip(ours, theirs))
    assert worst <= TOLERANCE["fp32"], f"{case}: losses differ by {worst:.3g}:\n{ours}\n{theirs}"
    return worst


@pytest.mark.slow
def test_trainer_builds_optimizer_and_scheduler_and_trains_as_under_deepspeed(runs):
    ours, theirs = _both("trainer_zero3", runs)
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
def test_scheduler_built_before_prepare_drives_the_optimizer_that_steps(runs):
    ours, theirs = _both("accelerate_scheduler_zero2", runs)
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
