"""``torsh-migrate parity`` says what it is doing from its first second: a status line on stderr before any
worker starts, and a line per scenario as it starts (the launch is mocked: no process is started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torsh import parity
from torsh.cli import main

CONFIG = Path(__file__).resolve().parents[1] / "migration_examples" / "deepspeed" / "train_config.json"


class _Stop(Exception):
    pass


def test_status_line_comes_before_any_worker_starts(monkeypatch, capsys):
    if not parity.deepspeed_available():
        pytest.skip("parity needs DeepSpeed as its reference; it is not installed")
    seen: list[str] = []

    def fake_run(scenarios, engine, *, nproc, workdir, on_progress=None, **_):
        seen.append(capsys.readouterr().err)  # what the user saw before this launch
        for scenario in scenarios:
            on_progress(scenario.name, 0, scenario.steps)
            on_progress(scenario.name, scenario.steps, scenario.steps)
        raise parity.ParityRunError("stopped by the test")

    monkeypatch.setattr(parity, "run", fake_run)
    assert main(["parity", str(CONFIG), "--steps", "3"]) == 2
    first = seen[0].splitlines()
    assert first and first[0].startswith("parity: training tiny-mlp for 3 steps on 2 ranks under DeepSpeed")
    assert "starting DeepSpeed workers" in first[0]
    rest = capsys.readouterr().err
    assert "parity: running scenario 'reference' (3 steps)" in rest
    assert "stopped by the test" in rest
