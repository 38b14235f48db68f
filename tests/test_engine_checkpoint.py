"""Checkpoints: DeepSpeed's layout, DCP contents, resharding across world sizes, atomic saves."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torsh.config import LossScalingConfig, TorshConfig  # noqa: E402
from torsh.engine.checkpoint.save_load import load_checkpoint, save_checkpoint  # noqa: E402
from torsh.engine.loss_scaler import build_loss_scaler  # noqa: E402
from torsh.engine.schedulers import build_scheduler  # noqa: E402

WORKERS = Path(__file__).resolve().parent / "engine_workers"


# ---- single process (no process group) ----------------------------------------------------------------


def _job(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    section = {"name": "WarmupLR", "warmup_num_steps": 4, "warmup_type": "linear"}
    sched = build_scheduler(TorshConfig.from_dict({"scheduler": section}).scheduler, opt)
    scaler = build_loss_scaler(LossScalingConfig(mode="dynamic", semantics="deepspeed_zero"))
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
        scaler.update(True)
        opt.zero_grad()
    return {"model": model, "optimizer": opt, "lr_scheduler": sched, "loss_scaler": scaler}


def _save(root, job, tag="global_step2", client_state=None, save_latest=True):
    return save_checkpoint(root, tag, **job, engine_state={"global_steps": 2, "global_samples": 16},
                           client_state=client_state or {"epoch": 1}, save_latest=save_latest)  # fmt: skip


def test_layout_follows_deepspeed_convention(tmp_path):
    assert _save(tmp_path, _job(), tag=None) is True
    assert (tmp_path / "latest").read_text() == "global_step2"  # DeepSpeed's default tag
    ckpt = tmp_path / "global_step2"
    assert (ckpt / ".metadata").is_file() and (ckpt / "engine_states.pt").is_file()
    assert (ckpt / "rng_states" / "rank0.pt").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_round_trip_restores_everything(tmp_path):
    job = _job(0)
    _save(tmp_path, job, client_state={"epoch": 4, "best": torch.tensor([0.5])})
    after_save = torch.rand(3)
    fresh = _job(1)
    path, client, engine = load_checkpoint(tmp_path, None, **fresh, load_rng_states=True)
    assert path == str(tmp_path / "global_step2")
    assert client["epoch"] == 4 and torch.equal(client["best"], torch.tensor([0.5]))
    assert engine == {"global_steps": 2, "global_samples": 16}
    for a, b in zip(job["model"].parameters(), fresh["model"].parameters()):
        assert torch.equal(a, b)
    state_a, state_b = job["optimizer"].state_dict(), fresh["optimizer"].state_dict()
    for key in state_a["state"]:
        assert torch.equal(state_a["state"][key]["exp_avg_sq"], state_b["state"][key]["exp_avg_sq"])
    assert state_b["param_groups"][0]["lr"] == pytest.approx(0.025)
    assert fresh["lr_scheduler"].state_dict() == {"last_batch_iteration": 1}
    assert fresh["loss_scaler"].state_dict() == job["loss_scaler"].state_dict()
    assert torch.equal(torch.rand(3), after_save)  # RNG restored to the moment of the save (opt-in)


def test_rng_is_not_restored_by_default_as_in_deepspeed(tmp_path):
    _save(tmp_path, _job(0))
    fresh = _job(1)
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    assert load_checkpoint(tmp_path, None, **fresh)[0]
    assert torch.equal(torch.rand(3), expected)  # the load left the RNG where it was


def test_no_checkpoint_at_all_returns_nones_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="torsh.engine.checkpoint.save_load"):
        assert load_checkpoint(tmp_path / "absent", None, **_job()) == (None, None, None)
        assert load_checkpoint(tmp_path, None, **_job()) == (None, None, None)
    assert "latest" in caplog.text


def test_load_module_only_leaves_optimizer_and_counters(tmp_path):
    _save(tmp_path, _job(0))
    fresh = _job(1)
    before = {k: v.clone() for k, v in fresh["optimizer"].state_dict()["state"][0].items()}
    path, client, engine = load_checkpoint(tmp_path, "global_step2", **fresh, load_module_only=True)
    assert path and client == {"epoch": 1} and engine is None
    assert torch.equal(fresh["optimizer"].state_dict()["state"][0]["exp_avg"], before["exp_avg"])
    assert torch.equal(fresh["model"][0].weight, _job(0)["model"][0].weight)


def test_client_state_must_load_safely_and_a_failed_save_publishes_nothing(tmp_path):
    job = _job()
    _save(tmp_path, job, tag="good")

    class Opaque:
        pass

    with pytest.raises(TypeError, match="weights_only"):
        _save(tmp_path, job, tag="bad", client_state={"obj": Opaque()})
    assert (tmp_path / "latest").read_text() == "good" and not (tmp_path / "bad").exists()
    _save(tmp_path, job, tag="next")  # the next save tidies the failed one's staging directory
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_tags_must_be_plain_names(tmp_path):
    with pytest.raises(ValueError, match="plain directory name"):
        _save(tmp_path, _job(), tag="../escape")


def test_save_latest_false_keeps_latest(tmp_path):
    job = _job()
    _save(tmp_path, job, tag="first")
    _save(tmp_path, job, tag="second", save_latest=False)
    assert (tmp_path / "latest").read_text() == "first" and (tmp_path / "second" / ".metadata").is_file()


# ---- killed mid-save -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    out = subprocess.run([sys.executable, str(WORKERS / "atomic_worker.py"), str(tmp_path)], capture_output=True,
                         text=True, timeout=300, check=False,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(results) == {"in_dcp_before_metadata", "after_model_before_engine_states", "before_publish",
                            "resave_same_tag_between_renames"}  # fmt: skip
    failures = {k: v for k, v in results.items() if v != "ok"}
    assert not failures, "\n".join(f"{k}:\n{v}" for k, v in failures.items())


# ---- 2 ranks on gloo: one launch per world size, shared by all cases -----------------------------------


@pytest.fixture(scope="module")
def multiprocess_results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ckpt")
    results = {}
    for phase, world in (("save1", 1), ("main2", 2), ("load1", 1)):
        out = subprocess.run([sys.executable, str(WORKERS / "checkpoint_worker.py"), phase, str(world), str(workdir)],
                             capture_output=True, text=True, timeout=600, check=False,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        assert out.returncode == 0, f"{phase} failed:\n{out.stderr[-4000:]}"
        for rank in range(world):
            for case, verdict in json.loads((workdir / f"{phase}.rank{rank}.json").read_text()).items():
                results[(case, rank)] = verdict
    return results


def _check(results, case, ranks):
    for rank in ranks:
        verdict = results.get((case, rank), "case did not run")
        assert verdict == "ok", f"rank {rank}:\n{verdict}"


KINDS = ["ddp", "fsdp", "zero"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_two_rank_round_trip_and_resume(multiprocess_results, kind):
    """Save at step 2 with 2 ranks, load into a fresh job: same params, optimizer state, scheduler, scaler,
    counters and client state, and the next two steps match the uninterrupted job bit for bit."""
    _check(multiprocess_results, f"roundtrip_{kind}", (0, 1))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_two_rank_checkpoint_loads_at_world_size_one(multiprocess_results, kind):
    _check(multiprocess_results, f"from_w2_{kind}", (0,))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_one_rank_checkpoint_loads_at_world_size_two(multiprocess_results, kind):
    _check(multiprocess_results, f"from_w1_{kind}", (0, 1))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["cross_fsdp_ckpt_into_ddp", "cross_zero_ckpt_into_fsdp"])
def test_checkpoints_move_between_sharding_strategies(multiprocess_results, case):
    _check(multiprocess_results, case, (0,))


@pytest.mark.slow
def test_missing_checkpoint_on_two_ranks(multiprocess_results):
    _check(multiprocess_results, "missing", (0, 1))


@pytest.mark.slow
def test_a_corrupt_checkpoint_raises_on_every_rank(multiprocess_results):
    _check(multiprocess_results, "corrupt", (0, 1))


@pytest.mark.slow
def test_ranks_saving_under_different_tags_all_raise(multiprocess_results):
    _check(multiprocess_results, "tag_mismatch", (0, 1))


def test_rng_states_round_trip_through_a_safe_load(tmp_path):
    from torsh.engine.checkpoint.save_load import _rng_state, _set_rng_state, _torch_bytes

    np = pytest.importorskip("numpy", reason="numpy's RNG is saved only when numpy is installed")
    (tmp_path / "rng.pt").write_bytes(_torch_bytes(_rng_state(), "RNG state"))
    expected = (random.random(), torch.rand(2).tolist(), np.random.rand(2).tolist())
    _set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), torch.rand(2).tolist(), np.random.rand(2).tolist()) == expected
