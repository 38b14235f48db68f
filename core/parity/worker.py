"""One parity run, N ranks wide: ``python -m torch.distributed.run --nproc-per-node N -m torsh.parity.worker SPEC``.

SPEC is a JSON file ``{"engine": "deepspeed"|"torsh", "seed_dir": ..., "out": ..., "scenarios": [...]}``. Every
scenario runs in this one launch (process start-up and import costs are paid once); for each optimizer step the
worker records the loss (mean over micro-batches and ranks), the global gradient norm, the learning rate, the loss
scale and whether the step was skipped. Rank 0 writes the records to ``out`` and prints progress lines.

Both engines are driven through the same ``initialize`` call and the same training loop, so the only thing that
differs between two runs is the engine (or the config).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torsh.models import batch, build_model, loss_fn


def _engine_module(name: str) -> Any:
    if name == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
        import deepspeed

        return deepspeed
    import torsh

    return torsh


def _to_float(value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor):
        value = value.item()
    return float(value)


def _loss_scale(engine: Any) -> float:
    """The current loss scale, wherever the engine keeps it (1.0 when it does not scale)."""
    for owner in (engine, getattr(engine, "optimizer", None), getattr(engine, "loss_scaler", None)):
        for attr in ("cur_scale", "loss_scale"):
            value = getattr(owner, attr, None) if owner is not None else None
            if isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool):
                return _to_float(value)
        scaler = getattr(owner, "loss_scaler", None) if owner is not None else None
        if scaler is not None and hasattr(scaler, "cur_scale"):
            return _to_float(scaler.cur_scale)
    return 1.0


def _input_dtype(engine: Any) -> torch.dtype:
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


def run_scenario(backend: Any, scenario: dict, seed_path: Path) -> list[dict]:
    """Train one scenario and return one record per optimizer step (identical on every rank)."""
    model_name = scenario["model"]
    model = build_model(model_name, scenario.get("seed", 0))
    model.load_state_dict(torch.load(seed_path, weights_only=True))
    engine, _, _, _ = backend.initialize(model=model, model_parameters=model.parameters(),
                                         config=json.loads(json.dumps(scenario["config"])))  # fmt: skip
    rank, world = dist.get_rank(), dist.get_world_size()
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dtype = _input_dtype(engine)
    records = []
    for step in range(scenario["steps"]):
        skipped_before = engine.skipped_steps
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(gas):
            x, y = batch(model_name, mbs, seed=scenario.get("data_seed", 1), step=step, rank=rank, micro_step=micro)
            x = x.to(engine.device)
            if x.is_floating_point():
                x = x.to(dtype)
            loss = loss_fn(model_name, engine(x), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            total += loss.detach().double().cpu()
        dist.all_reduce(total)
        records.append({
            "step": step + 1,
            "loss": total.item() / (gas * world),
            "grad_norm": _to_float(engine.get_global_grad_norm()),
            "lr": float(engine.get_lr()[0]),
            "loss_scale": _loss_scale(engine),
            "skipped": engine.skipped_steps > skipped_before,
        })  # fmt: skip
        if rank == 0:
            print(f"PROGRESS {scenario['name']} {step + 1}/{scenario['steps']}", flush=True)
    destroy = getattr(engine, "destroy", None)
    if callable(destroy):
        destroy()
    return records


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    backend = _engine_module(spec["engine"])
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    results: dict[str, Any] = {"engine": spec["engine"], "world_size": dist.get_world_size(), "scenarios": {}}
    for scenario in spec["scenarios"]:
        started = time.perf_counter()
        try:
            records = run_scenario(backend, scenario, Path(spec["seed_dir"]) / f"{scenario['name']}.pt")
            results["scenarios"][scenario["name"]] = {"records": records, "seconds": time.perf_counter() - started}
        except Exception as exc:  # a failing scenario must not hide the others' results
            results["scenarios"][scenario["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
            if dist.get_rank() == 0:
                print(f"FAILED {scenario['name']}: {type(exc).__name__}: {exc}", flush=True)
        dist.barrier()
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results, indent=1))
    dist.barrier()
    # The engine's teardown order (release, collect, destroy, collect): left to interpreter exit, a gloo thread
    # can drop the last reference to a tensor mid-finalisation and abort a finished job.
    from torsh.engine.distributed import shutdown

    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
