"""Real DeepSpeed checkpoints for tests/test_cli_merge.py (run as a script; 2 gloo ranks, CPU).

``python merge_ds_worker.py ROOT``: for each case DeepSpeed trains 2 steps on the tiny model and saves
``ROOT/<case>``; rank 0 then writes DeepSpeed's own consolidation to ``ROOT/<case>.reference.pt``: for ZeRO,
``zero_to_fp32``'s ``get_fp32_state_dict_from_zero_checkpoint``; for stage 0 (which it does not handle) the fp32
masters DeepSpeed's optimizer holds, in the module's parameter order, and the module's buffers.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared tiny model and batches

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import _engine_harness as h  # noqa: E402

#: case -> (ZeRO stage, bf16)
CASES = {"ds_s2_bf16": (2, True), "ds_s3": (3, False), "ds_s0_bf16": (0, True)}


def config(stage: int, bf16: bool) -> dict:
    return {"bf16": {"enabled": bf16}, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}  # fmt: skip


def save_all(root: Path) -> None:
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    rank = dist.get_rank()
    for name, (stage, bf16) in CASES.items():
        engine, *_ = deepspeed.initialize(model=h.build_model(0), config=config(stage, bf16))
        for step in range(2):
            x, y = h.batch(step, rank, 2)
            engine.backward(h.lm_loss(engine(x), y))
            engine.step()
        engine.save_checkpoint(str(root / name))
        dist.barrier()
        if rank == 0:
            if stage > 0:
                reference = get_fp32_state_dict_from_zero_checkpoint(str(root / name))
            else:
                masters = [t for group in engine.optimizer.fp32_groups for t in group]
                reference = {k: v for k, v in engine.module.state_dict().items()}
                reference.update({n: m for (n, _), m in zip(engine.module.named_parameters(), masters)})
            torch.save({k: v.detach().clone() for k, v in reference.items()}, root / f"{name}.reference.pt")
        engine.destroy()
        dist.barrier()


def _worker(rank: int, world: int, root: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        save_all(Path(root))
    finally:
        dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(2, sys.argv[1], port), nprocs=2, start_method="fork")


if __name__ == "__main__":
    main()
