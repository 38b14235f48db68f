"""A tiny torsh training job for ``torchrun --max-restarts``: checkpoint every step, resume from the latest.

``torchrun --nproc-per-node 2 --max-restarts 1 elastic_worker.py OUT STEPS KILL_STEP STAGE``

Every step is followed by ``engine.save_checkpoint(OUT/ckpt)``; at start the job loads the latest checkpoint and
continues from its step. On the first attempt (``TORCHELASTIC_RESTART_COUNT=0``) rank 1 SIGKILLs itself right
after the checkpoint of step ``KILL_STEP`` (``-1``: never), so torchrun restarts the group. Rank 0 writes the final
full weights to ``OUT/weights.pt`` and one line per start to ``OUT/starts.txt``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

import torsh

DIM = 8


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch for (step, rank) in every attempt: a resumed run sees the data the uninterrupted one saw."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, DIM, generator=g), torch.randn(4, 1, generator=g)


def full_state(engine) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def main() -> None:
    out, steps, kill_step, stage = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}}  # fmt: skip
    engine, *_ = torsh.initialize(model=model, model_parameters=model.parameters(), config=config)
    ckpt = out / "ckpt"
    path, _ = engine.load_checkpoint(ckpt) if (ckpt / "latest").exists() else (None, None)
    if engine.global_rank == 0:
        with open(out / "starts.txt", "a") as f:
            f.write(f"attempt={attempt} resumed_at={engine.global_steps} path={path}\n")
    while engine.global_steps < steps:
        x, y = data(engine.global_steps, engine.global_rank)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(ckpt)
        if attempt == 0 and engine.global_rank == 1 and engine.global_steps == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
    weights = full_state(engine)
    if engine.global_rank == 0:
        torch.save(weights, out / "weights.pt")


if __name__ == "__main__":
    main()
