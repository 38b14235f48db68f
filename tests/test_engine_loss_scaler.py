"""fp16 loss scaling: DeepSpeed's ZeRO and stage-0 rules and torch GradScaler's, step by step."""

from __future__ import annotations

import random
import types

import pytest

torch = pytest.importorskip("torch")

from torsh.config import LossScalingConfig  # noqa: E402
from torsh.engine.loss_scaler import LossScaleAtMinimumError, build_loss_scaler  # noqa: E402

# The reference's worked trace: init 2**16, window 3, hysteresis 2.
PATTERN = [0] * 7 + [1] * 3 + [0] * 4 + [1]
DS_ZERO = [65536, 65536, 65536, 131072, 131072, 131072, 262144,
           262144, 131072, 65536,
           65536, 65536, 65536, 131072,
           131072]  # fmt: skip
GRAD_SCALER = [65536, 65536, 131072, 131072, 131072, 262144, 262144,
               131072, 65536, 32768,
               32768, 32768, 65536, 65536,
               32768]  # fmt: skip
DS_STAGE0 = [65536, 65536, 65536, 131072, 131072, 131072, 262144,
             131072, 65536, 32768,
             32768, 32768, 32768, 65536,
             32768]  # fmt: skip


def _scaler(semantics: str, **overrides):
    fields = {"mode": "dynamic", "initial_scale": 2.0**16, "growth_interval": 3, "hysteresis": 2,
              "semantics": semantics, **overrides}
    return build_loss_scaler(LossScalingConfig(**fields))


def _run(scaler, pattern) -> list[float]:
    scales = []
    for overflow in pattern:
        scaler.update(bool(overflow))
        scales.append(scaler.cur_scale)
    return scales


@pytest.mark.parametrize(("semantics", "expected"), [("deepspeed_zero", DS_ZERO),
                                                     ("torch_grad_scaler", GRAD_SCALER),
                                                     ("deepspeed_stage0", DS_STAGE0)])
def test_reference_trace(semantics, expected):
    assert _run(_scaler(semantics), PATTERN) == expected


def test_zero_rule_raises_on_overflow_at_min_scale():
    scaler = _scaler("deepspeed_zero", initial_scale=4.0, min_scale=2.0, hysteresis=1)
    scaler.update(True)
    assert scaler.cur_scale == 2.0
    with pytest.raises(LossScaleAtMinimumError, match="minimum"):
        scaler.update(True)


def test_stage0_rule_floors_at_min_scale_without_error():
    scaler = _scaler("deepspeed_stage0", initial_scale=4.0, min_scale=2.0)
    assert _run(scaler, [1, 1, 1]) == [2.0, 2.0, 2.0]


def test_consecutive_hysteresis_refills_on_every_clean_step():
    scaler = _scaler("deepspeed_zero", consecutive_hysteresis=True, growth_interval=100)
    assert _run(scaler, [1, 0, 1, 0, 1, 1]) == [65536] * 5 + [32768]


def test_static_and_none_modes():
    static = build_loss_scaler(LossScalingConfig(mode="static", static_scale=128.0))
    assert not static.dynamic and _run(static, [1, 0, 1, 0, 0, 0]) == [128.0] * 6
    assert static.scale(torch.tensor(2.0)).item() == 256.0
    none = build_loss_scaler(LossScalingConfig())
    loss = torch.tensor(3.0)
    assert none.cur_scale == 1.0 and not none.dynamic and none.scale(loss) is loss


def test_state_dict_round_trip_continues_the_sequence():
    first = _scaler("deepspeed_zero")
    _run(first, PATTERN[:8])
    second = _scaler("deepspeed_zero")
    second.load_state_dict(first.state_dict())
    assert _run(second, PATTERN[8:]) == DS_ZERO[8:]


def _patterns():
    rng = random.Random(7)
    return [[int(rng.random() < p) for _ in range(200)] for p in (0.02, 0.1, 0.3, 0.6)]


@pytest.mark.slow
@pytest.mark.parametrize("pattern", _patterns())
@pytest.mark.parametrize(("window", "hysteresis", "consecutive"), [(3, 2, False), (5, 1, False), (4, 3, True),
                                                                  (1, 2, False)])
def test_zero_rule_matches_deepspeed_dynamic_loss_scaler(pattern, window, hysteresis, consecutive, monkeypatch):
    pytest.importorskip("deepspeed", reason="compares with DeepSpeed's DynamicLossScaler")
    from deepspeed.runtime.fp16 import loss_scaler as ds_loss_scaler

    # DeepSpeed logs with dist.get_rank(); no process group is needed for the arithmetic.
    monkeypatch.setattr(ds_loss_scaler, "dist", types.SimpleNamespace(get_rank=lambda: 0))
    ds = ds_loss_scaler.DynamicLossScaler(init_scale=2.0**16, scale_window=window, min_scale=1,
                                          delayed_shift=hysteresis, consecutive_hysteresis=consecutive)
    ours = _scaler("deepspeed_zero", growth_interval=window, hysteresis=hysteresis,
                   consecutive_hysteresis=consecutive, min_scale=1.0)
    for overflow in pattern:
        try:
            ds.update_scale(bool(overflow))
        except Exception:  # noqa: BLE001 - DeepSpeed raises a bare Exception at the minimum scale
            with pytest.raises(LossScaleAtMinimumError):
                ours.update(bool(overflow))
            return
        ours.update(bool(overflow))
        assert (ours.cur_scale, ours.cur_hysteresis) == (ds.cur_scale, ds.cur_hysteresis)


@pytest.mark.slow
@pytest.mark.parametrize("pattern", _patterns())
@pytest.mark.parametrize("window", [1, 3, 7])
def test_stage0_rule_matches_deepspeed_unfused_optimizer(pattern, window):
    pytest.importorskip("deepspeed", reason="compares with DeepSpeed's stage-0 fp16 optimizer")
    from deepspeed.runtime.fp16.loss_scaler import LossScaleConfig
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    config = LossScaleConfig(torch.float16, True, 1.0, {"init_scale": 2.0**16, "scale_window": window,
                                                         "min_scale": 1.0})
    fake = types.SimpleNamespace(loss_scale_config=config, verbose=False)
    ours = _scaler("deepspeed_stage0", growth_interval=window, min_scale=1.0)
    for overflow in pattern:
        FP16_UnfusedOptimizer._update_scale(fake, bool(overflow))
        ours.update(bool(overflow))
        assert ours.cur_scale == config.cur_scale


@pytest.mark.slow
@pytest.mark.parametrize("pattern", _patterns())
@pytest.mark.parametrize(("interval", "growth", "backoff"), [(3, 2.0, 0.5), (10, 4.0, 0.25), (1, 1.5, 0.9)])
def test_grad_scaler_rule_matches_torch_grad_scaler(pattern, interval, growth, backoff):
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.0)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_factor=growth, backoff_factor=backoff,
                                        growth_interval=interval)
    ours = _scaler("torch_grad_scaler", growth_interval=interval, growth_factor=growth, backoff_factor=backoff)
    for overflow in pattern:
        torch_scaler.scale(param.sum()).backward()
        if overflow:
            param.grad[0] = float("inf")
        torch_scaler.step(opt)
        torch_scaler.update()
        opt.zero_grad()
        ours.update(bool(overflow))
        assert ours.cur_scale == torch_scaler.get_scale()
