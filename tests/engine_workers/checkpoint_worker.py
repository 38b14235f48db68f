"""Multi-process checkpoint scenarios for tests/test_engine_checkpoint.py (run as a script; gloo, CPU).

``python checkpoint_worker.py PHASE WORLD_SIZE WORKDIR``. Each rank writes ``WORKDIR/PHASE.rank<r>.json``:
a mapping case -> "ok" or the failure text. Phases, in order: ``save1`` (world 1: train and save one checkpoint
per wrapping), ``main2`` (world 2: save/load round trips, resume equality, load the world-1 checkpoints, save
world-2 checkpoints), ``load1`` (world 1: load the world-2 checkpoints).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torsh.config import LossScalingConfig, TorshConfig
from torsh.engine.checkpoint.save_load import load_checkpoint, save_checkpoint
from torsh.engine.loss_scaler import build_loss_scaler
from torsh.engine.schedulers import build_scheduler

KINDS = ("ddp", "fsdp", "zero")
TAG = "global_step2"


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3))


def build(kind: str, seed: int):
    """Model, optimizer, scheduler and loss scaler, wrapped as the engine would for ``kind``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    model = _model()
    if kind == "fsdp":
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    elif kind == "zero":
        model = DDP(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    else:
        model = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    section = {"name": "WarmupLR", "warmup_num_steps": 5, "warmup_type": "linear"}
    sched = build_scheduler(TorshConfig.from_dict({"scheduler": section}).scheduler, opt)
    scaler = build_loss_scaler(LossScalingConfig(mode="dynamic", growth_interval=2,
                                                 semantics="deepspeed_zero"))  # fmt: skip
    return model, opt, sched, scaler


def train(model, opt, sched, scaler, steps: range) -> None:
    for step in steps:
        # The global batch is the same at any world size: rank r takes rows r::W of a fixed batch.
        gen = torch.Generator().manual_seed(100 + step)
        batch = torch.randn(8, 8, generator=gen)
        rows = batch[dist.get_rank()::dist.get_world_size()]
        loss = model(rows).pow(2).sum() / 8
        loss.backward()
        opt.step()
        sched.step()
        scaler.update(step == 0)
        opt.zero_grad()


def full_states(model, opt) -> dict:
    """Unsharded parameters and optimizer state keyed by parameter name (same on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from torsh.engine.checkpoint.save_load import _param_names, _zero_state_dict

    full = StateDictOptions(full_state_dict=True)
    if isinstance(opt, ZeroRedundancyOptimizer):
        msd = get_model_state_dict(model, options=full)
        shards = [None] * dist.get_world_size()
        dist.all_gather_object(shards, _zero_state_dict(opt, _param_names(model))["state"])
        state = {name: s for shard in shards for name, s in shard.items()}
        lrs = [g["lr"] for g in opt.param_groups]
    else:
        msd, osd = get_state_dict(model, opt, options=full)
        state, lrs = osd["state"], [g["lr"] for g in osd["param_groups"]]
    return {"model": {k: v.detach().clone() for k, v in msd.items()},
            "optim": {n: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for n, s in state.items()},
            "lr": lrs}  # fmt: skip


def assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys(), (sorted(a["model"]), sorted(b["model"]))
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"param {k} differs"
    assert a["optim"].keys() == b["optim"].keys(), (sorted(a["optim"]), sorted(b["optim"]))
    for name in a["optim"]:
        for k, v in a["optim"][name].items():
            w = b["optim"][name][k]
            same = torch.equal(v.float(), w.float()) if torch.is_tensor(v) else v == w
            assert same, f"optimizer state {name}.{k} differs"
    assert a["lr"] == b["lr"], (a["lr"], b["lr"])


def _save(kind, workdir: Path, prefix: str, model, opt, sched, scaler) -> None:
    save_checkpoint(workdir / f"{prefix}_{kind}", TAG, model=model, optimizer=opt, lr_scheduler=sched,
                    loss_scaler=scaler, engine_state={"global_steps": 2, "skipped_steps": 1},
                    client_state={"epoch": 3, "tensor": torch.arange(3)}, save_latest=True)  # fmt: skip
    ref = full_states(model, opt)
    if dist.get_rank() == 0:
        torch.save(ref, workdir / f"{prefix}_{kind}_ref.pt")


def _load_and_compare(kind, workdir: Path, prefix: str) -> None:
    model, opt, sched, scaler = build(kind, seed=1)
    path, client, engine = load_checkpoint(workdir / f"{prefix}_{kind}", None, model=model, optimizer=opt,
                                           lr_scheduler=sched, loss_scaler=scaler)  # fmt: skip
    assert path is not None and path.endswith(TAG), path
    assert client["epoch"] == 3 and torch.equal(client["tensor"], torch.arange(3)), client
    assert engine == {"global_steps": 2, "skipped_steps": 1}, engine
    assert sched.state_dict() == {"last_batch_iteration": 1}
    assert scaler.cur_hysteresis == 1 and scaler.cur_iter == 2, scaler.state_dict()
    assert_same(torch.load(workdir / f"{prefix}_{kind}_ref.pt", weights_only=True), full_states(model, opt))


def phase_save1(workdir: Path) -> dict:
    results = {}
    for kind in KINDS:
        model, opt, sched, scaler = build(kind, seed=0)
        train(model, opt, sched, scaler, range(2))
        results[f"save_{kind}"] = _run(_save, kind, workdir, "w1", model, opt, sched, scaler)
    return results


def phase_main2(workdir: Path) -> dict:
    results = {}
    for kind in KINDS:
        results[f"roundtrip_{kind}"] = _run(_roundtrip, kind, workdir)
        results[f"from_w1_{kind}"] = _run(_load_and_compare, kind, workdir, "w1")
    results["missing"] = _run(_missing, workdir)
    results["corrupt"] = _run(_corrupt, workdir)
    results["tag_mismatch"] = _run(_tag_mismatch, workdir)
    return results


def phase_load1(workdir: Path) -> dict:
    results = {f"from_w2_{kind}": _run(_load_and_compare, kind, workdir, "w2") for kind in KINDS}
    results["cross_fsdp_ckpt_into_ddp"] = _run(_cross, "fsdp", "ddp", workdir)
    results["cross_zero_ckpt_into_fsdp"] = _run(_cross, "zero", "fsdp", workdir)
    return results


def _roundtrip(kind, workdir: Path) -> None:
    """Save at step 2, load into a fresh job, and check both the state and the next training step agree."""
    model, opt, sched, scaler = build(kind, seed=0)
    train(model, opt, sched, scaler, range(2))
    _save(kind, workdir, "w2", model, opt, sched, scaler)
    _load_and_compare(kind, workdir, "w2")
    resumed = build(kind, seed=1)
    load_checkpoint(workdir / f"w2_{kind}", TAG, model=resumed[0], optimizer=resumed[1], lr_scheduler=resumed[2],
                    loss_scaler=resumed[3])  # fmt: skip
    train(model, opt, sched, scaler, range(2, 4))
    train(*resumed, range(2, 4))
    assert_same(full_states(model, opt), full_states(resumed[0], resumed[1]))


def _cross(saved_kind, load_kind, workdir: Path) -> None:
    model, opt, sched, scaler = build(load_kind, seed=1)
    load_checkpoint(workdir / f"w2_{saved_kind}", TAG, model=model, optimizer=opt, lr_scheduler=sched,
                    loss_scaler=scaler)  # fmt: skip
    assert_same(torch.load(workdir / f"w2_{saved_kind}_ref.pt", weights_only=True), full_states(model, opt))


def _missing(workdir: Path) -> None:
    model, opt, sched, scaler = build("ddp", seed=0)
    got = load_checkpoint(workdir / "nothing_here", None, model=model, optimizer=opt, lr_scheduler=sched,
                          loss_scaler=scaler)  # fmt: skip
    assert got == (None, None, None), got


def _expect_error_on_every_rank(root: Path, needle: str, **kwargs) -> None:
    from torsh.engine.checkpoint.save_load import CheckpointError

    model, opt, sched, scaler = build("ddp", seed=1)
    try:
        load_checkpoint(root, None, model=model, optimizer=opt, lr_scheduler=sched, loss_scaler=scaler, **kwargs)
    except CheckpointError as exc:
        assert needle in str(exc), exc
    else:
        raise AssertionError(f"loading {root} did not raise (expected an error naming {needle})")


def _corrupt(workdir: Path) -> None:
    """Damage seen by one rank only still makes every rank raise CheckpointError (none waits forever)."""
    import shutil

    root = workdir / "corrupt"
    if dist.get_rank() == 0:
        shutil.copytree(workdir / "w2_ddp", root)
    dist.barrier()
    shard = root / TAG / "__1_0.distcp"
    if dist.get_rank() == 0:  # a flipped byte in the shard of rank 1 (verified by another rank's share)
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    _expect_error_on_every_rank(root, str(shard))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root)
        shutil.copytree(workdir / "w2_ddp", root)
        (root / TAG / "rng_states" / "rank1.pt").write_bytes(b"not a torch file")  # read by rank 1 alone
        from torsh.engine.checkpoint import io as checkpoint_io

        shares = [checkpoint_io.hash_share(root / TAG, 0, 1)]
        (root / TAG / "manifest.json").write_bytes(checkpoint_io.write_manifest(root / TAG, shares))
    dist.barrier()
    _expect_error_on_every_rank(root, "rank1.pt", load_rng_states=True)
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest").write_text("global_step7")
    dist.barrier()
    _expect_error_on_every_rank(root, "does not exist")


def _tag_mismatch(workdir: Path) -> None:
    model, opt, sched, scaler = build("ddp", seed=0)
    try:
        save_checkpoint(workdir / "mismatch", f"rank{dist.get_rank()}", model=model, optimizer=opt,
                        lr_scheduler=sched, loss_scaler=scaler, engine_state={}, client_state={},
                        save_latest=True)  # fmt: skip
    except ValueError as exc:
        assert "different checkpoint tags" in str(exc), exc
    else:
        raise AssertionError("saving under different tags on different ranks did not raise")


def _run(fn, *args) -> str:
    try:
        fn(*args)
        return "ok"
    except Exception:  # noqa: BLE001 - reported to the test
        return traceback.format_exc()


def _worker(rank: int, world: int, phase: str, workdir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = globals()[f"phase_{phase}"](Path(workdir))
        Path(workdir, f"{phase}.rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def main() -> None:
    phase, world, workdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world, phase, workdir, port), nprocs=world, start_method="fork")


if __name__ == "__main__":
    main()
