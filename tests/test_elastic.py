"""torchrun restarts: a worker killed mid-run, the group restarted, training resumed from the last checkpoint.

torchrun keeps one TCPStore for the whole job and hands it to every attempt; without a per-attempt namespace
gloo reads the addresses of the killed attempt's processes and the restarted group fails or hangs
(``torsh.engine.distributed.elastic_store``).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from _engine_harness import free_port  # noqa: E402

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "engine_workers" / "elastic_worker.py"
STEPS, KILL_STEP = 5, 2
TIMEOUT_S = 240  # one run takes ~10 s on an idle 2-core machine; a hang fails the test instead of stalling CI


def torchrun(out: Path, *, kill_step: int, stage: int, rdzv: list[str]) -> subprocess.CompletedProcess:
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_", "RANK", "LOCAL_"))}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.2", *rdzv, str(WORKER), str(out), str(STEPS), str(kill_step), str(stage)]
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun did not finish within {TIMEOUT_S} s (a hang):\n{(exc.stderr or b'')[-3000:]!r}")


def weights(out: Path) -> dict:
    return torch.load(out / "weights.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("elastic") / "uninterrupted"
    proc = torchrun(out, kill_step=-1, stage=3, rdzv=[])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "starts.txt").read_text().count("attempt=") == 1
    return weights(out)


RENDEZVOUS = {
    "default": lambda: [],  # one node, no --master-port: torchrun's c10d rendezvous on a free port
    "static": lambda: ["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(free_port())],
}


@pytest.mark.parametrize("rdzv", list(RENDEZVOUS))
def test_killed_worker_restarts_and_finishes_like_an_uninterrupted_run(tmp_path, uninterrupted, rdzv):
    out = tmp_path / "killed"
    proc = torchrun(out, kill_step=KILL_STEP, stage=3, rdzv=RENDEZVOUS[rdzv]())
    starts = (out / "starts.txt").read_text() if (out / "starts.txt").exists() else ""
    assert proc.returncode == 0, f"{starts}\n{proc.stderr[-4000:]}"
    assert "exitcode: -9" in proc.stderr, "the worker did not kill itself: nothing was restarted"
    assert starts.splitlines()[0].startswith("attempt=0 resumed_at=0")
    assert starts.splitlines()[1].startswith(f"attempt=1 resumed_at={KILL_STEP}"), starts
    resumed = weights(out)
    assert resumed.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed[name], tensor), name


def test_each_restart_attempt_has_its_own_store_namespace(monkeypatch):
    """What the killed attempt wrote is invisible to the next one; each attempt sees its own keys."""
    import torch.distributed as dist

    from torsh.engine.distributed import elastic_store

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = elastic_store(2, datetime.timedelta(seconds=5))
    first.set("default_pg/0//cpu/rank_0", "address of a process that died")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = elastic_store(2, datetime.timedelta(seconds=5))
    assert not second.check(["default_pg/0//cpu/rank_0"])
    second.set("default_pg/0//cpu/rank_0", "new")
    assert first.get("default_pg/0//cpu/rank_0") == b"address of a process that died"


def test_outside_torchrun_the_launcher_rendezvous_is_used(monkeypatch):
    from torsh.engine.distributed import elastic_store

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert elastic_store(2) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # rank 0 hosts a new store in every attempt
    assert elastic_store(2) is None
