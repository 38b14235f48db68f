"""torsh-migrate merge: a sharded torsh checkpoint (2 gloo ranks, ZeRO stage 0 and 3, bf16 with fp32 masters)
consolidated into one .safetensors / .pt file equal to the engine's full state dict; a real DeepSpeed checkpoint
(ZeRO-2 bf16, ZeRO-3, stage 0 bf16) into what DeepSpeed's zero_to_fp32 gives; safe and clear on bad input."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

import _engine_harness as h  # noqa: E402

from torsh.cli import main  # noqa: E402

#: name -> engine config (native torsh) of the jobs that write the checkpoints.
JOBS = {
    "s0": h.base_config(),
    "s3": h.base_config(**{"sharding.stage": 3}),
    "bf16_s0": h.base_config(**{"precision.param_dtype": "bf16"}),  # bf16 weights, fp32 masters (saved)
}


def _worker(rank: int, world_size: int, port: int, root: str) -> None:
    """Train each job 2 steps, save a checkpoint, and (rank 0) save the engine's full model state dict."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import torsh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for name, config in JOBS.items():
            engine, *_ = torsh.initialize(model=h.build_model(0), config=config)
            for step in range(2):
                x, y = h.batch(step, rank, engine.train_micro_batch_size_per_gpu())
                engine.backward(h.lm_loss(engine(x), y))
                engine.step()
            engine.save_checkpoint(os.path.join(root, name))
            full = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True,
                                                                                cpu_offload=True))  # fmt: skip
            if rank == 0:
                torch.save(full, os.path.join(root, f"{name}.reference.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("merge")
    h.start(_worker, (2, h.free_port(), str(root)), 2)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("job", JOBS)
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_merge_equals_the_engines_full_state_dict(checkpoints, tmp_path, job, suffix, capsys):
    out = tmp_path / f"model{suffix}"
    assert main(["merge", str(checkpoints / job), "-o", str(out)]) == 0
    assert f"-> {out}" in capsys.readouterr().out
    merged = safetensors_torch.load_file(out) if suffix == ".safetensors" else torch.load(out, weights_only=True)
    reference = torch.load(checkpoints / f"{job}.reference.pt", weights_only=True)
    assert sorted(merged) == sorted(reference) and "gain" in merged  # weights and buffers, module names
    for key, tensor in reference.items():
        if job.startswith("bf16") and key != "gain":
            # The checkpoint holds the fp32 master weights; the module's bf16 weights are them rounded.
            assert tensor.dtype == torch.bfloat16 and merged[key].dtype == torch.float32, key
            assert torch.equal(merged[key].to(torch.bfloat16), tensor), key
        else:
            assert merged[key].dtype == tensor.dtype and torch.equal(merged[key], tensor), key


@pytest.mark.slow
def test_tag_and_tag_directory_select_the_checkpoint(checkpoints, tmp_path):
    root = checkpoints / "s0"
    tag = (root / "latest").read_text()
    assert tag == "global_step2"
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    assert main(["merge", str(root), "--tag", tag, "-o", str(a)]) == 0
    assert main(["merge", str(root / tag), "-o", str(b)]) == 0
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert all(torch.equal(x[k], y[k]) for k in x)


# ---- bad input: one clear error, exit 2, nothing written -----------------------------------------------------


def _single_process_checkpoint(root: Path) -> Path:
    from torsh.engine.checkpoint.save_load import save_checkpoint

    model = h.build_model(0)
    save_checkpoint(root, "global_step1", model=model, optimizer=torch.optim.AdamW(model.parameters()),
                    lr_scheduler=None, loss_scaler=None, engine_state={"global_steps": 1}, client_state={},
                    save_latest=True)  # fmt: skip
    return root


def _error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


def test_output_suffix_existing_file_and_missing_directory(tmp_path, capsys):
    ckpt = _single_process_checkpoint(tmp_path / "ckpt")
    assert "-o: the output must end in one of .safetensors" in _error(capsys, "merge", str(ckpt), "-o",
                                                                       str(tmp_path / "model.txt"))  # fmt: skip
    existing = tmp_path / "model.pt"
    existing.write_text("keep")
    assert "--force" in _error(capsys, "merge", str(ckpt), "-o", str(existing))
    assert existing.read_text() == "keep"
    assert main(["merge", str(ckpt), "-o", str(existing), "--force"]) == 0
    assert "embed.weight" in torch.load(existing, weights_only=True)
    assert "does not exist" in _error(capsys, "merge", str(ckpt), "-o", str(tmp_path / "nowhere" / "m.pt"))


def test_missing_checkpoint_wrong_tag_and_no_latest(tmp_path, capsys):
    ckpt = _single_process_checkpoint(tmp_path / "ckpt")
    out = str(tmp_path / "m.pt")
    assert "no such directory" in _error(capsys, "merge", str(tmp_path / "absent"), "-o", out)
    err = _error(capsys, "merge", str(ckpt), "--tag", "global_step9", "-o", out)
    assert "--tag: " in err and "tags in" in err and "global_step1" in err
    (ckpt / "latest").unlink()
    err = _error(capsys, "merge", str(ckpt), "-o", out)
    assert "no 'latest' file" in err and "global_step1" in err
    assert not Path(out).exists()


# ---- DeepSpeed checkpoints ----------------------------------------------------------------------------------

DS_CASES = ["ds_s2_bf16", "ds_s3", "ds_s0_bf16"]  # ZeRO-2 bf16 (bf16_ files), ZeRO-3, stage 0 with fp32 masters


@pytest.fixture(scope="module")
def deepspeed_checkpoints(tmp_path_factory) -> Path:
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is installed by requirements-dev.txt in CI")
    from engine_workers import merge_ds_worker

    root = tmp_path_factory.mktemp("merge_ds")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # forked ranks (each imports DeepSpeed itself: this process never does)
    h.start(merge_ds_worker._worker, (2, str(root), h.free_port()), 2)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("case", DS_CASES)
def test_a_deepspeed_checkpoint_merges_to_what_zero_to_fp32_gives(deepspeed_checkpoints, tmp_path, case, capsys):
    out = tmp_path / "model.safetensors"
    assert main(["merge", str(deepspeed_checkpoints / case), "-o", str(out)]) == 0
    assert "note:" not in capsys.readouterr().out
    merged = safetensors_torch.load_file(out)
    reference = torch.load(deepspeed_checkpoints / f"{case}.reference.pt", weights_only=True)
    assert sorted(merged) == sorted(reference) and "gain" in merged
    for key, tensor in reference.items():  # fp32 weights (masters for bf16), bit for bit
        assert merged[key].dtype == tensor.dtype and torch.equal(merged[key], tensor), key
    assert reference["embed.weight"].dtype == torch.float32


def test_a_broken_deepspeed_file_is_named(tmp_path, capsys):
    tag = tmp_path / "save" / "global_step1"
    tag.mkdir(parents=True)
    (tmp_path / "save" / "latest").write_text("global_step1")
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"not a checkpoint")
    err = _error(capsys, "merge", str(tmp_path / "save"), "-o", str(tmp_path / "m.pt"))
    assert "mp_rank_00_model_states.pt" in err
    assert not (tmp_path / "m.pt").exists()


def test_a_corrupt_shard_is_refused_by_its_checksum(tmp_path, capsys):
    ckpt = _single_process_checkpoint(tmp_path / "ckpt")
    shard = next((ckpt / "global_step1").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    err = _error(capsys, "merge", str(ckpt), "-o", str(tmp_path / "m.pt"))
    assert "corrupt" in err and shard.name in err


class _Payload:
    """Unpickling this runs code: what a malicious .metadata would do."""

    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_merging_never_unpickles_code(tmp_path, capsys, monkeypatch):
    ckpt = _single_process_checkpoint(tmp_path / "ckpt")
    tag = ckpt / "global_step1"
    (tag / ".metadata").write_bytes(pickle.dumps(_Payload()))
    (tag / "manifest.json").unlink()  # an attacker would rewrite it; without it nothing is verified either
    monkeypatch.chdir(tmp_path)
    err = _error(capsys, "merge", str(ckpt), "-o", str(tmp_path / "m.pt"))
    assert ".metadata" in err and "refused" in err
    assert not (tmp_path / "pwned").exists()
