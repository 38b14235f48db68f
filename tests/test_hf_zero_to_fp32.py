"""``engine.save_checkpoint`` writes ``zero_to_fp32.py`` into the save directory, as DeepSpeed does, and the script
(run the way the transformers documentation says) gives the trained model's full fp32 weights from a ZeRO-3 checkpoint
of 2 ranks: the same tensors as the engine's own gathered weights and as ``torsh-migrate merge``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import _engine_harness as h  # noqa: E402


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    import torch.distributed as dist

    import torsh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = h.build_model(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
        engine, *_ = torsh.initialize(model=model, optimizer=optimizer, config=config)
        for step in range(2):
            x, y = h.batch(step, rank, 2)
            engine.backward(h.lm_loss(engine(x), y))
            engine.step()
        engine.save_checkpoint(os.path.join(out, "ckpt"))
        masters = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
                   for n, p in engine._checkpoint_module().named_parameters()}  # fmt: skip
        if rank == 0:
            torch.save(masters, os.path.join(out, "masters.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_save_checkpoint_writes_a_zero_to_fp32_script_that_merges_our_checkpoint():
    from torsh.engine.checkpoint.merge import merged_weights, resolve

    with tempfile.TemporaryDirectory() as out:
        h.start(_worker, (2, h.free_port(), out), 2)
        save_dir = Path(out, "ckpt")
        script = save_dir / "zero_to_fp32.py"
        assert script.is_file() and os.access(script, os.X_OK)
        assert not [p.name for p in save_dir.iterdir() if p.name.startswith(".")]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        # run from inside the save directory, as the transformers documentation shows
        for args, written in ((["."] + [str(Path(out, "as_dir"))], Path(out, "as_dir", "pytorch_model.bin")),
                              (["."] + [str(Path(out, "st")), "--safe_serialization"], Path(out, "st",
                                                                                          "model.safetensors")),
                              (["."] + [str(Path(out, "file.bin")), "-t", "global_step2"], Path(out, "file.bin"))):
            proc = subprocess.run([sys.executable, str(script), *args], cwd=save_dir, env=env, capture_output=True,
                                  text=True, timeout=300)  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-3000:]
            if written.suffix == ".safetensors":
                from safetensors.torch import load_file

                state = load_file(written)
            else:
                state = torch.load(written, weights_only=True)
            masters = torch.load(Path(out, "masters.pt"), weights_only=True)
            assert set(masters) <= set(state)
            for name, tensor in masters.items():
                assert state[name].dtype == torch.float32 and torch.equal(state[name], tensor), name
        merged, _, _ = merged_weights(resolve(save_dir, None))
        assert merged.keys() == state.keys() and all(torch.equal(merged[k], state[k]) for k in state)
