"""DeepSpeed's Lion, Lamb, Muon (with its auxiliary Adam) and mup optimizers, built from a config by
``torsh.engine.optimizers``.

In process: each update rule against a reference written here from the published algorithm (and DeepSpeed's
documented choices: Lion's sign of zero, Lamb's uncorrected trust ratio, Muon's Nesterov blend and aspect scale),
Muon's parameter split, the mup refusal. Two ranks, one launch: the losses of 6 steps against real DeepSpeed 0.19.8
on its CPU accelerator (Lion at ZeRO-1/2/3 under optimizer offload, DeepSpeed's CPU Lion; Muon at ZeRO-0/1/2/3),
and Lamb, which DeepSpeed runs on CUDA only, at ZeRO-1/2/3 against stage 0.
"""

from __future__ import annotations

import math
import os
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from torsh.config import OptimizerConfig  # noqa: E402
from torsh.engine.optim import build_optimizer  # noqa: E402
from torsh.engine.optimizers import Lamb, Lion, MuonWithAuxAdam, split_groups  # noqa: E402
from torsh.engine.optimizers.muon import muon_update, orthogonalise  # noqa: E402
from torsh.errors import ConfigError  # noqa: E402

# ---- references, written from the algorithms -------------------------------------------------------------------


def _lion_ref(p, g, m, lr, b1, b2, wd):
    c = b1 * m + (1 - b1) * g
    sign = torch.where(torch.signbit(c), -1.0, 1.0)  # DeepSpeed's CPU kernel: the sign bit, never 0
    return p * (1 - lr * wd) - lr * sign, b2 * m + (1 - b2) * g


def _lamb_ref(p, g, m, v, t, lr, b1, b2, eps, wd, lo=0.01, hi=10.0):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = m / (v.sqrt() + eps) + wd * p
    w_norm, u_norm = p.norm(), u.norm()
    r = (w_norm / u_norm).clamp(lo, hi) if w_norm > 0 and u_norm > 0 else torch.tensor(1.0, dtype=p.dtype)
    return p - lr * math.sqrt(1 - b2**t) / (1 - b1**t) * r * u, m, v


def _ns_ref(g, steps=5):
    """The quintic Newton-Schulz iteration of Jordan's Muon, in float64."""
    x = g.double()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if tall else x


def _muon_ref(w, g, m, lr, beta, wd):
    m = beta * m + (1 - beta) * g
    u = (1 - beta) * g + beta * m  # Nesterov
    o = _ns_ref(u) * math.sqrt(max(1.0, g.size(0) / g.size(1)))
    return w * (1 - lr * wd) - lr * o, m


def _adam_ref(p, g, m, v, t, lr, b1, b2, eps, wd):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p * (1 - lr * wd)
    return p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps), m, v


def _grads(shape, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(n)]


# ---- the update rules --------------------------------------------------------------------------------------------


def test_lion_is_the_published_rule_with_deepspeeds_sign_of_zero():
    p = torch.nn.Parameter(torch.randn(5, 7))
    opt = Lion([p], lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    ref, m = p.detach().clone(), torch.zeros(5, 7)
    for g in _grads((5, 7), 4):
        g[0, 0] = 0.0  # with zero momentum too at step 1: c = +0, DeepSpeed's CPU Lion steps by -lr
        p.grad = g.clone()
        opt.step()
        ref, m = _lion_ref(ref, g, m, 0.01, 0.9, 0.99, 0.1)
    torch.testing.assert_close(p.detach(), ref, rtol=1e-6, atol=1e-7)


def test_lamb_is_deepspeeds_fusedlamb_rule_per_tensor():
    ps = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = Lamb(ps, lr=0.02, weight_decay=0.01)
    refs = [(p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in ps]
    for t, seed in enumerate(range(3), start=1):
        grads = [_grads(p.shape, 1, seed * 10 + i)[0] for i, p in enumerate(ps)]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
        refs = [_lamb_ref(r, g, m, v, t, 0.02, 0.9, 0.999, 1e-8, 0.01) for (r, m, v), g in zip(refs, grads)]
    for p, (r, _, _) in zip(ps, refs):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
    assert len(opt.get_lamb_coeffs()) == 2 and all(0.01 <= c <= 10.0 for c in opt.get_lamb_coeffs())


@pytest.mark.parametrize("shape", [(8, 8), (6, 10), (12, 5)])
def test_gram_newton_schulz_is_the_quintic_iteration(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    ours = orthogonalise(g, 5, "gram")
    if ours.dtype == torch.float32:  # a CPU without fp16 (DeepSpeed iterates in fp32 there too)
        torch.testing.assert_close(ours.double(), _ns_ref(g), rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(ours.double(), _ns_ref(g), rtol=2e-2, atol=2e-2)


def test_muon_with_aux_adam_steps_matrices_by_muon_and_the_rest_by_adam():
    w, b = torch.nn.Parameter(torch.randn(12, 6)), torch.nn.Parameter(torch.randn(6))
    opt = MuonWithAuxAdam([{"params": [w], "use_muon": True, "lr": 0.05, "weight_decay": 0.1},
                           {"params": [b], "use_muon": False, "lr": 0.01, "weight_decay": 0.1}])  # fmt: skip
    rw, mw = w.detach().clone(), torch.zeros(12, 6)
    rb, m, v = b.detach().clone(), torch.zeros(6), torch.zeros(6)
    for t in range(1, 4):
        gw, gb = _grads((12, 6), 1, t)[0], _grads((6,), 1, 100 + t)[0]
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
        rw, mw = _muon_ref(rw, gw, mw, 0.05, 0.95, 0.1)
        rb, m, v = _adam_ref(rb, gb, m, v, t, 0.01, 0.9, 0.95, 1e-10, 0.1)
    tol = 1e-4 if orthogonalise(torch.eye(2, 3), 1).dtype == torch.float32 else 3e-2
    torch.testing.assert_close(w.detach().double(), rw, rtol=tol, atol=tol)
    torch.testing.assert_close(b.detach(), rb, rtol=1e-5, atol=1e-6)


def test_muon_keeps_its_momentum_on_a_non_finite_gradient():
    g = torch.full((4, 4), float("nan"))
    momentum = torch.ones(4, 4)
    out = muon_update(g, momentum)
    assert torch.equal(momentum, torch.ones(4, 4)) and out.isnan().all()


def test_muon_split_follows_deepspeed():
    shapes = {"embed.weight": (10, 4), "blocks.0.w": (4, 4), "blocks.0.b": (4,), "lm_head.weight": (10, 4),
              "frozen.w": (4, 4)}  # fmt: skip
    groups = [{"params": ["embed.weight", "blocks.0.w", "blocks.0.b", "lm_head.weight", "frozen.w"]}]
    out = split_groups(groups, {"lr": 0.1, "adam_lr": 0.001, "betas": (0.8, 0.9), "momentum": 0.9},
                       shape_of=shapes.__getitem__, trainable=lambda n: n != "frozen.w")  # fmt: skip
    assert out == [{"params": ["blocks.0.w"], "use_muon": True, "name": "muon-params", "lr": 0.1, "momentum": 0.9},
                   {"params": ["embed.weight", "blocks.0.b", "lm_head.weight"], "use_muon": False,
                    "name": "adam-params", "lr": 0.001, "betas": (0.8, 0.9)}]  # fmt: skip
    two = split_groups([{"params": ["blocks.0.w"], "lr": 0.5}, {"params": ["blocks.0.b"], "name": "nd"}], {},
                       shape_of=shapes.__getitem__, trainable=lambda n: True)  # fmt: skip
    assert [(g["name"], g.get("lr")) for g in two] == [("group0-muon-params", 0.5), ("nd-adam-params", None)]


# ---- building from the config ------------------------------------------------------------------------------------


def _params():
    return [torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3))]


@pytest.mark.parametrize(("name", "cls"), [("Lion", Lion), ("lion", Lion), ("Lamb", Lamb)])
def test_config_names_build_deepspeeds_optimizers(name, cls):
    opt = build_optimizer(OptimizerConfig(name=name, lr=0.5, betas=(0.8, 0.9)), _params(), offload=False)
    assert type(opt) is cls and opt.defaults["lr"] == 0.5 and opt.defaults["betas"] == (0.8, 0.9)


def test_a_keyword_the_optimizer_does_not_take_names_its_key():
    with pytest.raises(ConfigError, match="Lion has no argument 'eps'") as err:
        build_optimizer(OptimizerConfig(name="Lion", eps=1e-8), _params(), offload=False)
    assert err.value.problems[0].path == "optimizer.eps"


def test_per_head_muon_is_refused_by_name():
    cfg = OptimizerConfig(name="Muon", kwargs={"per_head_muon": True})
    with pytest.raises(ConfigError, match="per_head_muon"):
        build_optimizer(cfg, [{"params": _params()[:1], "use_muon": True}], offload=False)


def test_mup_optimizers_need_mup_as_deepspeeds_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "mup", None)  # not importable
    with pytest.raises(ConfigError, match="mup package is not installed"):
        build_optimizer(OptimizerConfig(name="MuAdamW"), _params(), offload=False)
    fake = types.ModuleType("mup")
    fake.MuAdamW = lambda params, **kw: torch.optim.AdamW(params, **kw)
    monkeypatch.setitem(sys.modules, "mup", fake)
    with pytest.raises(ConfigError, match="infshape"):
        build_optimizer(OptimizerConfig(name="MuAdamW"), _params(), offload=False)
    params = _params()
    for p in params:
        p.infshape = None
    assert type(build_optimizer(OptimizerConfig(name="MuAdamW", lr=0.1), params, offload=False)) is torch.optim.AdamW


def test_deepspeeds_classes_are_importable_and_step():
    from torsh.compat.deepspeed.ops.lamb import FusedLamb
    from torsh.compat.deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
    from torsh.compat.deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam as DsMuon

    for opt in (FusedLamb(_params()), FusedLion(_params()), DeepSpeedCPULion(_params()),
                DsMuon([{"params": _params()[:1], "use_muon": True}])):  # fmt: skip
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad = torch.ones_like(p)
        opt.step()


# ---- two ranks against real DeepSpeed ----------------------------------------------------------------------------

_OPTIMIZERS = {
    "lion": {"type": "Lion", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}},
    "muon": {"type": "Muon", "params": {"lr": 1e-2, "adam_lr": 3e-3, "weight_decay": 0.01}},
    "lamb": {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01}},
}
# (optimizer, stage, gradient clipping, engines): DeepSpeed runs Lion on the CPU only as its offloaded CPU Lion, and
# Lamb not at all (CUDA only: torsh's ZeRO stages are compared with its stage 0, tied to the reference above).
_BOTH = ("torsh", "deepspeed")
_CASES = [("lion", 0, 1.0, ("torsh",)), ("lion", 1, 1.0, _BOTH), ("lion", 2, 1.0, _BOTH), ("lion", 3, 1.0, _BOTH),
          ("muon", 0, 1.0, _BOTH), ("muon", 1, 0.0, _BOTH), ("muon", 2, 0.0, _BOTH), ("muon", 3, 0.0, _BOTH),
          ("muon", 3, 1.0, _BOTH),
          ("lamb", 0, 1.0, ("torsh",)), ("lamb", 1, 1.0, ("torsh",)), ("lamb", 2, 1.0, ("torsh",)),
          ("lamb", 3, 1.0, ("torsh",))]  # fmt: skip


def _config(kind: str, stage: int, clip: float, engine: str) -> dict:
    zero: dict = {"stage": stage}
    if kind == "lion" and engine == "deepspeed":
        zero["offload_optimizer"] = {"device": "cpu"}  # DeepSpeedCPULion: FusedLion has no CPU kernel
    if kind == "muon" and stage == 3:
        zero["reduce_scatter"] = False  # DeepSpeed's ZeRO-3 refuses Muon with it
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "gradient_clipping": clip,
            "zero_optimization": zero, "optimizer": _OPTIMIZERS[kind]}  # fmt: skip


def _run(rank: int, world_size: int, scenario: dict) -> dict:
    import _engine_harness as harness

    module = harness.backend(scenario["engine"])
    model = harness.build_model(0)
    engine, _, _, _ = module.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    return {"losses": harness.train(engine, rank, 0, 6)}


@pytest.fixture(scope="module")
def records():
    pytest.importorskip("deepspeed")
    import _engine_harness as harness

    os.environ.update(DS_ACCELERATOR="cpu", TORCHDYNAMO_DISABLE="1")  # DeepSpeed compiles Muon's step otherwise
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    _preload_deepspeed()
    scenarios = [{"name": f"{k}{s}c{c}_{e}", "engine": e, "config": _config(k, s, c, e)}
                 for k, s, c, engines in _CASES for e in engines]  # fmt: skip
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as out:
        harness.spawn(scenarios, 2, out, runner=_run)
        import json

        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


def _preload_deepspeed() -> None:
    """DeepSpeed's modules and CPU ops loaded once here, not again in each forked rank (seconds of the launch)."""
    import deepspeed  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    from deepspeed.ops.op_builder import CPULionBuilder, FusedAdamBuilder

    for builder in (CPULionBuilder, FusedAdamBuilder):  # Muon's auxiliary Adam is DeepSpeed's FusedAdam
        try:
            builder().load()
        except Exception:  # the rank then meets the same failure and the test says so (_losses)
            pass


def _losses(records, name):
    rec = records[0][name]
    if "error" in rec:
        if "This op had not been implemented" in rec["error"] or "Error building extension" in rec["error"]:
            pytest.skip(f"DeepSpeed cannot build its CPU op here: {rec['error']}")
        raise AssertionError(rec.get("traceback"))
    return rec["losses"]


@pytest.mark.parametrize(("kind", "stage", "clip"), [(k, s, c) for k, s, c, e in _CASES if "deepspeed" in e])
def test_losses_match_deepspeed(records, kind, stage, clip):
    name = f"{kind}{stage}c{clip}"
    assert _close(_losses(records, f"{name}_torsh"), _losses(records, f"{name}_deepspeed"))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lamb_at_zero_stages_is_the_per_tensor_rule_of_stage_0(records, stage):
    assert _close(_losses(records, f"lamb{stage}c1.0_torsh"), _losses(records, "lamb0c1.0_torsh"))


def test_lion_at_stage_0_is_deepspeeds_lion(records):
    assert _close(_losses(records, "lion0c1.0_torsh"), _losses(records, "lion1c1.0_deepspeed"))


def _close(ours, theirs, rtol=1e-5):
    return len(ours) == len(theirs) == 6 and all(abs(a - b) <= rtol * abs(b) for a, b in zip(ours, theirs))
