"""``python -m benchmarks.context_parallel``: memory per rank of one training step on a long sequence, the torsh engine
with context parallelism (``parallelism.cp``) against the same model trained by a hand-written PyTorch loop on one
rank with the whole sequence.

The model is 4 pre-norm blocks (causal ``scaled_dot_product_attention`` with 4 heads, a 4x MLP), hidden size 256, on
one sequence of 8,192 tokens, fp32. Per rank: the peak resident memory one forward and backward add (``VmHWM``, reset
after a first step, so that the weights, gradients and optimizer state are already there), and the median time of 3
steps. DeepSpeed has no context parallelism, so the reference is plain torch. Target: at cp 2 the worst rank's step
adds at most 0.65 x the one-rank step (its activations are split in two; the keys and values it gathers, and its
part of the causal mask, are whole-sequence).

Writes ``benchmarks/results/context-parallel.json`` and ``context-parallel.md``.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.ranks import launch, options_or_worker, reset_peak, status_mib, worst

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LAYERS, HIDDEN, HEADS, SEQ, VOCAB, STEPS = 4, 256, 4, 8192, 512, 3
TARGET = 0.65


def build():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
            self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
            self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
            attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(attended.transpose(1, 2).reshape(b, s, HIDDEN))
            return x + self.mlp(self.norm2(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.head = nn.Linear(HIDDEN, VOCAB)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Model()


def worker(variant: str, out: str) -> None:
    """One rank: a first step, then the measured ones; rank 0 writes every rank's numbers."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
    loss_of = torch.nn.functional.cross_entropy
    model = build()
    if variant == "torch":  # the hand-written loop, one rank, the whole sequence
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step() -> float:
            x, y = tokens[:, :-1], tokens[:, 1:]
            loss = loss_of(model(x).reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()

        rank, world = 0, 1
    else:
        import torsh

        cp = int(variant.removeprefix("torsh-cp"))
        config = {"batch": {"micro_batch_size": 1}, "optimizer": {"name": "AdamW", "lr": 1e-3},
                  "parallelism": {"cp": cp}}  # fmt: skip
        engine, *_ = torsh.initialize(model=model, config=config)
        rank, world = dist.get_rank(), dist.get_world_size()

        def step() -> float:
            x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
            with engine.context_parallel(buffers=[x, y], no_restore_buffers={x, y}):
                loss = loss_of(engine(x).reshape(-1, VOCAB), y.reshape(-1))
                engine.backward(loss)
            engine.step()
            return loss.item()

    step()
    before = status_mib("VmRSS")
    reset_peak()
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    mine = {"step_added_mib": status_mib("VmHWM") - before, "step_s": statistics.median(times)}
    gathered = [mine]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))


def measure(variant: str) -> list[dict] | str:
    nproc = 1 if variant == "torch" else int(variant.removeprefix("torsh-cp"))
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        return launch("benchmarks.context_parallel", [variant, out], nproc, out)


def table(results: dict) -> str:
    lines = [f"One training step of {LAYERS} blocks (hidden {HIDDEN}, {HEADS} heads, causal SDPA) on one sequence of "
             f"{SEQ} tokens, fp32; the worst rank. Target: cp 2 adds at most {TARGET} x the one-rank step.", "",
             "| run | ranks | memory one step adds, MiB | / one rank | step time, s | / one rank |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    ref = results.get("torch")
    for variant, ranks in results.items():
        if not isinstance(ranks, list):
            lines.append(f"| {variant} | error: {str(ranks)[-200:]!r} |")
            continue
        mem, sec = worst(ranks, "step_added_mib"), worst(ranks, "step_s")
        ratio = (f"{mem / worst(ref, 'step_added_mib'):.2f} | {sec:.2f} | {sec / worst(ref, 'step_s'):.2f}"
                 if isinstance(ref, list) else f"- | {sec:.2f} | -")  # fmt: skip
        name = "hand-written PyTorch, whole sequence" if variant == "torch" else f"torsh, parallelism.cp {len(ranks)}"
        lines.append(f"| {name} | {len(ranks)} | {mem:.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = options_or_worker("python -m benchmarks.context_parallel", __doc__, worker, argv, variants="torch,torsh-cp2")
    if args is None:
        return 0
    results = {}
    for variant in args.variants.split(","):
        print(f"context parallelism: {variant} ...", flush=True)
        results[variant] = measure(variant)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "context-parallel.json").write_text(json.dumps(results, indent=2) + "\n")
    text = table(results)
    (RESULTS / "context-parallel.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
