"""The optimizer a script passes to ``initialize`` as the Hugging Face stack passes it: its construction switches
(``fused`` on the CPU: the Trainer's default AdamW) are kept on the rebuilt optimizer at every ZeRO stage, and every
learning-rate scheduler holding it (built before ``initialize`` and not passed, passed, built after on the object
the script holds, or on ``engine.optimizer``) drives the optimizer that really steps.

One 2-rank gloo launch runs every scenario; each records, at every optimizer step, the learning rate the stepping
optimizer used (a step pre-hook on the torch optimizer that runs the update) and the one the scheduler reported.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import _engine_harness as h  # noqa: E402

STAGES = (0, 1, 2, 3)
ORDERS = ("before", "passed", "after", "after_engine")
STEPS = 4


def _warmup(step: int) -> float:
    return step / 2 if step < 2 else 1.0  # lr 0 at the first step, as the Trainer's linear warm-up


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "zero_optimization": {"stage": stage}}  # fmt: skip


def _scenario(rank: int, stage: int, order: str | None, fused: bool) -> dict:
    import torsh

    model = h.build_model(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    client = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, fused=fused)
    sched = None
    if order == "before":  # the Trainer of transformers 4.x; Accelerate's prepare of a torch scheduler
        sched = torch.optim.lr_scheduler.LambdaLR(client, _warmup)
    passed = torch.optim.lr_scheduler.LambdaLR(client, _warmup) if order == "passed" else None
    engine, opt, _, returned = torsh.initialize(model=model, optimizer=client, lr_scheduler=passed,
                                                config=_config(stage))  # fmt: skip
    if order == "after":  # built on the object the script still holds
        sched = torch.optim.lr_scheduler.LambdaLR(client, _warmup)
    elif order == "after_engine":  # the Trainer of transformers 5.x: on the optimizer prepare returned
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
    elif order == "passed":
        sched = returned
    stepping = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer steps its local optimizer
    used: list[float] = []
    stepping.register_step_pre_hook(lambda o, *_: used.append(o.param_groups[0]["lr"]))
    reported, losses = [], []
    for step in range(STEPS):
        if sched is not None:
            reported.append(sched.get_last_lr()[0])
        x, y = h.batch(step, rank, 2)
        loss = h.lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if order in ("before", "after", "after_engine"):
            sched.step()  # the script (the Trainer) steps its own scheduler; the engine steps a passed one
        losses.append(loss.item())
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in engine.module.named_parameters()}
    return {"used": used, "reported": reported, "losses": losses, "fused": stepping.defaults.get("fused"),
            "foreach": stepping.defaults.get("foreach"), "client_lr": client.param_groups[0]["lr"],
            "moved": max(float((full[n] - before[n]).abs().max()) for n in before),
            "engine_lr": engine.get_lr()[0]}  # fmt: skip


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {}
    try:
        for stage in STAGES:
            for order, fused in [(None, True), (None, False)] + [(o, True) for o in ORDERS]:
                name = f"{stage}-{order}-{'fused' if fused else 'plain'}"
                try:
                    results[name] = _scenario(rank, stage, order, fused)
                except Exception as exc:  # one failure does not hide the others
                    results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                dist.barrier()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def records() -> dict:
    with tempfile.TemporaryDirectory() as out:
        h.start(_worker, (2, h.free_port(), out), 2)
        return json.loads(Path(out, "rank0.json").read_text())


def _ok(rec: dict) -> dict:
    assert "error" not in rec, rec.get("traceback")
    return rec


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_fused_client_optimizer_is_rebuilt_fused_and_trains_like_the_unfused_one(records, stage):
    fused, plain = _ok(records[f"{stage}-None-fused"]), _ok(records[f"{stage}-None-plain"])
    assert fused["fused"] is True and not fused["foreach"]  # fused kept; never together with foreach
    assert fused["moved"] > 1e-3
    # the fused kernel computes the same AdamW update (to rounding) as the per-tensor loop
    assert fused["losses"] == pytest.approx(plain["losses"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("stage", STAGES)
def test_every_scheduler_holding_the_client_optimizer_drives_the_stepping_one(records, stage, order):
    rec = _ok(records[f"{stage}-{order}-fused"])
    expected = [1e-2 * _warmup(s) for s in range(STEPS)]
    assert rec["reported"] == pytest.approx(expected)
    assert rec["used"] == pytest.approx(rec["reported"])  # the lr used at every step is the one reported
    assert rec["moved"] > 1e-3  # trained, although the schedule starts at lr 0
    assert rec["client_lr"] == rec["engine_lr"] == pytest.approx(1e-2)  # the script's object shows the live lr


def test_switches_are_kept_as_torch_allows_on_the_step_tensors(caplog):
    """fused/capturable that the step tensors' device cannot run are turned off, and said so; fused wins over
    foreach; a script's choice the device allows is kept (per group too)."""
    from torsh.engine.optim import adopt_construction

    p = torch.nn.Parameter(torch.zeros(2))
    q = torch.nn.Parameter(torch.zeros(2))
    defaults = {"lr": 0.1, "fused": True, "foreach": True, "capturable": True, "differentiable": False}
    with caplog.at_level("WARNING", logger="torsh.engine"):
        kept, groups = adopt_construction(torch.optim.AdamW, defaults, [{"params": [p], **defaults},
                                                                         {"params": [q], "lr": 0.2}])
    assert kept["fused"] is True and kept["foreach"] is None and kept["capturable"] is False
    assert groups[0]["fused"] is True and groups[0]["foreach"] is None and groups[0]["capturable"] is False
    assert groups[1] == {"params": [q], "lr": 0.2}
    text = caplog.text
    assert text.count("fused=True and foreach=True cannot be combined") == 1  # once, not per group
    assert "capturable=True needs the step tensors on" in text and "cpu: capturable=False" in text
    torch.optim.AdamW(groups, **kept)  # torch accepts what is kept

    integer = torch.zeros(2, dtype=torch.int64)
    kept, _ = adopt_construction(torch.optim.SGD, {"lr": 0.1, "fused": True}, [{"params": [integer]}])
    assert kept["fused"] is False
