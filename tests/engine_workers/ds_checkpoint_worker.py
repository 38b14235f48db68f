"""Real DeepSpeed checkpoints loaded by torsh (run as a script; gloo, CPU; for tests/test_checkpoint_deepspeed.py).

``python ds_checkpoint_worker.py PHASE WORLD_SIZE ROOT``:

* ``main`` (world 2): for each ZeRO stage, real DeepSpeed trains 2 steps, saves ``ROOT/s<stage>``, writes its
  fp32 weights (``ROOT/s<stage>_fp32.pt``, from DeepSpeed's own ``zero_to_fp32``) and trains 2 more steps; then
  torsh (same config) loads each checkpoint and trains the same 2 steps (plus a cross-stage load and a control).
* ``torsh`` (world 1): the torsh half alone, at world size 1 (the one rank takes both ranks' batches).

Each rank writes ``ROOT/<phase>.rank<r>.json``: per case the losses of the 2 steps after the checkpoint (mean
over the global batch) and what the load returned, or the error.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared tiny model and batches

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import _engine_harness as h  # noqa: E402

# checkpoint name -> (ZeRO stage, bf16)
CASES = {"s0": (0, False), "s1": (1, False), "s2": (2, False), "s3": (3, False), "s0_bf16": (0, True),
         "s2_bf16": (2, True), "s2_tied": (2, False)}  # fmt: skip
# torsh loads a case at its own stage, except the tied model: torsh stage 1 (FSDP2 units and tied weights are
# another matter); DeepSpeed saved it at stage 2, with the head's weight recorded as a shared parameter.
TORSH_STAGE = {"s2_tied": 1}


def model(name: str, seed: int):
    built = h.build_model(seed)
    if name.endswith("tied"):
        built.head.weight = built.embed.weight  # as most Hugging Face language models tie lm_head / embeddings
    return built
MICRO = 2  # per rank at world size 2


def config(stage: int, world: int, bf16: bool = False) -> dict:
    return {
        "bf16": {"enabled": bf16},
        "train_micro_batch_size_per_gpu": MICRO * 2 // world,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 6, "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage},
    }  # fmt: skip


def global_batch(step: int, rank: int, world: int):
    """This rank's share of the step's global batch (the same global batch at world size 1 and 2)."""
    parts = [h.batch(step, r, MICRO) for r in range(2)][rank * 2 // world:(rank + 1) * 2 // world]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def train(engine, steps: range, world: int) -> list[float]:
    losses = []
    for step in steps:
        x, y = global_batch(step, dist.get_rank(), world)
        loss = h.lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        total = loss.detach().double()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def deepspeed_runs(root: Path, world: int) -> dict:
    """Real DeepSpeed: train, save, record the fp32 weights and the next two losses, for every stage."""
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = {}
    for name, (stage, bf16) in CASES.items():
        engine, *_ = deepspeed.initialize(model=model(name, 0), config=config(stage, world, bf16))
        train(engine, range(2), world)
        engine.save_checkpoint(str(root / name), client_state={"epoch": 3})
        if dist.get_rank() == 0:
            if stage > 0:
                fp32 = get_fp32_state_dict_from_zero_checkpoint(str(root / name))
            elif bf16:  # the fp32 masters DeepSpeed keeps in its optimizer (the module is bf16)
                saved = torch.load(root / name / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)
                masters = [t for group in saved["optimizer"]["fp32_groups"] for t in group]
                fp32 = {n: t for (n, _), t in zip(engine.module.named_parameters(), masters)}
            else:
                fp32 = {k: v.float() for k, v in engine.module.state_dict().items()}
            torch.save({k: v.detach().clone() for k, v in fp32.items()}, root / f"{name}_fp32.pt")
        out[name] = {"losses": train(engine, range(2, 4), world)}
        engine.destroy()
        dist.barrier()
    return out


def torsh_load(root: Path, world: int, saved: str, stage: int, **load_kwargs) -> dict:
    """torsh at ``stage`` (bf16 like the checkpoint) loads DeepSpeed's checkpoint ``saved`` and trains the next
    two steps. ``weights_diff``: the engine's parameters against DeepSpeed's fp32 weights rounded to their dtype."""
    import torsh

    try:
        engine, *_ = torsh.initialize(model=model(saved, 1), config=config(stage, world, CASES[saved][1]))
        torch.manual_seed(123)
        expected_draw = torch.rand(4)
        torch.manual_seed(123)
        path, client = engine.load_checkpoint(str(root / saved), **load_kwargs)
        rng_untouched = torch.equal(torch.rand(4), expected_draw)  # DeepSpeed does not restore RNG states either
        weights = {k: v.detach() for k, v in h._full_params(engine).items()}
        ref = torch.load(root / f"{saved}_fp32.pt", weights_only=True)
        diff = max(float((w.float() - ref[k].to(w.dtype).float()).abs().max()) for k, w in weights.items())
        rec = {"path": str(path), "client": sorted(client), "epoch": client.get("epoch"), "weights_diff": diff,
               "rng_untouched": rng_untouched,
               "global_steps": engine.global_steps, "global_samples": engine.global_samples, "lr": engine.get_lr()[0],
               "losses": train(engine, range(2, 4), world)}  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - reported per case
        rec = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    dist.barrier()
    return rec


def torsh_runs(root: Path, world: int) -> dict:
    out = {name: torsh_load(root, world, name, TORSH_STAGE.get(name, stage)) for name, (stage, _) in CASES.items()}
    if world == 2:
        out["s1_into_s3"] = torsh_load(root, world, "s1", 3)
        # control: without the optimizer state the second step differs (the loss comparison is sensitive)
        out["s2_weights_only"] = torsh_load(root, world, "s2", 2, load_optimizer_states=False)
    else:
        out["s3_into_s0"] = torsh_load(root, world, "s3", 0)
    return out


def phase_main(root: Path, world: int) -> dict:
    return {"deepspeed": deepspeed_runs(root, world), "torsh": torsh_runs(root, world)}


def phase_torsh(root: Path, world: int) -> dict:
    return {"torsh": torsh_runs(root, world)}


def _worker(rank: int, world: int, phase: str, root: str, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = globals()[f"phase_{phase}"](Path(root), world)
        Path(root, f"{phase}.rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def main() -> None:
    phase, world, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world, phase, root, port), nprocs=world, start_method="fork")


if __name__ == "__main__":
    main()
