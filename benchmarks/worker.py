"""One benchmark launch on N ranks: ``python -m torch.distributed.run ... -m benchmarks.worker SPEC_JSON``.

``spec["impls"]`` names what the launch runs. One implementation: ``initialize`` (or the hand-written set-up)
and every training step are timed and the peak memory of every rank recorded (RSS; on CUDA also the allocator's
maximum), so the process holds that case
alone. Several (``native`` and ``torsh``, both plain PyTorch): each builds its job on its own copy of the
model and their steps alternate (A B A B ..., the order rotated every step), so that the step-time ratio is
taken under the same machine load, memory layout and process, not between launches that a shared machine
slows by different amounts. DeepSpeed always runs alone: its ZeRO-3 engine replaces
``torch.nn.functional.linear`` for the whole process. Rank 0 writes the result to ``spec["out"]``.

torch's own distributed modules (and ``torch._dynamo``, which DDP and FSDP2 import lazily, 1-3 s on a loaded
machine) are imported up front for every implementation: a training script has them loaded anyway, and their
import time would otherwise drown the set-up difference being measured.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.optim  # noqa: F401
import torch.nn.parallel  # noqa: F401

from benchmarks.cases import (SHAPES, NativeJob, Shape, build, deepspeed_config, loss_of, make_batch, num_params,
                              torsh_wrapping, unit_class)

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def build_step(impl: str, stage: str, precision: str, shape: Shape, device: torch.device,
               torsh_units: str = "engine", wrapping: dict | None = None) -> Step:  # fmt: skip
    """Set up one implementation's job on a fresh model (same seed for every implementation); its step.
    ``torsh_units``: ``"engine"`` leaves the units to the engine (sized from the DeepSpeed config's buckets) and
    the hand-written job wraps the model as ``wrapping`` (:func:`torsh_wrapping`) says, the same units and DDP
    buckets; ``"per_layer"`` makes every block a unit in torsh as in the hand-written job's default.
    ``torsh-per-layer`` is torsh with one unit per block whatever ``torsh_units`` says (the memory-first row)."""
    model = build(shape)
    if impl == "native":
        return NativeJob(model, stage, precision, device, **(wrapping or {})).train_step
    config = deepspeed_config(stage, precision, shape)
    if impl == "deepspeed":
        import deepspeed as backend
    else:
        import torsh as backend

        if torsh_units == "per_layer" or impl == "torsh-per-layer":
            # The DeepSpeed config read as torsh reads it, with one addition: every block (``Layer``, ``Block``)
            # is its own FSDP2 unit, as the hand-written job's default wraps it. Otherwise the DeepSpeed JSON goes
            # to initialize as is: the engine's own units need to know the config is DeepSpeed's.
            from torsh import adapters

            config = adapters.load(config).result
            config.sharding.wrap.module_classes = [unit_class(model)]
            # A config object no longer says it came from DeepSpeed: its effective reduce bucket (DeepSpeed's
            # default) is written out, so that DDP's buckets at stages 0/1 are sized from it as from the JSON.
            config.extensions.setdefault("deepspeed", {}).setdefault("zero_optimization.reduce_bucket_size", 5e8)
    engine, *_ = backend.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def _timed(step: Step, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> float:
    started = time.perf_counter()
    step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def run(spec: dict, device: torch.device, rank: int) -> dict:
    impls, stage, precision = spec["impls"], spec["stage"], spec["precision"]
    shape = SHAPES[spec["shape"]]
    if "deepspeed" in impls:
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else device.type)
        import deepspeed  # noqa: F401 (imported before the clock starts, as torch is)
    x, y = (t.to(device) for t in make_batch(shape, torch.Generator().manual_seed(rank)))
    if precision == "bf16" and x.is_floating_point():
        x = x.to(torch.bfloat16)  # every implementation gets bf16 inputs (torsh and DeepSpeed need them at 0/1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    units = spec.get("torsh_units", "engine")
    # The hand-written job wraps as torsh's engine does (decided before the clock: it is not the job's set-up).
    wrapping = torsh_wrapping(stage, precision, shape) if units == "engine" and "native" in impls else None
    rss_before = _rss_mib()
    steps, init_s = {}, {}
    for impl in impls:
        started = time.perf_counter()
        steps[impl] = build_step(impl, stage, precision, shape, device, units, wrapping)
        init_s[impl] = time.perf_counter() - started
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for i in range(spec["warmup"] + spec["steps"]):
        for impl in impls[i % len(impls):] + impls[:i % len(impls)]:
            elapsed = _timed(steps[impl], x, y, device)
            if i >= spec["warmup"]:
                times[impl].append(elapsed)
    # The slowest rank and the largest footprint: step medians, set-up times, peak RSS and its growth.
    names = [f"{impl}.{metric}" for impl in impls for metric in ("step_s", "init_s")] + ["peak", "delta"]
    values = [v for impl in impls for v in (statistics.median(times[impl]), init_s[impl])]
    stats = torch.tensor(values + [_rss_mib(), _rss_mib() - rss_before], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    measured = dict(zip(names, stats.tolist()))
    if len(impls) > 1:
        return {**spec, "paired": {impl: {"step_s": measured[f"{impl}.step_s"], "step_times": times[impl]}
                                   for impl in impls}}  # fmt: skip
    (impl,) = impls
    result = {**spec, "impl": impl, "step_s": measured[f"{impl}.step_s"], "init_s": measured[f"{impl}.init_s"],
              "peak_rss_mib": measured["peak"], "rss_delta_mib": measured["delta"], "step_times": times[impl],
              "device": device.type, "world_size": dist.get_world_size(), "params": num_params(build(shape)),
              "tokens_per_step": shape.tokens * dist.get_world_size()}  # fmt: skip
    if device.type == "cuda":  # the largest of the ranks, as for RSS
        peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**20], dtype=torch.float64, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        result["cuda_max_allocated_mib"] = peak.item()
    return result


def main(spec: dict) -> None:
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")  # fmt: skip
    if device.type == "cuda":
        torch.cuda.set_device(device)  # FSDP2's default mesh and NCCL use the current device: one GPU per rank
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    result = run(spec, device, rank)
    if rank == 0:
        with open(spec["out"], "w") as handle:
            json.dump(result, handle)
    # Every engine (and the DDP reducer inside it) is freed while the process group still exists: a reducer
    # that outlives destroy_process_group() tears the gloo group down under the GIL from its destructor, which
    # can deadlock against gloo's worker thread releasing a finished collective's tensors.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
