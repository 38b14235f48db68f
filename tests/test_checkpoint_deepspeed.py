"""Real DeepSpeed 0.19.8 checkpoints (ZeRO stages 0-3, 2 gloo ranks) load into the torsh engine.

One 2-rank launch has real DeepSpeed train, save each stage's checkpoint and continue two steps, then torsh loads
each checkpoint and continues the same two steps; a 1-rank launch loads them again at world size 1. The weights
must equal DeepSpeed's fp32 weights (as its own ``zero_to_fp32`` reconstructs them) and the continued losses
DeepSpeed's. The files are read safely (a planted payload does not run) and without DeepSpeed installed.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is installed by requirements-dev.txt in CI")

import _engine_harness as h  # noqa: E402

from torsh.engine.checkpoint.save_load import CheckpointError, load_checkpoint  # noqa: E402

WORKER = Path(__file__).resolve().parent / "engine_workers" / "ds_checkpoint_worker.py"
STAGES = (0, 1, 2, 3)
# fp32 at every ZeRO stage; bf16 (masters, bf16_ files); tied embedding / head weights (shared_params)
SAVED = ["s0", "s1", "s2", "s3", "s0_bf16", "s2_bf16", "s2_tied"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ds_ckpt")


@pytest.fixture(scope="module")
def results(root) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    out: dict = {}
    for phase, world in (("main", 2), ("torsh", 1)):
        run = subprocess.run([sys.executable, str(WORKER), phase, str(world), str(root)], capture_output=True,
                             text=True, timeout=600, check=False, env=env)  # fmt: skip
        assert run.returncode == 0, f"{phase} failed:\n{run.stderr[-4000:]}"
        for rank in range(world):
            for side, cases in json.loads((root / f"{phase}.rank{rank}.json").read_text()).items():
                for case, rec in cases.items():
                    out[(side, world, case, rank)] = rec
    return out


def _ok(rec: dict) -> dict:
    assert "error" not in rec, rec.get("traceback")
    return rec


BF16_REL = 2**-8  # one bf16 rounding step: torsh and DeepSpeed round the bf16 forward differently


def _check_load(results, world: int, case: str, saved: str) -> None:
    expected = results[("deepspeed", 2, saved, 0)]["losses"]
    saved_stage = int(saved[1])
    for rank in range(world):
        rec = _ok(results[("torsh", world, case, rank)])
        assert rec["weights_diff"] == 0.0, rec["weights_diff"]  # DeepSpeed's fp32 weights (in the param dtype)
        rel = BF16_REL if saved.endswith("bf16") else 1e-6
        assert rec["losses"] == pytest.approx(expected, rel=rel, abs=0)  # continues as DeepSpeed continues
        assert rec["global_steps"] == 2 and rec["global_samples"] == 8 and rec["epoch"] == 3
        assert rec["rng_untouched"]  # like DeepSpeed, loading leaves the RNG states alone
        assert rec["lr"] == pytest.approx(0.01 / 6)  # WarmupLR after 2 of 6 warm-up steps
        model_file = "mp_rank_00_model_states.pt" if saved_stage < 3 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
        assert rec["path"].endswith(f"{saved}/global_step2/{model_file}")  # DeepSpeed's load_path
        # DeepSpeed's client_state: its own entries removed, the user's and the bookkeeping ones kept
        assert "epoch" in rec["client"] and "ds_config" in rec["client"] and "module" not in rec["client"]
        assert "global_steps" not in rec["client"] and "lr_scheduler" not in rec["client"]


@pytest.mark.slow
@pytest.mark.parametrize("saved", SAVED)
def test_deepspeed_checkpoint_resumes_at_the_same_world_size(results, saved):
    _check_load(results, 2, saved, saved)


@pytest.mark.slow
@pytest.mark.parametrize("saved", SAVED)
def test_deepspeed_checkpoint_resumes_at_world_size_one(results, saved):
    _check_load(results, 1, saved, saved)


@pytest.mark.slow
def test_deepspeed_checkpoint_loads_into_another_stage(results):
    _check_load(results, 2, "s1_into_s3", "s1")
    _check_load(results, 1, "s3_into_s0", "s3")


@pytest.mark.slow
def test_the_optimizer_state_is_what_makes_the_losses_match(results):
    """Control: loading the weights alone gives another second step, so the loss comparison sees the state."""
    rec = _ok(results[("torsh", 2, "s2_weights_only", 0)])
    expected = results[("deepspeed", 2, "s2", 0)]["losses"]
    assert rec["weights_diff"] <= 1e-7 and rec["losses"][1] != pytest.approx(expected[1], rel=1e-5)
    assert "optimizer" in rec["client"]  # DeepSpeed leaves it in client_state when the optimizer is not loaded


# ---- single process: safety and errors on copies of the real checkpoints ---------------------------------


def _job():
    model = h.build_model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    return {"model": model, "optimizer": opt, "lr_scheduler": None, "loss_scaler": None}


def _copy(results, root: Path, stage: int, dest: Path) -> Path:
    assert results  # the checkpoints exist
    shutil.copytree(root / f"s{stage}", dest)
    return dest / "global_step2"


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_loads_in_one_process_without_deepspeed_installed(results, root, tmp_path, monkeypatch, stage):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` fails
    job = _job()
    path, client, engine_state = load_checkpoint(root / f"s{stage}", None, **job)
    ref = torch.load(root / f"s{stage}_fp32.pt", weights_only=True)
    for name, p in job["model"].named_parameters():
        assert torch.equal(p.detach(), ref[name]), name
    assert engine_state == {"global_steps": 2, "global_samples": 8, "skipped_steps": 0, "dp_world_size": 2,
                            "mp_world_size": 1} and client["epoch"] == 3  # the saved sizes, as DeepSpeed records them
    state = job["optimizer"].state_dict()["state"]
    assert len(state) == 13 and float(state[0]["step"]) == 2.0 and state[0]["exp_avg"].abs().sum() > 0


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_payload_in_a_deepspeed_file_does_not_run(results, root, tmp_path, name):
    ckpt, marker = _copy(results, root, 2, tmp_path / "c"), tmp_path / "marker"
    data = torch.load(ckpt / name, weights_only=False)  # our own file, trusted here
    data["ds_version"] = _Payload(marker)
    torch.save(data, ckpt / name)
    with pytest.raises(CheckpointError, match=str(ckpt / name)):
        load_checkpoint(tmp_path / "c", None, **_job())
    assert not marker.exists()
    torch.load(ckpt / name, weights_only=False)
    assert marker.exists()  # the plant is live: an unrestricted load runs it


@pytest.mark.slow
def test_damaged_deepspeed_checkpoints_are_errors_naming_the_file(results, root, tmp_path):
    ckpt = _copy(results, root, 2, tmp_path / "a")
    optim = ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=str(optim)):
        load_checkpoint(tmp_path / "a", None, **_job())
    ckpt = _copy(results, root, 3, tmp_path / "b")
    (ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="written by 2 ranks but has 1 optimizer files"):
        load_checkpoint(tmp_path / "b", None, **_job())
    ckpt = _copy(results, root, 0, tmp_path / "c")
    (ckpt / "mp_rank_00_model_states.pt").write_bytes(pickle.dumps({"module": {}}))
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt"):
        load_checkpoint(tmp_path / "c", None, **_job())
    ckpt = _copy(results, root, 2, tmp_path / "d")  # plain data, but not the structure DeepSpeed writes
    torch.save({"module": {}, "buffer_names": [], "param_shapes": 5}, ckpt / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match=f"{ckpt}.*layout DeepSpeed 0.19.8 writes"):
        load_checkpoint(tmp_path / "d", None, **_job())


@pytest.mark.slow
def test_a_deepspeed_checkpoint_for_another_model_is_an_error(results, root):
    model = torch.nn.Linear(3, 3)
    job = {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "lr_scheduler": None,
           "loss_scaler": None}  # fmt: skip
    for stage in (0, 2):
        with pytest.raises(CheckpointError, match=f"s{stage}"):
            load_checkpoint(root / f"s{stage}", None, **job)
