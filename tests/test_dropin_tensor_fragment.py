"""DeepSpeed's tensor-fragment API (``deepspeed.utils.safe_get/set_full/local_*``) at stages 0-3 on two ranks.

What DeepSpeed's ``test_zero_tensor_fragment.py`` relies on, and what it leaves unchecked: a whole value is the same
on every rank; the local parts of the ranks put together are the whole value (ZeRO-1/2: this rank's range of the
flattened parameter; ZeRO-3: DeepSpeed's flat partition of ``ceil(numel / W)`` elements, the last padded with
zeros, also where FSDP2's row cut differs from it); a written optimizer state is the one the next step updates; a
local write reaches the whole value; a parameter that does not train gives None; optimizer state before the first
step and state that is not per element are clear errors.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

import _engine_harness

STAGES = (0, 1, 2, 3, "2-nvme", "3-nvme")  # the optimizer state in files between steps under NVMe offload
BETA1 = 0.9  # Adam's default: a step updates exp_avg to BETA1 * exp_avg + (1 - BETA1) * grad


def _values(t: torch.Tensor | None) -> list[float] | None:
    return None if t is None else t.detach().float().reshape(-1).tolist()


def _error(fn) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return ""


def _stage(ds, case, rank: int, out: str) -> dict:
    utils = ds.utils
    stage = int(str(case)[0])

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))  # 3 rows: FSDP2 cuts 2 + 1
    model[0].bias.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}}
    if "nvme" in str(case):
        os.makedirs(Path(out, "nvme"), exist_ok=True)
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(Path(out, "nvme"))}
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    params = dict(engine.module.named_parameters())
    weight, frozen = params["0.weight"], params["0.bias"]
    x = torch.randn(1, 5, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).sum())
    out = {"before_step": utils.safe_get_full_optimizer_state(weight, "exp_avg"),
           "set_before_step": _error(lambda: utils.safe_set_full_optimizer_state(weight, torch.zeros(3, 5),
                                                                                 "exp_avg")),
           "frozen": [utils.safe_get_full_fp32_param(frozen), utils.safe_get_local_fp32_param(frozen),
                      utils.safe_get_full_grad(frozen), utils.safe_get_local_grad(frozen)]}  # fmt: skip
    utils.safe_update_full_grad_vectorized(list(params.values()), lambda grad, p: torch.full_like(grad, 0.25))
    out["updated_grad"] = _values(utils.safe_get_full_grad(weight))
    out["updated_local_grad"] = _values(utils.safe_get_local_grad(weight))
    engine.step()

    out["exp_avg"] = _values(utils.safe_get_full_optimizer_state(weight, "exp_avg"))
    out["local_exp_avg"] = _values(utils.safe_get_local_optimizer_state(weight, "exp_avg"))
    even = params["1.weight"]  # 2 rows: FSDP2's cut is DeepSpeed's partition, read without communication
    out["even_exp_avg"] = _values(utils.safe_get_full_optimizer_state(even, "exp_avg"))
    out["even_local_exp_avg"] = _values(utils.safe_get_local_optimizer_state(even, "exp_avg"))
    out["frozen_state"] = utils.safe_get_full_optimizer_state(frozen, "exp_avg")
    written = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    utils.safe_set_full_optimizer_state(weight, written, "exp_avg")
    out["exp_avg_written"] = _values(utils.safe_get_full_optimizer_state(weight, "exp_avg"))
    engine.backward(engine(x).sum() * 0)  # one more step from a known gradient: it updates the written state
    for p in params.values():
        if p.requires_grad:
            utils.safe_set_full_grad(p, torch.ones(p.shape))
    out["grad_next"] = _values(utils.safe_get_full_grad(weight))
    engine.step()
    out["exp_avg_stepped"] = _values(utils.safe_get_full_optimizer_state(weight, "exp_avg"))

    local = utils.safe_get_local_fp32_param(weight)
    utils.safe_set_local_fp32_param(weight, torch.full_like(local, rank + 1.0))
    out["after_local_write"] = _values(utils.safe_get_full_fp32_param(weight))
    local_state = utils.safe_get_local_optimizer_state(weight, "exp_avg_sq")
    utils.safe_set_local_optimizer_state(weight, torch.full_like(local_state, 10.0 * (rank + 1)), "exp_avg_sq")
    out["exp_avg_sq_after_local_write"] = _values(utils.safe_get_full_optimizer_state(weight, "exp_avg_sq"))
    out["errors"] = {
        "step": _error(lambda: utils.safe_get_full_optimizer_state(weight, "step")),
        "unknown": _error(lambda: utils.safe_get_local_optimizer_state(weight, "momentum_buffer")),
        "numel": _error(lambda: utils.safe_set_full_fp32_param(weight, torch.zeros(4))),
        "local_numel": _error(lambda: utils.safe_set_local_optimizer_state(weight, torch.zeros(local.numel() + 1),
                                                                           "exp_avg")),
    }  # fmt: skip
    engine.destroy()
    return out


def _rank(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))  # fmt: skip
    import torsh.compat.deepspeed as ds

    record = {str(case): _stage(ds, case, rank, out) for case in STAGES}
    with ds.zero.Init():
        layer = torch.nn.Linear(4, 4)
    record["zero_init"] = [_error(lambda: ds.utils.safe_get_full_fp32_param(layer.weight)),
                           _error(lambda: ds.utils.safe_get_local_optimizer_state(layer.weight, "exp_avg"))]
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def records() -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        _engine_harness.start(_rank, (2, _engine_harness.free_port(), out), 2, timeout=300)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


def _joined(records: list[dict], stage: int, key: str) -> list[float]:
    """The ranks' local parts of one value, in rank order (stage 0: each rank holds it whole, so rank 0's)."""
    if stage == 0:
        return records[0][str(stage)][key]
    return records[0][str(stage)][key] + records[1][str(stage)][key]


@pytest.mark.parametrize("stage", STAGES)
def test_whole_values_agree_and_local_parts_make_them_up(records, stage):
    r0, r1 = (r[str(stage)] for r in records)
    assert r0["exp_avg"] == r1["exp_avg"] and len(r0["exp_avg"]) == 15
    joined = _joined(records, stage, "local_exp_avg")
    if stage == 3:  # DeepSpeed's partition: ceil(15 / 2) = 8 elements a rank, the last one padded with a zero
        assert [len(r0["local_exp_avg"]), len(r1["local_exp_avg"])] == [8, 8] and joined[15:] == [0.0]
    assert joined[:15] == r0["exp_avg"]
    assert _joined(records, stage, "even_local_exp_avg") == r0["even_exp_avg"] and len(r0["even_exp_avg"]) == 6
    assert r0["updated_grad"] == [0.25] * 15 and _joined(records, stage, "updated_local_grad")[:15] == [0.25] * 15


@pytest.mark.parametrize("stage", STAGES)
def test_written_optimizer_state_is_the_one_the_next_step_updates(records, stage):
    for r in (rec[str(stage)] for rec in records):
        assert r["exp_avg_written"] == [float(i) for i in range(15)]
        assert r["grad_next"] == [1.0] * 15
        assert r["exp_avg_stepped"] == pytest.approx([BETA1 * i + (1 - BETA1) for i in range(15)], rel=1e-6)


@pytest.mark.parametrize("stage", STAGES)
def test_local_writes_reach_the_whole_value(records, stage):
    r0, r1 = (r[str(stage)] for r in records)
    if stage == 0:  # every rank holds the whole tensor and writes its own copy
        assert r0["after_local_write"] == [1.0] * 15 and r1["after_local_write"] == [2.0] * 15
        return
    ones = len(records[0][str(stage)]["local_exp_avg"])  # rank 0's part: 8 elements at stage 3 (DeepSpeed's)
    assert r0["after_local_write"] == r1["after_local_write"] == [1.0] * ones + [2.0] * (15 - ones)
    assert r0["exp_avg_sq_after_local_write"] == [10.0] * ones + [20.0] * (15 - ones)


@pytest.mark.parametrize("stage", STAGES)
def test_frozen_parameters_have_none_and_misuse_is_a_clear_error(records, stage):
    r = records[0][str(stage)]
    assert r["frozen"] == [None] * 4 and r["frozen_state"] is None
    assert r["before_step"] is None and "first step" in r["set_before_step"]
    assert "'step' is not one value per element" in r["errors"]["step"]
    assert "no 'momentum_buffer'" in r["errors"]["unknown"] and "exp_avg" in r["errors"]["unknown"]
    assert "4 elements" in r["errors"]["numel"] and "15 expected" in r["errors"]["numel"]
    assert "safe_set_local_optimizer_state" in r["errors"]["local_numel"]



def test_a_parameter_zero_init_partitioned_before_initialize_is_refused_by_name(records):
    """zero.Init's partitions before ``initialize`` have no fp32 weights, gradient or optimizer state yet (DeepSpeed
    fails there on a missing attribute): a clear error, not the empty ``data`` read as the value."""
    for message in records[0]["zero_init"]:
        assert "deepspeed.zero.Init and no engine holds it yet" in message
