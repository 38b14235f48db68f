"""The parity runner's own guarantees: a run that hangs ends at its timeout, a stale build lock is named."""

from __future__ import annotations

import sys

import pytest


def test_a_parity_run_that_hangs_is_stopped_at_its_timeout(tmp_path, monkeypatch):
    """A rank that never finishes (here: a worker that sleeps) ends in a ParityRunError after ``timeout``, with the
    whole process group killed, instead of a parity command that never returns."""
    import time

    from torsh import parity

    monkeypatch.setattr(parity, "deepspeed_available", lambda: True)
    real_popen = parity.subprocess.Popen
    monkeypatch.setattr(parity.subprocess, "Popen", lambda command, **kw: real_popen(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(600)"], **kw))
    scenario = parity.Scenario(name="s", config={"train_micro_batch_size_per_gpu": 1}, model="tiny-mlp", steps=1)
    started = time.monotonic()
    with pytest.raises(parity.ParityRunError, match="did not finish within 2 s"):
        parity.run([scenario], "torsh", workdir=tmp_path, timeout=2)
    assert time.monotonic() - started < 30


def test_a_stale_deepspeed_build_lock_is_named_instead_of_waiting_forever(tmp_path, monkeypatch):
    import os

    from torsh import parity

    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (0, 0))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(parity, "deepspeed_available", lambda: True)
    with pytest.raises(parity.ParityRunError, match="deepspeed_shm_comm/lock; delete it"):
        parity.run([], "deepspeed", workdir=tmp_path / "work")


WRITES_THEN_ABORTS = """
import json, os, sys
spec = json.load(open(sys.argv[-1]))
if {write}:
    open(spec["out"], "w").write(json.dumps({{"engine": spec["engine"], "scenarios": {{}}}}))
sys.stderr.write("terminate called without an active exception\\n")
sys.stderr.flush()
os.abort()
"""


@pytest.mark.parametrize(("engine", "write", "counts"), [("deepspeed", True, True), ("deepspeed", False, False),
                                                         ("torsh", True, False)])  # fmt: skip
def test_only_the_reference_may_abort_at_exit_and_only_after_writing_its_records(tmp_path, monkeypatch, engine,
                                                                                 write, counts):  # fmt: skip
    """Real DeepSpeed can abort at interpreter exit after the job finished: its records count when written whole.
    A reference that aborted before writing them, and any torsh run that aborts, is a failed run."""
    from torsh import parity

    monkeypatch.setattr(parity, "deepspeed_available", lambda: True)
    monkeypatch.setattr(parity, "_check_no_stale_build_lock", lambda: None)
    real_popen = parity.subprocess.Popen
    code = WRITES_THEN_ABORTS.format(write=write)
    monkeypatch.setattr(parity.subprocess, "Popen", lambda command, **kw: real_popen(
        [sys.executable, "-c", code, command[-1]], **kw))
    if counts:
        results = parity.run([], engine, workdir=tmp_path)
        assert results["scenarios"] == {} and "after every record was written" in results["exit"]
    else:
        with pytest.raises(parity.ParityRunError, match=f"the {engine} run failed"):
            parity.run([], engine, workdir=tmp_path)
