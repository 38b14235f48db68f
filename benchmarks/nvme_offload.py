"""``python -m benchmarks.nvme_offload``: host memory and step time of NVMe offload against CPU offload, 2 ranks.

The model is 10 bias-free ``Linear(2048, 2048)`` layers in fp32 (42 M parameters: 320 MiB of AdamW state over the
ranks), trained with torsh's engine from a DeepSpeed JSON at ZeRO-2 and ZeRO-3 with ``offload_optimizer`` on the
CPU and on NVMe (``nvme_path`` a directory on the local disk). NVMe runs twice: plain positional file I/O on the
calling thread, and ``aio.intra_op_parallelism: 2`` with ``pipeline_read``/``pipeline_write`` (a thread pool reading
the next piece and writing the last one while a piece steps). ``sub_group_size`` is 4 M elements, so the plain
variant holds one piece's AdamW state (32 MiB per rank) in host memory during the NVMe step, the pipelined one up
to four (the piece stepping, the one read ahead, two being written: 128 MiB).

Per rank, after one warm-up step: the peak resident memory over the timed steps (``VmHWM``, reset after the
warm-up), the resident memory between steps (``VmRSS``) and the mean step time (forward, backward, step) over 5
steps. glibc keeps freed memory unless ``MALLOC_MMAP_THRESHOLD_`` is small, so it is 64 KiB in every launch. The
files' pages sit in the kernel's page cache, which is not the process's memory (and is given back under pressure).

Writes ``benchmarks/results/nvme-offload.json`` and ``nvme-offload.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.ranks import launch, reset_peak, status_mib, worst

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LAYERS, WIDTH, STEPS = 10, 2048, 5
STATE_MIB = LAYERS * WIDTH * WIDTH * 8 / 2**20
SUB_GROUP = 4_000_000
VARIANTS = {
    "cpu": {"device": "cpu"},
    "nvme": {"device": "nvme"},
    "nvme-threads-pipelined": {"device": "nvme", "pipeline_read": True, "pipeline_write": True, "threads": 2},
}


def config(stage: int, variant: str, nvme_path: str) -> dict:
    spec = dict(VARIANTS[variant])
    threads = spec.pop("threads", 1)
    offload = {**spec, "pin_memory": False, **({"nvme_path": nvme_path} if spec["device"] == "nvme" else {})}
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "offload_optimizer": offload, "sub_group_size": SUB_GROUP},
            "aio": {"block_size": 1048576, "intra_op_parallelism": threads}}  # fmt: skip


def worker(stage: int, variant: str, nvme_path: str, out: str) -> None:
    """One rank: initialize, a warm-up step, then ``STEPS`` timed steps; rank 0 writes every rank's numbers."""
    import torch
    import torch.distributed as dist

    import torsh.compat.deepspeed as deepspeed

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(stage, variant, nvme_path))  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    losses = []

    def step() -> None:
        loss = engine(torch.randn(4, WIDTH, generator=g)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    step()
    dist.barrier()
    reset_peak()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    elapsed = (time.perf_counter() - start) / STEPS
    mine = {"step_s": elapsed, "peak_mib": status_mib("VmHWM"), "between_mib": status_mib("VmRSS"),
            "losses": losses}  # fmt: skip
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()


def measure(stage: int, variant: str) -> list[dict] | str:
    """Every rank's numbers for one launch, or the error text."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("TORSH_NVME_BENCH_DIR")) as tmp:
        out = str(Path(tmp) / "out.json")
        return launch("benchmarks.nvme_offload", [str(stage), variant, tmp, out], 2, out)


def table(results: dict) -> str:
    lines = [f"{LAYERS} x Linear({WIDTH}, {WIDTH}), fp32, AdamW ({STATE_MIB:.0f} MiB of optimizer state over 2 ranks), "
             f"sub_group_size {SUB_GROUP:,}; the worst rank; mean of {STEPS} steps after a warm-up.", "",
             "| stage | offload | peak RSS, MiB | RSS between steps, MiB | step, s | peak vs CPU offload | "
             "step time vs CPU offload | losses as CPU offload's |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for stage, row in sorted(results.items()):
        cpu = row.get("cpu")
        for variant, ranks in row.items():
            if not isinstance(ranks, list):
                lines.append(f"| {stage} | {variant} | error: {str(ranks)[-200:]!r} |")
                continue
            same = isinstance(cpu, list) and all(a["losses"] == b["losses"] for a, b in zip(ranks, cpu))
            ratio = (lambda k: f"{worst(ranks, k) / worst(cpu, k):.2f}") if isinstance(cpu, list) else (lambda k: "-")
            lines.append(f"| {stage} | {variant} | {worst(ranks, 'peak_mib'):.0f} | "
                         f"{worst(ranks, 'between_mib'):.0f} | "
                         f"{worst(ranks, 'step_s'):.2f} | {ratio('peak_mib')} | {ratio('step_s')} | "
                         f"{'yes' if same else 'no'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=4, metavar=("STAGE", "VARIANT", "NVME_PATH", "OUT"))
    parser.add_argument("--stages", default="2,3")
    args = parser.parse_args()
    if args.worker:
        stage, variant, path, out = args.worker
        worker(int(stage), variant, path, out)
        return
    results = {}
    for stage in (int(s) for s in args.stages.split(",")):
        results[str(stage)] = {variant: measure(stage, variant) for variant in VARIANTS}
        print(f"stage {stage} done", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "nvme-offload.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (RESULTS / "nvme-offload.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
