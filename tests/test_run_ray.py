"""``torsh run --on ray``: an unchanged DeepSpeed-style script as a Ray Train job on a local Ray cluster with 2 CPU
workers. Its per-step losses equal those of the same script under ``torsh run`` (torchrun), and the checkpoint it
saves is persisted in Ray's storage, file for file as it was written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.train.torch", reason="ray[train] (requirements-dev.txt; the [ray] extra)")

pytestmark = pytest.mark.slow  # multi-process runs: started first by make test's workers

SCRIPTS = Path(__file__).parent / "dropin_scripts"
SCRIPT = SCRIPTS / "comm_checkpoint_style.py"
TIMEOUT = 300


def _torsh(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    return subprocess.run([sys.executable, "-c", "import sys; from torsh.run import cli; sys.exit(cli())", "run",
                           *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip


@pytest.fixture(scope="module")
def both_runs(tmp_path_factory):
    """The script under torchrun (``torsh run``) and under Ray Train (``torsh run --on ray``), 2 processes each."""
    tmp = tmp_path_factory.mktemp("ray")
    here = _torsh("--nproc-per-node", "2", "--master-port", "29781", str(SCRIPT), "--out", str(tmp / "torchrun.json"),
                  "--ckpt_dir", str(tmp / "ckpt_torchrun"), cwd=tmp)  # fmt: skip
    assert here.returncode == 0, here.stderr[-3000:]
    ray = _torsh("--on", "ray", "--ray-storage", str(tmp / "storage"), "--ray-name", "job", "--nproc-per-node", "2",
                 str(SCRIPT), "--out", str(tmp / "ray.json"), "--ckpt_dir", str(tmp / "ckpt_ray"), cwd=tmp)  # fmt: skip
    assert ray.returncode == 0, (ray.stdout[-3000:], ray.stderr[-3000:])
    return tmp, json.loads((tmp / "torchrun.json").read_text()), json.loads((tmp / "ray.json").read_text())


def test_per_step_losses_equal_the_torchrun_runs(both_runs):
    _, torchrun, ray = both_runs
    assert ray["world"] == torchrun["world"] == 2
    assert ray["losses"] == torchrun["losses"]  # same numbers, bit for bit
    assert ray["after_save"] == torchrun["after_save"] and ray["loaded"]


def test_deepspeed_resolves_to_torsh_in_the_ray_workers(both_runs):
    _, _, ray = both_runs
    assert ray["real_deepspeed_modules"] == 0 and ray["deepspeed_version"].endswith("+torsh")


def test_the_checkpoint_is_in_rays_storage_as_it_was_written(both_runs):
    tmp, _, _ = both_runs
    (local,) = [p for p in (tmp / "ckpt_ray").iterdir() if p.is_dir()]
    stored = tmp / "storage" / "job" / local.name
    assert stored.is_dir()
    assert json.loads((stored / "manifest.json").read_text()) == json.loads((local / "manifest.json").read_text())
    assert sorted(p.name for p in stored.rglob("*")) == sorted(p.name for p in local.rglob("*"))


def _load(rank: int, storage: str, tag: str, out: str) -> None:
    """In a process forked from the test process: a fresh engine loads the checkpoint ``tag`` under ``storage``."""
    sys.path.insert(0, str(SCRIPTS))
    import torsh
    from comm_checkpoint_style import CONFIG, build_model

    model = build_model()
    engine, *_ = torsh.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    path, client = engine.load_checkpoint(storage, tag=tag)
    Path(out).write_text(json.dumps({"path": path, "steps": engine.global_steps}))


def test_the_stored_checkpoint_loads_into_an_engine(both_runs, tmp_path):
    """What Ray persisted is a torsh checkpoint: ``load_checkpoint(<storage>/<run>, tag)`` restores it."""
    import _engine_harness as h

    tmp, _, _ = both_runs
    (local,) = [p for p in (tmp / "ckpt_ray").iterdir() if p.is_dir()]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    h.start(_load, (str(tmp / "storage" / "job"), local.name, str(tmp_path / "loaded.json")), 1)
    loaded = json.loads((tmp_path / "loaded.json").read_text())
    assert loaded["path"] is not None, loaded


def test_a_failing_script_is_exit_1_with_its_error(tmp_path):
    (tmp_path / "boom.py").write_text("raise ValueError('no data at /nowhere')\n")
    done = _torsh("--on", "ray", "--ray-storage", str(tmp_path / "storage"), "--nproc-per-node", "2", "boom.py",
                  cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1
    assert "torsh run --on ray: the Ray Train job failed" in done.stderr and "no data at /nowhere" in done.stderr


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "1:2", "t.py"], "needs a fixed node count"),
    (["--nproc-per-node", "many", "t.py"], "expected a number of processes"),
    (["--nproc-per-node", "2", "missing.py"], "no such training script"),
    (["--no-python", "--nproc-per-node", "2", "t.py"], "Ray Train workers run Python"),
])  # fmt: skip
def test_options_ray_cannot_run_are_exit_2_naming_the_option(args, message, tmp_path, capsys):
    from torsh.run import ray

    (tmp_path / "t.py").write_text("")
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert ray.main(args) == 2
    finally:
        os.chdir(cwd)
    assert message in capsys.readouterr().err


def test_an_unknown_place_is_exit_2(capsys):
    from torsh.run import cli

    assert cli(["run", "--on", "dask", "t.py"]) == 2
    assert "the one place torsh run hands a job to is ray" in capsys.readouterr().err


def test_without_ray_the_error_names_the_extra(monkeypatch):
    from torsh.run import ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ray.RayRunError, match=r"torsh-distributed\[ray\]"):
        ray.run("t.py", num_workers=2)


def test_the_ray_options_come_out_before_torchruns():
    from torsh.run.ray import _ray_options

    ours, rest = _ray_options(["--ray-address", "auto", "--ray-storage=s3://b/p", "--nproc-per-node", "2", "t.py"])
    assert (ours.ray_address, ours.ray_storage, ours.ray_name) == ("auto", "s3://b/p", None)
    assert rest == ["--nproc-per-node", "2", "t.py"]


def test_the_job_size_comes_from_the_flags_else_the_configs_launch_section(tmp_path):
    from torsh.run.ray import _workers, parse

    (tmp_path / "job.toml").write_text("[launch]\nnnodes = 2\nnproc_per_node = 3\nmax_restarts = 4\n")
    config = ["--ray-config", str(tmp_path / "job.toml")]
    ours, args = parse([*config, "t.py"])
    assert (_workers(args)[0], args.max_restarts) == (6, 4)
    ours, args = parse([*config, "--nproc-per-node", "1", "--max-restarts", "0", "t.py"])  # flags win
    assert (_workers(args)[0], args.max_restarts) == (2, 0)
    ours, args = parse(["t.py"])  # torchrun's defaults
    assert (_workers(args)[0], args.max_restarts) == (1, 0)
    (tmp_path / "world.json").write_text('{"launch": {"nnodes": 2, "world_size": 8}}')
    ours, args = parse(["--ray-config", str(tmp_path / "world.json"), "t.py"])
    assert _workers(args)[0] == 8


def test_a_config_that_cannot_be_read_is_exit_2_naming_it(tmp_path, capsys):
    from torsh.run import ray

    assert ray.main(["--ray-config", str(tmp_path / "missing.toml"), "t.py"]) == 2
    assert "--ray-config" in capsys.readouterr().err
