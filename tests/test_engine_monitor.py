"""``engine.monitor`` against DeepSpeed's own ``csvMonitor``: the same events give the same files, byte for byte."""

from __future__ import annotations

import types

import pytest

from torsh.config import MonitoringConfig
from torsh.engine.monitor import Monitor

EVENTS = [[("Train/Samples/loss", 1.5, 8), ("eval acc", 0.25, 8)], [("Train/Samples/loss", 1.25, 16)]]


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*.csv"))}


def test_csv_files_are_deepspeeds(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed", reason="DeepSpeed is installed in CI (requirements-dev.txt); it is the reference")
    from deepspeed.monitor import csv_monitor

    monkeypatch.setattr(csv_monitor.dist, "get_rank", lambda: 0)  # rank 0 without starting DeepSpeed's comm
    reference = csv_monitor.csvMonitor(types.SimpleNamespace(enabled=True, output_path=str(tmp_path / "ds"),
                                                             job_name="job"))  # fmt: skip
    ours = Monitor(MonitoringConfig.model_validate({"csv": {"enabled": True, "output_path": str(tmp_path / "torsh"),
                                                            "job_name": "job"}}), rank=0)  # fmt: skip
    for events in EVENTS:
        reference.write_events(events)
        ours.write_events(events)
    assert _files(tmp_path / "torsh") == _files(tmp_path / "ds") != {}


def test_other_ranks_and_disabled_monitors_write_nothing(tmp_path):
    config = MonitoringConfig.model_validate({"csv": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}})
    Monitor(config, rank=1).write_events(EVENTS[0])
    Monitor(MonitoringConfig(), rank=0).write_events(EVENTS[0])
    assert _files(tmp_path) == {}
