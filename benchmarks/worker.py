"""One benchmark case on N ranks: ``python -m torch.distributed.run ... -m benchmarks.worker SPEC_JSON``.

Times ``initialize`` (or the hand-written set-up) and each training step, and records the peak RSS of every
rank. Rank 0 writes the result to ``spec["out"]``.

torch's own distributed modules (and ``torch._dynamo``, which DDP and FSDP2 import lazily, 1-3 s on a loaded
machine) are imported up front for every implementation: a training script has them loaded anyway, and their
import time would otherwise drown the set-up difference being measured.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time

import torch
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.optim  # noqa: F401
import torch.nn.parallel  # noqa: F401

from benchmarks.cases import SHAPES, NativeJob, build, deepspeed_config


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main(spec: dict) -> None:
    impl, stage, precision = spec["impl"], spec["stage"], spec["precision"]
    shape = SHAPES[spec["shape"]]
    if impl == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed as backend
    elif impl == "torsh":
        import torsh as backend
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")  # fmt: skip
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(shape.batch, shape.width, generator=g).to(device)
    if precision == "bf16":  # every implementation gets bf16 inputs (torsh and DeepSpeed need them at stages 0/1)
        x = x.to(torch.bfloat16)
    y = torch.randn(shape.batch, 1, generator=g).to(device)
    model = build(shape)
    rss_before = _rss_mib()
    started = time.perf_counter()
    if impl == "native":
        job = NativeJob(model, stage, precision, device)
        step = job.train_step
    else:
        config = deepspeed_config(stage, precision, shape)
        if impl == "torsh":
            # The DeepSpeed config read as torsh reads it, with one addition: every ``Layer`` is its own
            # FSDP2 unit, as the hand-written job wraps it (torsh's default would make the whole
            # ``layers`` Sequential one unit, a direct child of the model). DeepSpeed gathers per module.
            from torsh import adapters

            config = adapters.load(config).result
            config.sharding.wrap.module_classes = ["Layer"]
        engine, *_ = backend.initialize(model=model, model_parameters=model.parameters(), config=config)

        def step(_x, _y):
            loss = torch.nn.functional.mse_loss(engine(_x).float(), _y)
            engine.backward(loss)
            engine.step()
            return loss.detach()

    init_seconds = time.perf_counter() - started
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        t = time.perf_counter()
        step(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t)
    stats = torch.tensor([statistics.median(times), init_seconds, _rss_mib(), _rss_mib() - rss_before],
                         dtype=torch.float64)  # fmt: skip
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank and the largest footprint
    if rank == 0:
        step_s, init_s, peak, delta = stats.tolist()
        result = {**spec, "step_s": step_s, "init_s": init_s, "peak_rss_mib": peak, "rss_delta_mib": delta,
                  "step_times": times}  # fmt: skip
        if device.type == "cuda":
            result["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        with open(spec["out"], "w") as handle:
            json.dump(result, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
