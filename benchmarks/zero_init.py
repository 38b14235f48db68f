"""``python -m benchmarks.zero_init``: memory per rank while a model is built under ``deepspeed.zero.Init`` (ZeRO-3),
torsh against DeepSpeed 0.19.8, at 2 and 4 ranks.

The model is 12 bias-free ``Linear(2048, 2048)`` layers in fp32 (192 MiB of weights), built with the same config
on both engines, then ``initialize`` at stage 3 and one training step. Per rank: the resident memory the build adds
(``VmRSS`` after minus before), the peak during the build (``VmHWM``, reset before it), the elements the rank holds
after the build, and the peak after the first step. glibc keeps freed memory in the process unless
``MALLOC_MMAP_THRESHOLD_`` is small, so it is set to 64 KiB for both engines. Each engine and world size runs in its
own launch. Targets (issue: memory is the contract): the build adds at most DeepSpeed's + 10% and at most model /
ranks + the largest module + 64 MiB; the peak after the first step stays at or below DeepSpeed's.

Writes ``benchmarks/results/zero-init.json``, ``zero-init.md`` (the table the results page includes) and
``docs/zero-init-memory.png`` (the ratios as a chart, on the same page).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from benchmarks.ranks import launch, options_or_worker, reset_peak, status_mib, worst

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CHART = ROOT / "docs" / "zero-init-memory.png"
LAYERS, WIDTH = 12, 2048
MODEL_MIB = LAYERS * WIDTH * WIDTH * 4 / 2**20
LARGEST_MODULE_MIB = WIDTH * WIDTH * 4 / 2**20


def worker(engine: str, out: str) -> None:
    """One rank: build under zero.Init, initialize at stage 3, one step; rank 0 writes every rank's numbers."""
    import torch
    import torch.distributed as dist

    if engine == "deepspeed":
        import deepspeed
    else:
        import torsh.compat.deepspeed as deepspeed
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}  # fmt: skip
    torch.manual_seed(0)
    dist.barrier()
    before = status_mib("VmRSS")
    reset_peak()
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))
    built = {"added_mib": status_mib("VmRSS") - before, "build_peak_mib": status_mib("VmHWM") - before,
             "held_elements": sum(p.ds_tensor.numel() for p in model.parameters())}  # fmt: skip
    engine_, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    reset_peak()
    x = torch.randn(2, WIDTH)
    loss = engine_(x).float().pow(2).mean()
    engine_.backward(loss)
    engine_.step()
    built["step_peak_mib"] = status_mib("VmHWM")
    gathered = [None] * world
    dist.all_gather_object(gathered, built)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()


def measure(engine: str, nproc: int) -> list[dict] | str:
    """Every rank's numbers for one launch, or the error text."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        return launch("benchmarks.zero_init", [engine, out], nproc, out, {"DS_ACCELERATOR": "cpu"})


def table(results: dict) -> str:
    lines = [f"Built under `zero.Init`: {LAYERS} x Linear({WIDTH}, {WIDTH}), no bias, fp32 ({MODEL_MIB:.0f} MiB); the "
             "worst rank of each launch. Bound: model / ranks + largest module + 64 MiB.", "",
             "| ranks | added by the build, MiB: DeepSpeed | torsh | torsh/DeepSpeed | bound | elements held per rank: "
             "DeepSpeed | torsh | peak after the first step, MiB: DeepSpeed | torsh | torsh/DeepSpeed |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for nproc, row in sorted(results.items(), key=lambda kv: int(kv[0])):
        ds, ours = row.get("deepspeed"), row.get("torsh")
        if not isinstance(ours, list):
            lines.append(f"| {nproc} | error: {str(ours)[-200:]!r} |")
            continue
        bound = MODEL_MIB / int(nproc) + LARGEST_MODULE_MIB + 64
        if isinstance(ds, list):
            lines.append(f"| {nproc} | {worst(ds, 'added_mib'):.0f} | {worst(ours, 'added_mib'):.0f} | "
                         f"{worst(ours, 'added_mib') / worst(ds, 'added_mib'):.2f} | {bound:.0f} | "
                         f"{worst(ds, 'held_elements') / 1e6:.1f} M | {worst(ours, 'held_elements') / 1e6:.1f} M | "
                         f"{worst(ds, 'step_peak_mib'):.0f} | {worst(ours, 'step_peak_mib'):.0f} | "
                         f"{worst(ours, 'step_peak_mib') / worst(ds, 'step_peak_mib'):.2f} |")  # fmt: skip
        else:
            lines.append(f"| {nproc} | - | {worst(ours, 'added_mib'):.0f} | - | {bound:.0f} | - | "
                         f"{worst(ours, 'held_elements') / 1e6:.1f} M | - | {worst(ours, 'step_peak_mib'):.0f} | - |")
    return "\n".join(lines) + "\n"


def chart(results: dict, path: Path) -> bool:
    """The torsh/DeepSpeed ratios per world size as a bar chart (False when matplotlib or DeepSpeed is absent)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [(n, r) for n, r in sorted(results.items(), key=lambda kv: int(kv[0]))
            if isinstance(r.get("torsh"), list) and isinstance(r.get("deepspeed"), list)]  # fmt: skip
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.35
    for i, (key, label) in enumerate((("added_mib", "memory added by the build"),
                                      ("step_peak_mib", "peak after the first step"))):
        ratios = [worst(r["torsh"], key) / worst(r["deepspeed"], key) for _, r in rows]
        ax.bar([j + i * width for j in range(len(rows))], ratios, width, label=label)
    ax.axhline(1.1, color="grey", linestyle="--", linewidth=1, label="target for the build (1.1)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width / 2 for j in range(len(rows))], [f"{n} ranks" for n, _ in rows])
    ax.set_ylabel("torsh / DeepSpeed")
    ax.set_title("ZeRO-3, model built under zero.Init")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = options_or_worker("python -m benchmarks.zero_init", __doc__, worker, argv, ranks="2,4",
                             engines="torsh,deepspeed")  # fmt: skip
    if args is None:
        return 0
    results: dict[str, dict] = {}
    for nproc in args.ranks.split(","):
        for engine in args.engines.split(","):
            print(f"zero.Init, {nproc} ranks, {engine} ...", flush=True)
            results.setdefault(nproc, {})[engine] = measure(engine, int(nproc))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "zero-init.json").write_text(json.dumps(results, indent=2) + "\n")
    text = table(results)
    (RESULTS / "zero-init.md").write_text(text)
    chart(results, CHART)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
