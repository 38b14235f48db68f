"""A training run that finished exits 0, whatever the script tore down (``torsh.engine.distributed.shutdown``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

from _engine_harness import free_port  # noqa: E402

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "engine_workers" / "exit_worker.py"
TIMEOUT_S = 180  # a run takes ~6 s on an idle 2-core machine; a hang at exit fails the test instead of stalling CI


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_", "RANK", "LOCAL_"))}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    return env


def _run(cmd: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, env=env or _env(), capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{cmd[-4:]} did not exit within {TIMEOUT_S} s:\n{(exc.stderr or b'')[-3000:]!r}")


# stage 3 (FSDP2) as the reported abort, in each way a script ends; stage 0 (a DDP reducer) left alive at exit.
# "async" (a collective never waited for) aborted 4 of 10 runs before shutdown() existed: it runs twice.
CASES = [("async", 3), ("async", 3), ("global", 3), ("destroy", 3), ("global", 0)]


@pytest.mark.parametrize(("teardown", "stage"), CASES, ids=[f"{t}-{s}-{i}" for i, (t, s) in enumerate(CASES)])
def test_finished_job_exits_zero(tmp_path, teardown, stage):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--monitor-interval", "0.2",
           str(WORKER), str(tmp_path), teardown, str(stage)]
    proc = _run(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "terminate called" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done0", "done1"]


SCRIPT = textwrap.dedent("""
    import atexit, sys
    import torch.distributed as dist
    # registered before torsh's handler, so it runs after it (atexit is last in, first out)
    atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
    from torsh.engine.distributed import init_distributed, on_shutdown

    class Engine:
        def destroy(self):
            print("engine destroyed, group still up:", dist.is_initialized(), flush=True)

    init_distributed()
    engine = Engine()
    on_shutdown(engine.destroy)
    on_shutdown(Engine().destroy)  # nobody keeps this one: never called
    sys.exit(0)
""")


def test_exit_destroys_the_process_group_after_the_engines(tmp_path):
    """Engines first (their DDP reducers and FSDP states hold the group), then the process group, while the
    interpreter is whole; a callback whose engine is gone is skipped."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = _run([sys.executable, str(script)], env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["engine destroyed, group still up: True", "initialized at exit: False"]


def test_a_failed_script_leaves_the_group_to_the_launcher(tmp_path):
    """After an uncaught exception a rank may have queued collectives its peers never join; destroying the group
    would wait for them, so it is left as torch leaves it (the exit status is non-zero anyway)."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.replace("sys.exit(0)", "raise RuntimeError('training failed')"))
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = _run([sys.executable, str(script)], env=env, cwd=tmp_path)
    assert proc.returncode == 1 and "training failed" in proc.stderr
    assert proc.stdout.splitlines() == ["engine destroyed, group still up: True", "initialized at exit: True"]


def test_shutdown_is_idempotent_and_safe_without_a_group():
    code = "from torsh.engine.distributed import shutdown; shutdown(); shutdown(); print('ok')"
    proc = _run([sys.executable, "-c", code])
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "ok", "")


ENGINE_SCRIPT = textwrap.dedent("""
    import atexit, sys, torch
    # registered before torsh's handler, so it runs after it (atexit is last in, first out)
    atexit.register(lambda: print("destroyed at exit:", engine._destroyed, flush=True))
    import torsh
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    engine, *_ = torsh.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    print("destroyed before exit:", engine._destroyed, flush=True)
""")


def test_an_engine_releases_its_reducer_at_exit(tmp_path):
    """``torsh.initialize`` registers the engine's ``destroy`` with the exit handler: the DDP reducer is let go
    before the process group is destroyed, without the script calling anything."""
    script = tmp_path / "job.py"
    script.write_text(ENGINE_SCRIPT)
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = _run([sys.executable, str(script)], env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["destroyed before exit: False", "destroyed at exit: True"]


# ---- torsh run: how a worker ends ------------------------------------------------------------------------------------

RUN_HELPER = """
LOG = open("helper.log", "w")  # a module-level file nobody closes
"""

RUN_SCRIPT = """
import atexit, sys, threading, time
import torch.distributed as dist
import helper

dist.init_process_group("gloo")
rank = dist.get_rank()
helper.LOG.write(f"rank {rank} wrote this without closing the file\\n")

def late():
    time.sleep(0.5)
    with open(f"thread{rank}.txt", "w") as f:
        f.write("a non-daemon thread finished its work")

threading.Thread(target=late).start()
atexit.register(lambda: open(f"atexit{rank}.txt", "w").write("atexit ran"))
if len(sys.argv) > 1:
    sys.exit(int(sys.argv[1]))
"""


def _torsh_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "helper.py").write_text(RUN_HELPER)
    (tmp_path / "job.py").write_text(RUN_SCRIPT)
    return _run([sys.executable, "-m", "torsh.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                 "job.py", *args], cwd=tmp_path)  # fmt: skip


def test_a_torsh_run_worker_ends_as_python_would_without_losing_data(tmp_path):
    """The worker leaves without the C++ teardown after Python's exit (where a finished job could abort), but
    only after what Python's exit does: non-daemon threads finish, atexit handlers run, open files are flushed."""
    done = _torsh_run(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"thread{rank}.txt").read_text() == "a non-daemon thread finished its work"
        assert (tmp_path / f"atexit{rank}.txt").read_text() == "atexit ran"
    assert "without closing the file" in (tmp_path / "helper.log").read_text()


def test_a_torsh_run_worker_keeps_the_scripts_exit_status(tmp_path):
    done = _torsh_run(tmp_path, "3")
    assert done.returncode != 0
    assert "exitcode  : 3" in done.stderr, done.stderr[-3000:]
