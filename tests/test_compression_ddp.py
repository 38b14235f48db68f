"""Gradient compression on 2 ranks (gloo, CPU): numerics of each method, averaging, bytes and convergence.

One spawned launch runs every case (start-up dominates a 2-process test) and writes its measurements; the
tests below assert on them. Each rank has different data, so a method that summed instead of averaging would
be off by a factor of 2. Every rank can recompute both ranks' local gradients, so the exact mean and each
method's expected output are computed independently of the hooks.

Known error of each method, per step, against the exact mean of the two local gradients g0, g1:
  none      exact
  fp16/bf16 equal to (cast(g0)/2 + cast(g1)/2) summed in the low dtype: one rounding of the low dtype
  powersgd  exact (to fp32 rounding) when the mean gradient of every matrix has rank <= the PowerSGD rank
  topk      equal to (topk(g0) + topk(g1)) / 2 in the first round; with error feedback the running sum of
            applied gradients tends to the running sum of mean gradients
  quantize  |error| < (scale0 + scale1) / 2 per element with stochastic rounding, half that with nearest
            rounding, where scale_r = (max - min) / (2**bits - 1) of rank r's bucket
"""

from __future__ import annotations

import json
import math
import time
import traceback

import pytest

torch = pytest.importorskip("torch", reason="the engine needs torch")
import torch.distributed as dist
from torch import nn

import _engine_harness as h  # noqa: E402
from torsh.config import CompressionConfig

pytestmark = pytest.mark.slow

WORLD = 2

ONE_STEP = {
    "none": {},
    "fp16": {"method": "fp16"},
    "bf16": {"method": "bf16"},
    "powersgd": {"method": "powersgd", "rank": 2, "error_feedback": False, "warm_start": False},
    "topk": {"method": "topk", "ratio": 0.1},
    "quantize8": {"method": "quantize", "bits": 8},
    "quantize4": {"method": "quantize", "bits": 4},
    "quantize2": {"method": "quantize", "bits": 2},
    "quantize4_ef": {"method": "quantize", "bits": 4, "error_feedback": True},
}
RUNNING_SUM = {
    "fp16": {"method": "fp16"},
    "bf16": {"method": "bf16"},
    "powersgd": {"method": "powersgd", "rank": 1},
    # No bucket rebuild with find_unused_parameters: several buckets in every compressed round (torch's hook
    # deadlocks gloo's two worker threads when two buckets are in flight).
    "powersgd_unused": {"method": "powersgd", "rank": 1,
                        "ddp": {"find_unused_parameters": True, "bucket_cap_mb": 4e-4}},
    "topk": {"method": "topk", "ratio": 0.05},
    "topk_no_ef": {"method": "topk", "ratio": 0.05, "error_feedback": False},
    "quantize8": {"method": "quantize", "bits": 8},
    "quantize2": {"method": "quantize", "bits": 2},
    "quantize2_ef": {"method": "quantize", "bits": 2, "error_feedback": True},
    # Gradients that are views into the bucket: the hooks write the bucket in place.
    "topk_bucket_view": {"method": "topk", "ratio": 0.05,
                         "ddp": {"gradient_as_bucket_view": True, "bucket_cap_mb_list": [4e-4] * 8}},
    "quantize2_ef_bucket_view": {"method": "quantize", "bits": 2, "error_feedback": True,
                                 "ddp": {"gradient_as_bucket_view": True, "bucket_cap_mb_list": [4e-4] * 8}},
}
RUNNING_SUM_STEPS = (10, 30, 90)
BYTES = {
    "none": {},
    "fp16": {"method": "fp16"},
    "bf16": {"method": "bf16"},
    "powersgd": {"method": "powersgd", "rank": 2, "error_feedback": False, "warm_start": False},
    "topk": {"method": "topk", "ratio": 0.01},
    "quantize8": {"method": "quantize", "bits": 8},
    "quantize4": {"method": "quantize", "bits": 4},
    "quantize2": {"method": "quantize", "bits": 2},
}
CONVERGENCE = {
    "none": {},
    "fp16": {"method": "fp16"},
    "bf16": {"method": "bf16"},
    "powersgd": {"method": "powersgd", "rank": 2},
    "topk": {"method": "topk", "ratio": 0.01},
    "quantize8": {"method": "quantize", "bits": 8},
}
#: Linear regression 64 -> 8 (520 parameters) on y = x W* + 0.1 noise, batch 32 per rank, plain SGD lr 0.1,
#: 400 steps. The held-out loss falls from ~59 to the noise floor (0.01) uncompressed; top-k 1% sends ~6 of
#: 520 entries a step, so each entry waits ~90 steps and only converges with error feedback.
CONVERGENCE_STEPS, CONVERGENCE_LR = 400, 0.1


# --------------------------------------------------------------------------------------------------
# the spawned launch


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 6))


def _batch(rank: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, 16, generator=g) * (1 + rank), torch.randn(n, 6, generator=g)


def _local_grads(rank: int, n: int = 4) -> list[torch.Tensor]:
    """Rank ``rank``'s gradient without any communication."""
    model = _mlp()
    x, y = _batch(rank, n)
    ((model(x) - y) ** 2).mean().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _ddp(cfg: dict, model: nn.Module | None = None, **ddp_kwargs):
    from torch.nn.parallel import DistributedDataParallel

    from torsh.engine.compression import apply_compression

    ddp = DistributedDataParallel(model if model is not None else _mlp(), **ddp_kwargs)
    return ddp, apply_compression(ddp, CompressionConfig(**cfg))


def _applied(ddp, rank: int, n: int = 4) -> list[torch.Tensor]:
    ddp.zero_grad(set_to_none=True)
    x, y = _batch(rank, n)
    ((ddp(x) - y) ** 2).mean().backward()
    return [p.grad.detach().clone() for p in ddp.parameters()]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _rel(a, b) -> float:
    return float((_flat(a) - _flat(b)).norm() / _flat(b).norm())


def _expected_cast(grads, dtype) -> list[torch.Tensor]:
    return [(a.to(dtype) / WORLD + b.to(dtype) / WORLD).float() for a, b in zip(*grads, strict=True)]


def _expected_topk(grads, ratio) -> list[torch.Tensor]:
    total = torch.zeros_like(_flat(grads[0]))
    for local in grads:
        flat = _flat(local)
        k = math.ceil(ratio * flat.numel())
        idx = flat.abs().topk(k).indices
        total[idx] += flat[idx]
    total /= WORLD
    out, offset = [], 0
    for t in grads[0]:
        out.append(total[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def case_one_step(rank: int) -> dict:
    out = {}
    for name, cfg in ONE_STEP.items():
        n = 1 if name == "powersgd" else 4  # one sample per rank: every mean weight gradient has rank <= 2
        grads = [_local_grads(r, n) for r in range(WORLD)]
        mean = [(a + b) / WORLD for a, b in zip(*grads, strict=True)]
        ddp, state = _ddp(cfg)
        applied = _applied(ddp, rank, n)
        row = {
            "rel_err_vs_mean": _rel(applied, mean),
            "max_err_vs_mean": float((_flat(applied) - _flat(mean)).abs().max()),
            "compressed": state.stats.last.compressed,
        }
        if name in ("fp16", "bf16"):
            expected = _expected_cast(grads, getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[name]))
            row["max_err_vs_expected"] = float((_flat(applied) - _flat(expected)).abs().max())
            row["eps"] = float(torch.finfo(getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[name])).eps)
            row["max_abs_mean"] = float(_flat(mean).abs().max())
        if name == "topk":
            expected = _expected_topk(grads, cfg["ratio"])
            row["max_err_vs_expected"] = float((_flat(applied) - _flat(expected)).abs().max())
        if name.startswith("quantize"):
            levels = 2 ** cfg["bits"] - 1
            scales = [float(_flat(g).max() - _flat(g).min()) / levels for g in grads]
            bound = sum(scales) / WORLD * (0.5 if cfg.get("error_feedback") else 1.0)
            row["max_err_over_bound"] = row["max_err_vs_mean"] / bound
        out[name] = row
    return out


def case_running_sum(rank: int) -> dict:
    """The same batch every step, no optimizer step: the mean of the applied gradients over T steps against the
    exact mean gradient. Tiny buckets, so that the first round has several buckets and DDP's rebuild after it
    changes the layout under the per-rank error-feedback memory."""
    grads = [_local_grads(r) for r in range(WORLD)]
    mean = [(a + b) / WORLD for a, b in zip(*grads, strict=True)]
    out = {}
    for name, cfg in RUNNING_SUM.items():
        cfg = dict(cfg)
        ddp, state = _ddp(cfg, **cfg.pop("ddp", {"bucket_cap_mb_list": [4e-4] * 8}))
        total = [torch.zeros_like(t) for t in mean]
        errors = {}
        for step in range(1, max(RUNNING_SUM_STEPS) + 1):
            for acc, g in zip(total, _applied(ddp, rank), strict=True):
                acc += g
            if step in RUNNING_SUM_STEPS:
                errors[str(step)] = _rel([t / step for t in total], mean)
        out[name] = {"rel_err": errors, "steps_counted": state.stats.steps,
                     "buckets": [s.buckets for s in state.stats.history]}  # fmt: skip
    return out


def case_schedule(rank: int) -> dict:
    """Which rounds compress: warm-up, period, and PowerSGD's minimum start with memory."""
    grads = [_local_grads(r) for r in range(WORLD)]
    mean = [(a + b) / WORLD for a, b in zip(*grads, strict=True)]
    out = {}
    for name, cfg in {
        "fp16_start1_period2": {"method": "fp16", "start_step": 1, "period": 2},
        "powersgd_default": {"method": "powersgd"},
        "topk_start3": {"method": "topk", "ratio": 0.1, "start_step": 3},
    }.items():
        ddp, state = _ddp(cfg)
        exact = [_rel(_applied(ddp, rank), mean) == 0.0 for _ in range(5)]
        out[name] = {"compressed": [s.compressed for s in state.stats.history], "exact": exact,
                     "ratios": [s.ratio for s in state.stats.history]}  # fmt: skip
    return out


def case_bytes(rank: int) -> dict:
    out = {}
    for name, cfg in BYTES.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
        ddp, state = _ddp(cfg, model)
        x = torch.randn(8, 256)
        with ddp.no_sync():  # accumulation without communication must not count as a round
            ddp(x).square().mean().backward()
        ddp(x).square().mean().backward()
        last = state.stats.last
        out[name] = {"steps": state.stats.steps, "dense": last.dense_bytes, "sent": last.sent_bytes,
                     "ratio": state.stats.ratio, "numel": sum(p.numel() for p in model.parameters())}  # fmt: skip
    return out


def case_convergence(rank: int) -> dict:
    teacher = torch.randn(64, 8, generator=torch.Generator().manual_seed(7))
    held_out = torch.Generator().manual_seed(99)
    x_eval = torch.randn(4096, 64, generator=held_out)
    y_eval = x_eval @ teacher + 0.1 * torch.randn(4096, 8, generator=held_out)
    runs = {}
    for name, cfg in CONVERGENCE.items():
        torch.manual_seed(0)
        ddp, state = _ddp(cfg, nn.Linear(64, 8))
        runs[name] = (ddp, state, torch.optim.SGD(ddp.parameters(), lr=CONVERGENCE_LR))

    def held_out_loss(ddp) -> float:
        with torch.no_grad():
            return float(((ddp.module(x_eval) - y_eval) ** 2).mean())

    initial = held_out_loss(runs["none"][0])
    curves: dict[str, list[float]] = {name: [] for name in runs}
    data = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, CONVERGENCE_STEPS + 1):
        x = torch.randn(32, 64, generator=data)
        y = x @ teacher + 0.1 * torch.randn(32, 8, generator=data)
        for ddp, _, opt in runs.values():  # interleaved: every method sees the same batches
            opt.zero_grad()
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()
        if step % (CONVERGENCE_STEPS // 4) == 0:
            for name, (ddp, _, _) in runs.items():
                curves[name].append(held_out_loss(ddp))
    return {"initial": initial, "curves": curves, "byte_ratio": {n: s.stats.ratio for n, (_, s, _) in runs.items()}}


CASES = [case_one_step, case_running_sum, case_schedule, case_bytes, case_convergence]


def _worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    results: dict = {"seconds": {}}
    for case in CASES:
        started = time.perf_counter()
        try:
            results[case.__name__] = case(rank)
            results["seconds"][case.__name__] = time.perf_counter() - started
        except Exception:  # noqa: BLE001 - one broken case must not hide the others' results
            results[case.__name__] = {"error": traceback.format_exc()}
            break  # the ranks may now disagree on which collective comes next
    dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)


#: A hang (a deadlocked collective) fails the tests instead of stalling the suite.
LAUNCH_TIMEOUT_SECONDS = 600


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compression")
    launch = h.start(_worker, (str(tmp / "store"), str(tmp)), WORLD, join=False)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_SECONDS
    while not launch.join(timeout=5):
        if time.monotonic() > deadline:
            for process in launch.processes:
                process.kill()
            pytest.fail(f"the 2-rank launch did not finish in {LAUNCH_TIMEOUT_SECONDS} s")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _case(results, name: str, rank: int = 0) -> dict:
    found = results[rank].get(name)
    assert found is not None, f"{name} did not run (an earlier case failed)"
    assert "error" not in found, found["error"]
    return found


# --------------------------------------------------------------------------------------------------
# the tests


def test_uncompressed_is_exact_and_reports_dense_bytes(results):
    for rank in range(WORLD):
        row = _case(results, "case_one_step", rank)["none"]
        assert row["max_err_vs_mean"] == 0.0
        assert row["compressed"] is False


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_cast_methods_round_once_in_the_low_dtype(results, name):
    row = _case(results, "case_one_step")[name]
    assert row["compressed"] is True
    assert row["max_err_vs_expected"] == 0.0  # the same numerics as casting, halving and adding by hand
    assert 0.0 < row["max_err_vs_mean"] <= row["eps"] * row["max_abs_mean"]  # really rounded, by one ulp at most


def test_powersgd_recovers_a_low_rank_mean_gradient(results):
    for rank in range(WORLD):
        row = _case(results, "case_one_step", rank)["powersgd"]
        assert row["compressed"] is True
        assert row["rel_err_vs_mean"] < 1e-5  # a sum would be 1.0 off


def test_topk_first_round_is_the_mean_of_each_ranks_top_entries(results):
    row = _case(results, "case_one_step")["topk"]
    assert row["max_err_vs_expected"] < 1e-7
    assert row["rel_err_vs_mean"] > 0.1  # 10% of the entries: far from the dense mean, as it should be


@pytest.mark.parametrize("name", ["quantize8", "quantize4", "quantize2", "quantize4_ef"])
def test_quantize_error_is_within_one_quantization_step(results, name):
    for rank in range(WORLD):
        row = _case(results, "case_one_step", rank)[name]
        assert row["compressed"] is True
        assert 0.0 < row["max_err_over_bound"] < 1.0


@pytest.mark.parametrize("name", [n for n in RUNNING_SUM if n != "topk_no_ef"])
def test_running_mean_of_applied_gradients_tends_to_the_mean_not_the_sum(results, name):
    row = _case(results, "case_running_sum")[name]
    errors = [row["rel_err"][str(t)] for t in RUNNING_SUM_STEPS]
    assert row["steps_counted"] == max(RUNNING_SUM_STEPS)  # one round per backward, however many buckets
    assert row["buckets"][0] > 1
    assert errors[-1] < 0.15, errors  # summing would leave a relative error of 1.0
    if name in ("topk", "powersgd", "powersgd_unused", "quantize2_ef", "topk_bucket_view", "quantize2_ef_bucket_view"):
        # error feedback: what is held back is sent later
        assert errors[-1] < errors[0] / 4, errors


def test_topk_running_sum_converges_only_with_error_feedback(results):
    rows = _case(results, "case_running_sum")
    with_ef = [rows["topk"]["rel_err"][str(t)] for t in RUNNING_SUM_STEPS]
    without = [rows["topk_no_ef"]["rel_err"][str(t)] for t in RUNNING_SUM_STEPS]
    # With error feedback the entries held back arrive later: the error of the running sum shrinks like 1/T.
    assert with_ef[-1] < 0.1 and with_ef[-1] * RUNNING_SUM_STEPS[-1] < 2 * with_ef[0] * RUNNING_SUM_STEPS[0]
    # Without it the same 5% are sent every step and the rest never: the error does not shrink.
    assert min(without) > 0.5


def test_warm_up_and_period_choose_the_compressed_rounds(results):
    rows = _case(results, "case_schedule")
    fp16 = rows["fp16_start1_period2"]
    assert fp16["compressed"] == [False, True, False, True, False]
    assert fp16["exact"] == [True, False, True, False, True]
    assert fp16["ratios"] == [1.0, 0.5, 1.0, 0.5, 1.0]
    # torch's PowerSGD keeps its memory per bucket index, which DDP renumbers after the first iteration.
    assert rows["powersgd_default"]["compressed"] == [False, False, True, True, True]
    assert rows["topk_start3"]["compressed"] == [False, False, False, True, True]
    assert rows["topk_start3"]["exact"][:3] == [True, True, True]


def test_bytes_on_the_wire(results):
    rows = _case(results, "case_bytes")
    for name, row in rows.items():
        assert row["steps"] == 1, name  # the no_sync backward sent nothing
        assert row["dense"] == row["numel"] * 4, name
    assert rows["none"]["ratio"] == 1.0
    assert rows["fp16"]["ratio"] == rows["bf16"]["ratio"] == 0.5
    topk = rows["topk"]
    assert topk["sent"] == 8 * math.ceil(0.01 * topk["numel"])  # fp32 values + int32 indices, one bucket
    assert topk["ratio"] <= 0.03
    assert rows["quantize8"]["sent"] == rows["quantize8"]["numel"] + 8  # one byte a value, offset and scale
    assert rows["quantize8"]["ratio"] <= 0.26
    assert rows["quantize4"]["ratio"] <= 0.13 and rows["quantize2"]["ratio"] <= 0.07
    # Rank 2 of 256x256 matrices: (256 + 256) * 2 factors each, plus the biases sent as they are.
    assert rows["powersgd"]["sent"] == 4 * (2 * (256 + 256) * 2 + 2 * 256)


@pytest.mark.parametrize("name", [n for n in CONVERGENCE if n != "none"])
def test_convergence_within_five_percent_of_uncompressed(results, name):
    row = _case(results, "case_convergence")
    final = {n: curve[-1] for n, curve in row["curves"].items()}
    assert row["initial"] > 1000 * final["none"]  # the problem is really learnt
    assert final[name] <= 1.05 * final["none"], (final, row["curves"][name])
    assert row["byte_ratio"][name] < 1.0
