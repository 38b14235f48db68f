"""DeepSpeed's learning-rate schedules: value by value against the documented formulas and DeepSpeed's classes."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from torsh.config import TorshConfig  # noqa: E402
from torsh.engine.schedulers import build_scheduler  # noqa: E402
from torsh.errors import ConfigError  # noqa: E402


def _optimizer(kind: str = "adamw", lr: float = 1.0, groups: int = 1):
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.5)
    return torch.optim.AdamW(params, lr=lr, betas=(0.95, 0.98))


def _scheduler(section: dict, optimizer):
    return build_scheduler(TorshConfig.from_dict({"scheduler": section}).scheduler, optimizer)


def _lrs(section: dict, steps: int, lr: float = 1.0) -> list[float]:
    """The lr after construction, then after each step()."""
    opt = _optimizer(lr=lr)
    sched = _scheduler(section, opt)
    values = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        sched.step()
        values.append(opt.param_groups[0]["lr"])
    return values


# ---- the reference's verified sequences ---------------------------------------------------------


def test_warmup_lr_linear_starts_twice_at_min_then_rises_and_holds():
    values = _lrs({"name": "WarmupLR", "warmup_num_steps": 4, "warmup_type": "linear"}, 7)
    assert values == pytest.approx([0, 0, 0.25, 0.5, 0.75, 1, 1, 1])


def test_warmup_lr_defaults_to_log_warmup_and_the_group_lr_as_max():
    values = _lrs({"name": "WarmupLR", "warmup_num_steps": 4}, 5, lr=0.5)
    expected = [0.0] + [0.5 * math.log(it + 1) / math.log(4) for it in range(4)] + [0.5]
    assert values == pytest.approx(expected)


def test_warmup_uses_at_least_two_steps():
    values = _lrs({"name": "WarmupLR", "warmup_num_steps": 1, "warmup_type": "linear"}, 3)
    assert values == pytest.approx([0, 0, 0.5, 1])


def test_warmup_decay_lr_linear():
    section = {"name": "WarmupDecayLR", "total_num_steps": 10, "warmup_num_steps": 4, "warmup_type": "linear",
               "warmup_max_lr": 1.0}
    values = _lrs(section, 12)
    assert values == pytest.approx([0, 0, .25, .5, .75, 1.0, 5 / 6, 4 / 6, .5, 2 / 6, 1 / 6, 0, 0])


def test_warmup_decay_lr_peak_defaults_to_0_001_not_the_optimizer_lr():
    values = _lrs({"name": "WarmupDecayLR", "total_num_steps": 10, "warmup_num_steps": 2}, 3, lr=5.0)
    assert values[3] == pytest.approx(0.001)


def test_warmup_cosine_lr_reference_sequence():
    section = {"name": "WarmupCosineLR", "total_num_steps": 10, "warmup_num_steps": 4, "cos_min_ratio": 0.1,
               "warmup_type": "linear"}
    values = _lrs(section, 11, lr=2.0)
    assert values == pytest.approx([0, 0, .5, 1, 1.5, 1.879, 1.55, 1.1, .65, .32, .2, .2], abs=1e-3)


def test_lr_range_test_reference_sequence():
    section = {"name": "LRRangeTest", "lr_range_test_min_lr": 0.1, "lr_range_test_step_size": 2}
    assert _lrs(section, 3) == pytest.approx([.1, .15, .2, .25])


def test_lr_range_test_staircase():
    section = {"name": "LRRangeTest", "lr_range_test_min_lr": 0.1, "lr_range_test_step_size": 2,
               "lr_range_test_staircase": True}
    assert _lrs(section, 4) == pytest.approx([.1, .1, .2, .2, .3])


def test_one_cycle_cycles_lr_and_beta1_and_forces_beta2():
    opt = _optimizer()
    sched = _scheduler({"name": "OneCycle", "cycle_min_lr": 0.1, "cycle_max_lr": 0.5,
                        "cycle_first_step_size": 2}, opt)
    seen = [(opt.param_groups[0]["lr"], opt.param_groups[0]["betas"])]
    for _ in range(5):
        sched.step()
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))
    lrs = [lr for lr, _ in seen]
    beta1 = [b[0] for _, b in seen]
    assert lrs == pytest.approx([0.1, 0.3, 0.5, 0.3, 0.1, 0.1])
    assert beta1 == pytest.approx([0.8, 0.85, 0.8, 0.85, 0.9, 0.9])
    assert {b[1] for _, b in seen} == {0.99}


def test_one_cycle_leaves_sgd_momentum_alone():
    opt = _optimizer("sgd")
    sched = _scheduler({"name": "OneCycle", "cycle_min_lr": 0.1, "cycle_max_lr": 0.5,
                        "cycle_first_step_size": 2}, opt)
    sched.step()
    assert opt.param_groups[0]["momentum"] == 0.5 and "betas" not in opt.param_groups[0]
    assert sched.cycle_momentum is False


def test_state_dict_is_the_iteration_and_restores_the_schedule():
    section = {"name": "WarmupLR", "warmup_num_steps": 10, "warmup_type": "linear"}
    opt = _optimizer()
    sched = _scheduler(section, opt)
    for _ in range(3):
        sched.step()
    assert sched.state_dict() == {"last_batch_iteration": 2}
    other = _scheduler(section, _optimizer())
    other.load_state_dict(sched.state_dict())
    sched.step()
    other.step()
    assert other.get_last_lr() == sched.get_last_lr() == [pytest.approx(0.3)]


# ---- building from the config ---------------------------------------------------------------------


def test_other_names_are_torch_schedulers():
    opt = _optimizer()
    sched = _scheduler({"name": "StepLR", "kwargs": {"step_size": 2, "gamma": 0.5}}, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    for _ in range(2):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


def test_unknown_name_is_a_config_error_with_a_suggestion():
    with pytest.raises(ConfigError) as err:
        _scheduler({"name": "CosineAnealingLR"}, _optimizer())
    problem = err.value.problems[0]
    assert problem.path == "scheduler.name" and problem.suggestion == "CosineAnnealingLR"


def test_misspelt_deepspeed_name_suggests_it():
    with pytest.raises(ConfigError) as err:
        _scheduler({"name": "WarmUpLR"}, _optimizer())
    assert err.value.problems[0].suggestion == "WarmupLR"


def test_unresolved_auto_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError) as err:
        _scheduler({"name": "WarmupDecayLR", "total_num_steps": "auto", "warmup_max_lr": "auto"}, _optimizer())
    assert {p.path for p in err.value.problems} == {"scheduler.total_num_steps", "scheduler.warmup_max_lr"}
    with pytest.raises(ConfigError) as err:
        _scheduler({"name": "StepLR", "kwargs": {"step_size": "auto"}}, _optimizer())
    assert err.value.problems[0].path == "scheduler.kwargs.step_size"


# ---- against DeepSpeed's own classes ----------------------------------------------------------------

CASES = [
    {"name": "WarmupLR"},
    {"name": "WarmupLR", "warmup_num_steps": 7, "warmup_min_lr": 0.01, "warmup_max_lr": 0.3},
    {"name": "WarmupLR", "warmup_num_steps": 1, "warmup_type": "linear"},
    {"name": "WarmupDecayLR", "total_num_steps": 30, "warmup_num_steps": 5},
    {"name": "WarmupDecayLR", "total_num_steps": 25, "warmup_num_steps": 10, "warmup_type": "linear",
     "warmup_min_lr": 0.001, "warmup_max_lr": 0.02},
    {"name": "WarmupDecayLR", "total_num_steps": 3, "warmup_num_steps": 8},
    {"name": "WarmupCosineLR", "total_num_steps": 40, "warmup_num_steps": 6},
    {"name": "WarmupCosineLR", "total_num_steps": 20, "warmup_num_steps": 5, "warmup_type": "linear",
     "warmup_min_ratio": 0.2, "cos_min_ratio": 0.05},
    {"name": "OneCycle", "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5},
    {"name": "OneCycle", "cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 6,
     "cycle_second_step_size": 3, "cycle_first_stair_count": 3, "decay_step_size": 2, "decay_lr_rate": 0.5,
     "decay_mom_rate": 0.1, "cycle_min_mom": 0.7, "cycle_max_mom": 0.95},
    {"name": "OneCycle", "cycle_min_lr": 0.02, "cycle_max_lr": 0.2, "cycle_first_step_size": 4,
     "cycle_first_stair_count": 2, "cycle_second_stair_count": 4, "decay_step_size": 3, "decay_lr_rate": 0.1},
    {"name": "OneCycle", "cycle_min_lr": 0.02, "cycle_max_lr": 0.2, "cycle_first_step_size": 4,
     "cycle_momentum": False},
    {"name": "LRRangeTest"},
    {"name": "LRRangeTest", "lr_range_test_min_lr": 0.002, "lr_range_test_step_size": 3,
     "lr_range_test_step_rate": 2.5, "lr_range_test_staircase": True},
]


def _snapshot(opt) -> list[tuple]:
    return [(g["lr"], tuple(g["betas"]) if "betas" in g else g.get("momentum")) for g in opt.param_groups]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("section", CASES, ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_matches_deepspeed_classes_exactly(section, kind):
    pytest.importorskip("deepspeed", reason="compares with DeepSpeed's own scheduler classes")
    from deepspeed.runtime import lr_schedules

    ours_opt, ds_opt = _optimizer(kind, lr=0.05, groups=2), _optimizer(kind, lr=0.05, groups=2)
    ours = _scheduler(section, ours_opt)
    params = {k: v for k, v in section.items() if k != "name"}
    ds = getattr(lr_schedules, section["name"])(ds_opt, **params)
    assert _snapshot(ours_opt) == _snapshot(ds_opt)  # the construction-time write
    for _ in range(45):
        ours.step()
        ds.step()
        assert _snapshot(ours_opt) == _snapshot(ds_opt)
        assert ours.get_last_lr() == ds.get_last_lr()
        assert ours.state_dict() == ds.state_dict()
    ours.step(3)  # an explicit iteration, as DeepSpeed allows
    ds.step(3)
    assert _snapshot(ours_opt) == _snapshot(ds_opt)
