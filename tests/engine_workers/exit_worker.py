"""A stage-3 torsh training job that ends without tearing anything down (or with a partial teardown).

``torchrun --nproc-per-node 2 exit_worker.py OUT TEARDOWN [STAGE]``: trains a few steps from a DeepSpeed config
``{"zero_optimization": {"stage": STAGE}}`` (default 3), writes ``OUT/done<rank>``, then returns from ``main``
with TEARDOWN:

- ``none``: nothing torn down; engines, hooks and the process group are left for interpreter exit;
- ``global``: as ``none``, and the engine, optimizer and dataloader stay referenced from a module global (a script
  written at top level) until interpreter finalisation;
- ``async``: a last metric all-reduce issued with ``async_op=True`` and never waited for (fire and forget), so
  that gloo's worker thread holds the last reference to a Python tensor when the script returns;
- ``destroy``: the script calls ``torch.distributed.destroy_process_group()`` itself (the engine still alive);
- ``barrier``: a last ``torch.distributed.barrier()``, nothing destroyed.

The process must exit 0 in every case.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import torsh

DIM = 16
KEEP: list = []


def main() -> None:
    out, teardown = Path(sys.argv[1]), sys.argv[2]
    stage = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0}  # fmt: skip
    dataset = torch.utils.data.TensorDataset(torch.randn(64, DIM), torch.randn(64, 1))
    engine, _, loader, _ = torsh.initialize(model=model, model_parameters=model.parameters(), config=config,
                                            training_data=dataset)  # fmt: skip
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    (out / f"done{engine.global_rank}").write_text(f"{loss.item():.6f}\n")
    if teardown == "global":
        KEEP.extend([engine, loader, model, loss])
    elif teardown == "async":
        dist.all_reduce(torch.full((1 << 16,), loss.item()), async_op=True)
    elif teardown == "destroy":
        dist.destroy_process_group()
    elif teardown == "barrier":
        dist.barrier()


if __name__ == "__main__":
    main()
