"""``Engine.save_checkpoint`` / ``load_checkpoint`` with DeepSpeed's signatures: resume gives the same losses."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

import _engine_harness as h  # noqa: E402

pytestmark = pytest.mark.slow

CONFIGS = {
    "s0": h.base_config(),
    "s1": h.base_config(**{"sharding.stage": 1}),
    "s3": h.base_config(**{"sharding.stage": 3}),
    "bf16_s0": h.base_config(**{"precision.param_dtype": "bf16"}),  # fp32 master weights are what is saved
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def runs(root):
    scenarios = [{"name": n, "kind": "checkpoint", "config": c, "dir": str(root / n)} for n, c in CONFIGS.items()]
    return h.run(scenarios)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_repeats_the_uninterrupted_losses(runs, name):
    for rank in (0, 1):
        rec = runs[rank][name]
        assert "error" not in rec, rec.get("traceback")
        assert rec["resumed"] == pytest.approx(rec["uninterrupted"], rel=1e-6)
        assert rec["missing"] == [None, None]
        assert rec["path"].endswith("global_step2") or "global_step2" in rec["path"]
        assert rec["epoch"] == 3 and rec["global_steps"] == 4


RESHARD = {"s3_to_s0": ("s3", 0), "s0_to_s3": ("s0", 3)}


@pytest.fixture(scope="module")
def one_rank(runs, root):
    """Each 2-rank checkpoint loaded by 1 rank at another stage (one launch for all)."""
    scenarios = [{"name": n, "kind": "load_only", "config": h.base_config(**{"sharding.stage": stage}),
                  "dir": str(root / source)} for n, (source, stage) in RESHARD.items()]  # fmt: skip
    (result,) = h.run(scenarios, world_size=1)
    return result


@pytest.mark.parametrize("name", list(RESHARD))
def test_resume_at_another_world_size(runs, one_rank, name):
    """A 2-rank checkpoint loads into 1 rank, also across stages (DeepSpeed refuses both)."""
    rec = one_rank[name]
    assert "error" not in rec, rec.get("traceback")
    assert rec["checksum"] == pytest.approx(runs[0][RESHARD[name][0]]["checksum"], rel=1e-9)
    assert rec["epoch"] == 3 and rec["global_steps"] == 3 and rec["applied"]
