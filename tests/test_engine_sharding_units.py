"""Which modules become sharding (and checkpointing) units by default."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torsh.config import WrapPolicy  # noqa: E402
from torsh.engine.sharding import wrap_targets  # noqa: E402
from torsh.models import TinyTransformer  # noqa: E402


def test_module_lists_are_looked_through():
    """A ModuleList has no forward: FSDP2 refuses it, so its blocks are the units (HF models keep `layers`)."""
    model = TinyTransformer()
    units = wrap_targets(model, WrapPolicy())
    assert not any(isinstance(u, torch.nn.ModuleList) for u in units)
    assert [type(u).__name__ for u in units] == ["Embedding", "Block", "Block", "LayerNorm", "Linear"]
    by_size = wrap_targets(model, WrapPolicy(min_num_params=1000))
    assert by_size and not any(isinstance(u, torch.nn.ModuleList) for u in by_size)
