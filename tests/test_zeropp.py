"""ZeRO++ (DeepSpeed 0.19.8's hpZ, qwZ, qgZ): what the torsh engine runs for each switch, measured.

* ``zero_hpz_partition_size`` (hpZ): a secondary copy of the parameters partitioned within groups of that many
  ranks, which the backward all-gather reads. The numerics and the sharding of optimizer state and gradients are
  plain ZeRO-3's, so the engine runs plain ZeRO-3 over all ranks (FSDP2 HSDP would replicate the optimizer state
  across the groups). Compared with DeepSpeed's hpZ on 2 ranks (and on 4 ranks with groups of 2, slow).
* ``zero_quantized_weights`` / ``zero_quantized_nontrainable_weights`` (qwZ) and ``zero_quantized_gradients``
  (qgZ): DeepSpeed 0.19.8 has no CPU quantizer kernel, so the quantized runs are compared with a reference written
  here from DeepSpeed's algorithm; the engine keeps unquantized ZeRO-3 and says so (an approximate finding with the
  difference measured below) in the adapter's report and in ``deepspeed.initialize``'s log.

The reference (one process standing for the ranks): DeepSpeed's symmetric blockwise quantizer (scale
``2**bits / (2 * absmax)`` per group, round half to even, clamp to the signed range, dequantize by the inverse
scale). qwZ quantizes each rank's partition of a parameter (the flattened parameter cut into ``ceil(numel / world)``
elements) to int8 after a cast to fp16, in DeepSpeed's number of groups for that size; the forward and backward run
on the dequantized weights and the gradient reaches the fp32 weights unchanged. qgZ (taken only between nodes, here
2 nodes of 1 rank) quantizes each 2-D gradient to int4 in ``max(rows, cols, world)`` groups, requantizes the reduced
values the same way for the inter-node step, and averages over the nodes; 1-D gradients and those whose size is not
a multiple of ``2 * world`` are averaged unquantized, as DeepSpeed falls back for them. Where the reference is
simpler than DeepSpeed: it quantizes each parameter's partition on its own (DeepSpeed quantizes the partitions of the
parameters one fetch gathers together as one tensor, so its groups depend on its fetch schedule), quantizes every
gather (small parameters DeepSpeed keeps gathered included), and quantizes gradients in fp32.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from pathlib import Path

import pytest
from _engine_harness import batch, build_model, ds_config, lm_loss, spawn
from test_cli import cli

from torsh import adapters
from torsh.adapters._deepspeed_rules import ZEROPP_QUANTIZATION
from torsh.translate import Fidelity

HPZ = "zero_optimization.zero_hpz_partition_size"
QW, QNT, QG = ZEROPP_QUANTIZATION
ALL_ON = {"zero_hpz_partition_size": 2, "zero_quantized_weights": True, "zero_quantized_nontrainable_weights": True,
          "zero_quantized_gradients": True}  # fmt: skip
FROZEN = ("embed.weight", "head.weight")  # the frozen parameters of the nontrainable-weights reference
STEPS = 6


def _read(zero: dict):
    return adapters.read({"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}, "deepspeed")


def _note(translation, key: str):
    return next(n for n in translation.notes if n.source_path == key)


# ---- the adapter's findings ----------------------------------------------------------------------------------


def test_each_zeropp_switch_at_zero3_is_an_approximate_finding_run_as_plain_zero3_and_written_back():
    t = _read({"stage": 3, **ALL_ON})
    assert t.result.sharding.stage == 3 and t.result.sharding.hybrid_shard_size is None  # not HSDP
    for key in (HPZ, *ZEROPP_QUANTIZATION):
        assert _note(t, key).fidelity is Fidelity.APPROXIMATE, key
    for key, reason in ZEROPP_QUANTIZATION.items():
        assert _note(t, key).reason == reason
    assert "plain ZeRO-3" in _note(t, HPZ).reason
    assert t.counts()["unsupported"] == 0
    assert adapters.write(t.result, "deepspeed").result["zero_optimization"] == {"stage": 3, **ALL_ON}


@pytest.mark.parametrize("zero", [{"stage": 2, **ALL_ON}, {"stage": 3, "zero_hpz_partition_size": 1,
                                                           "zero_quantized_weights": False}])  # fmt: skip
def test_zeropp_switches_off_or_below_zero3_have_no_effect_as_in_deepspeed(zero):
    t = _read(zero)
    assert t.result.sharding.hybrid_shard_size is None
    for key in zero:
        if key != "stage":
            assert _note(t, f"zero_optimization.{key}").fidelity is Fidelity.IGNORED, key
    assert adapters.write(t.result, "deepspeed").result["zero_optimization"] == zero


def test_migrate_validate_and_convert_report_each_zeropp_switch(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, **ALL_ON}}))
    for command in (["validate", str(path)], ["convert", str(path), "--to", "torsh"]):
        done = cli(*command)
        assert done.returncode == 0, done.stderr
        report = " ".join((done.stdout + done.stderr).split())
        for key, reason in ZEROPP_QUANTIZATION.items():
            assert key in report and " ".join(reason.split())[:60] in report, (command, key)
        assert HPZ in report


# ---- the reference of DeepSpeed's quantisation, and the differences the findings state ------------------------


def _groups(numel: int) -> int:
    """DeepSpeed's number of quantisation groups for a weight partition of ``numel`` elements (its CUDAQuantizer:
    the fewest groups of at most ~8000 elements whose size is a multiple of 8)."""
    groups = math.ceil(numel / 8000)
    while groups < numel and numel % (8 * groups):
        groups += 1
    while numel % (16 * groups) == 0 and numel / groups > 8000:
        groups *= 2
    return groups


def _quantized(x, groups: int, bits: int):
    """Symmetric blockwise quantize-dequantize of ``x`` in ``groups`` equal groups of its flattened elements."""
    import torch

    rows = x.reshape(groups, -1)
    absmax = rows.abs().amax(1, keepdim=True)
    scale = torch.where(absmax == 0, torch.ones_like(absmax), 2.0**bits / (2 * absmax))
    q = torch.round(rows * scale).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return (q * (1 / scale)).reshape(x.shape)


def _gathered_weight(p, world: int):
    """qwZ: every rank's partition quantized to int8 (from fp16), gathered and dequantized."""
    import torch

    flat = p.detach().reshape(-1)
    part = math.ceil(flat.numel() / world)
    rows = torch.nn.functional.pad(flat, (0, part * world - flat.numel())).view(world, part)
    out = torch.cat([_quantized(row.half().float(), _groups(part), 8).half().float() for row in rows])
    return out[: flat.numel()].view_as(p)


def _node_gradient(g, world: int):
    """qgZ: one node's gradient as the inter-node reduction receives it (int4, quantized twice)."""
    if g.dim() != 2 or g.numel() % (2 * world):
        return g
    groups = max(g.shape[0], g.shape[1], world)
    return _quantized(_quantized(g, groups, 4), groups, 4)


def reference(weights: bool = False, grads: bool = False, frozen: tuple[str, ...] = (), world: int = 2):
    """Per-rank losses of ``STEPS`` ZeRO-3 steps (the harness's model, batches and AdamW) with DeepSpeed's weight
    (``weights``; with ``frozen``, only the frozen parameters, as zero_quantized_nontrainable_weights) and
    gradient (``grads``) quantisation; neither: unquantized ZeRO-3."""
    import torch

    model = build_model(0)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    fixed = {n: _gathered_weight(p, world) if weights else p for n, p in model.named_parameters()
             if not p.requires_grad}  # fmt: skip
    optimizer = torch.optim.AdamW(params.values(), lr=1e-2, weight_decay=0.0)
    losses: list[list[float]] = [[] for _ in range(world)]
    for step in range(STEPS):
        mean = {n: torch.zeros_like(p) for n, p in params.items()}
        for rank in range(world):
            used = {n: p + (_gathered_weight(p, world) - p).detach() if weights and not frozen else p
                    for n, p in params.items()}  # fmt: skip
            x, y = batch(step, rank, 2)
            loss = lm_loss(torch.func.functional_call(model, {**used, **fixed}, (x,)), y)
            for (name, _), g in zip(params.items(), torch.autograd.grad(loss, list(params.values()))):
                mean[name] += (_node_gradient(g, world) if grads else g) / world
            losses[rank].append(loss.item())
        for name, p in params.items():
            p.grad = mean[name]
        optimizer.step()
    return losses


def _largest_relative(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) / abs(y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _stated(reason: str) -> float:
    return float(re.search(r"up to ([0-9.]+e-[0-9]+) relative", reason).group(1))


@pytest.mark.parametrize(("key", "kwargs"), [(QW, {"weights": True}), (QG, {"grads": True}),
                                             (QNT, {"weights": True, "frozen": FROZEN})])  # fmt: skip
def test_the_quantisation_reference_differs_from_unquantized_zero3_by_what_the_finding_states(key, kwargs):
    pytest.importorskip("torch")
    plain = reference(frozen=kwargs.get("frozen", ()))
    measured = _largest_relative(reference(**kwargs), plain)
    assert measured == pytest.approx(_stated(ZEROPP_QUANTIZATION[key]), rel=0.05), measured


# ---- the engine against DeepSpeed on 2 ranks ------------------------------------------------------------------


def _side_by_side(rank: int, world: int, scenario: dict) -> dict:
    """One scenario: DeepSpeed's or the drop-in's ``deepspeed.initialize`` on the harness model; the losses, the
    optimizer-state elements this rank holds, and (torsh) the engine's log warnings."""
    import logging

    import torch

    os.environ["LOCAL_SIZE"] = str(world)  # DeepSpeed's CPU accelerator: the ranks of one node
    if scenario["engine"] == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
    else:
        from torsh.compat import deepspeed
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("torsh.engine")
    logger.addHandler(handler)
    try:
        if scenario["engine"] == "torsh":  # the construction context's quantisation argument is noted too
            deepspeed.zero.Init(enabled=False, zero_quantized_weights=True)
        model = build_model(0)
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=scenario["config"])  # fmt: skip
    finally:
        logger.removeHandler(handler)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, rank, 2)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    inner = getattr(optimizer, "optimizer", optimizer)
    state = sum((v.to_local() if hasattr(v, "to_local") else v).numel() for st in inner.state.values()
                for k, v in st.items() if torch.is_tensor(v) and k != "step")  # fmt: skip
    return {"losses": losses, "state": state, "log": seen}


def _zero3(**zero) -> dict:
    config = ds_config(3)
    config["zero_optimization"].update(zero)
    return config


def _run(scenarios: list[dict], world: int) -> dict[str, list[dict]]:
    with tempfile.TemporaryDirectory() as out:
        spawn(scenarios, world, out, _side_by_side)
        records = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    return {s["name"]: [r[s["name"]] for r in records] for s in scenarios}


def _ok(ranks: list[dict]) -> list[dict]:
    for r in ranks:
        assert "error" not in r, r.get("traceback")
    return ranks


def _close(a: list[dict], b: list[dict]) -> None:
    measured = _largest_relative([r["losses"] for r in a], [r["losses"] for r in b])
    assert measured <= 1e-5, measured


@pytest.mark.slow
def test_zeropp_configs_train_with_deepspeed_s_losses_and_say_what_they_run():
    pytest.importorskip("deepspeed")
    got = _run([
        {"name": "torsh", "engine": "torsh", "config": _zero3(**ALL_ON)},
        {"name": "ds_zero3", "engine": "deepspeed", "config": _zero3()},
        {"name": "ds_hpz", "engine": "deepspeed", "config": _zero3(zero_hpz_partition_size=2)},
        # one node: DeepSpeed reduces the gradients unquantized (its qgZ runs only between nodes)
        {"name": "ds_qgz", "engine": "deepspeed", "config": _zero3(zero_quantized_gradients=True)},
        {"name": "ds_qwz", "engine": "deepspeed", "config": _zero3(zero_quantized_weights=True)},
    ], world=2)  # fmt: skip
    torsh = _ok(got["torsh"])
    for name in ("ds_zero3", "ds_hpz", "ds_qgz"):
        _close(torsh, _ok(got[name]))
    _close(torsh, [{"losses": losses} for losses in reference()])  # the unquantized reference is ZeRO-3
    assert all("not been implemented on CPU" in r["error"] for r in got["ds_qwz"])  # why qwZ has a reference
    # the drop-in's initialize says what the adapter says, naming each key, once (rank 0)
    warned = " ".join(torsh[0]["log"])
    for key, reason in {**ZEROPP_QUANTIZATION, HPZ: _note(_read({"stage": 3, **ALL_ON}), HPZ).reason}.items():
        assert f"{key}: approximate ({reason})" in warned, key
    assert f"deepspeed.zero.Init(zero_quantized_weights=True): approximate ({ZEROPP_QUANTIZATION[QW]})" in warned
    assert not any(key in " ".join(torsh[1]["log"]) for key in ZEROPP_QUANTIZATION)


@pytest.mark.slow
def test_hpz_on_4_ranks_shards_optimizer_state_over_all_ranks_as_deepspeed():
    pytest.importorskip("deepspeed")
    got = _run([{"name": "torsh", "engine": "torsh", "config": _zero3(zero_hpz_partition_size=2)},
                {"name": "ds_hpz", "engine": "deepspeed", "config": _zero3(zero_hpz_partition_size=2)}],
               world=4)  # fmt: skip
    torsh, ds = _ok(got["torsh"]), _ok(got["ds_hpz"])
    _close(torsh, ds)
    assert [r["state"] for r in torsh] == [r["state"] for r in ds]  # 1/4 of the Adam state each, not 1/2 (HSDP)


def test_drop_in_initialize_refuses_an_hpz_size_that_does_not_divide_the_ranks_as_deepspeed(monkeypatch):
    # DeepSpeed 0.19.8 on 4 ranks with zero_hpz_partition_size 3: "AssertionError: 4 is not divisible by 3"
    from torsh.compat import deepspeed

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(deepspeed.DeepSpeedConfigError) as exc:
        deepspeed.initialize(model=build_model(0), config=_zero3(zero_hpz_partition_size=3))
    assert [p.path for p in exc.value.problems] == [HPZ] and "4 is not divisible by 3" in str(exc.value)
    from torsh.compat.deepspeed.runtime.config import check_hpz_partition_size

    check_hpz_partition_size(_zero3(zero_hpz_partition_size=8), 4)  # capped at the ranks: one group, as DeepSpeed
    check_hpz_partition_size({**_zero3(), "zero_optimization": {"stage": 2, "zero_hpz_partition_size": 3}}, 4)
