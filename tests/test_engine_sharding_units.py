"""Which modules become sharding (and checkpointing) units by default."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torsh.config import WrapPolicy  # noqa: E402
from torsh.engine.zero.wrap import wrap_targets  # noqa: E402
from torsh.models import TinyTransformer  # noqa: E402


def test_module_lists_are_looked_through():
    """A ModuleList has no forward: FSDP2 refuses it, so its blocks are the units (HF models keep `layers`)."""
    model = TinyTransformer()
    units = wrap_targets(model, WrapPolicy())
    assert not any(isinstance(u, torch.nn.ModuleList) for u in units)
    assert [type(u).__name__ for u in units] == ["Embedding", "Block", "Block", "LayerNorm", "Linear"]
    by_size = wrap_targets(model, WrapPolicy(min_num_params=1000))
    assert by_size and not any(isinstance(u, torch.nn.ModuleList) for u in by_size)


SYNC_CASES = [(0, 250 * 2**20), (3, 250 * 2**20), (3, 4096)]


@pytest.fixture(scope="module")
def synced_runs() -> list[dict[str, dict]]:
    """Each case of SYNC_CASES as a scenario of one 2-rank launch (the engine harness); per rank ``{name: record}``."""
    import _engine_harness as h

    return h.run([{"name": f"sync-{stage}-{bucket_bytes}", "kind": "synced", "bucket_bytes": bucket_bytes,
                   "config": {"batch": {"micro_batch_size": 2}, "sharding": {"stage": stage},
                              "optimizer": {"name": "AdamW", "lr": 1e-3}}}
                  for stage, bucket_bytes in SYNC_CASES])  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("stage,bucket_bytes", SYNC_CASES)
def test_every_rank_starts_from_rank_0s_weights(synced_runs, stage, bucket_bytes):
    """sync_module_states broadcasts flattened buckets per dtype: every tensor arrives whole, whatever the bucket
    size (4 KiB: a bucket per tensor or two) and the stage."""
    rank0, rank1 = (r[f"sync-{stage}-{bucket_bytes}"] for r in synced_runs)
    assert "error" not in rank0 and "error" not in rank1, rank0.get("traceback") or rank1.get("traceback")
    assert rank0["weights"] == rank1["weights"]
    assert rank0["weights"] == pytest.approx(rank0["rank0_built"], rel=1e-6)  # fp32 compute: the head cast once
