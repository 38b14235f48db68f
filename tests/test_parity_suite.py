"""The parity suite: torsh against real DeepSpeed 0.19.8, step by step, over the matrix users migrate.

ZeRO 0/1/2/3 x fp32/bf16 x gradient accumulation 1/4, plus clipping on/off, each DeepSpeed scheduler and CPU
offload at stage 3 - each within tolerance over 20 steps on 2 ranks. All DeepSpeed scenarios share one launch
and all torsh scenarios another. fp32 must agree to 1e-5 relative in the loss; bf16 within a band calibrated
from DeepSpeed's own spread between its stage-0 and ZeRO code paths on the same scenario.

Set TORSH_PARITY_REPORT=path.json to keep the measured differences.
"""

from __future__ import annotations

import copy
import json
import os

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is installed by requirements-dev.txt in CI")

from torsh import parity  # noqa: E402

STEPS = 20
BASE = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "weight_decay": 0.01, "torch_adam": True}}}  # fmt: skip
SCHEDULERS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 5e-3, "warmup_num_steps": 5},
    "WarmupDecayLR": {"total_num_steps": STEPS, "warmup_max_lr": 5e-3, "warmup_num_steps": 5,
                      "warmup_type": "linear"},
    "WarmupCosineLR": {"total_num_steps": STEPS, "warmup_num_steps": 5},
    "OneCycle": {"cycle_min_lr": 1e-4, "cycle_max_lr": 5e-3, "cycle_first_step_size": 5, "cycle_momentum": True},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 5},
}


def _config(stage: int, precision: str, gas: int, **extra) -> dict:
    config = copy.deepcopy(BASE)
    config["gradient_accumulation_steps"] = gas
    config["zero_optimization"] = {"stage": stage}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    config.update(extra)
    return config


def scenarios() -> list[parity.Scenario]:
    out = []
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16"):
            for gas in (1, 4):
                out.append(parity.Scenario(f"s{stage}-{precision}-gas{gas}", _config(stage, precision, gas),
                                           steps=STEPS))  # fmt: skip
    for clip in (0.0, 0.05):
        out.append(parity.Scenario(f"s2-fp32-clip{clip}", _config(2, "fp32", 1, gradient_clipping=clip), steps=STEPS))
    for name, params in SCHEDULERS.items():
        out.append(parity.Scenario(f"s1-fp32-{name}", _config(1, "fp32", 1, scheduler={"type": name, "params": params}),
                                   steps=STEPS))  # fmt: skip
    offload = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
               "offload_param": {"device": "cpu", "pin_memory": False}}  # fmt: skip
    out.append(parity.Scenario("s3-offload-fp32", {**_config(3, "fp32", 1), "zero_optimization": offload}, steps=STEPS))
    out.append(parity.Scenario("s3-offload-bf16", {**_config(3, "bf16", 1), "zero_optimization": offload}, steps=STEPS))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("parity")
    suite = scenarios()
    calibration = [parity.Scenario(f"{s.name}@cal", parity.calibration_variant(s.config), steps=STEPS)
                   for s in suite if parity.precision_of(s.config) != "fp32"]  # fmt: skip
    ds = parity.run(suite + calibration, "deepspeed", nproc=2, workdir=work)
    ts = parity.run(suite, "torsh", nproc=2, workdir=work)
    return suite, ds["scenarios"], ts["scenarios"]


def test_parity_matrix(runs):
    suite, ds, ts = runs
    measured, failures = {}, []
    for scenario in suite:
        ref, cand = ds[scenario.name], ts[scenario.name]
        if "error" in ref or "error" in cand:
            failures.append(f"{scenario.name}: {ref.get('error') or cand.get('error')}")
            continue
        if parity.precision_of(scenario.config) == "fp32":
            tolerance = parity.FP32_TOLERANCE
        else:
            tolerance = parity.calibrate(ref["records"], ds[f"{scenario.name}@cal"]["records"])
        result = parity.compare(ref["records"], cand["records"], tolerance)
        measured[scenario.name] = {"max_rel_diff": result.max_rel_diff, "tolerance": tolerance}
        if not result.passed:
            d = result.first_divergence
            failures.append(f"{scenario.name}: step {d.step} {d.metric} DeepSpeed {d.reference!r} torsh "
                            f"{d.candidate!r} (rel {d.rel_diff:.3g} > {tolerance.get(d.metric, 0):.3g})"
                            if d else f"{scenario.name}: {result.notes}")  # fmt: skip
    if os.environ.get("TORSH_PARITY_REPORT"):
        with open(os.environ["TORSH_PARITY_REPORT"], "w") as handle:
            json.dump(measured, handle, indent=1)
    assert not failures, "\n".join(failures)
