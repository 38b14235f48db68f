"""``deepspeed.module_inject.tp_shard`` of the drop-in: DeepSpeed 0.19.8's share-out of a dimension over a
tensor- or sequence-parallel group (what DeepSpeed's Ulysses tests use to find a rank's heads)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from torsh.compat.deepspeed.module_inject import tp_shard  # noqa: E402


@pytest.fixture(autouse=True)
def _defaults():
    yield
    tp_shard.set_num_kv_heads(None)
    tp_shard.set_tp_grain_size(1)


def test_even_share_gives_the_first_ranks_one_more():
    assert tp_shard.get_shard_size_list(7, 4) == [2, 2, 2, 1]
    assert tp_shard.get_shard_size_list(3, 2) == [2, 1]
    assert [tp_shard.get_shard_size(10, 4, rank=r) for r in range(4)] == [3, 3, 2, 2]


def test_heads_are_shared_out_by_key_value_group_except_mlp_and_output_layers():
    assert tp_shard.get_shard_size_list(12, 3, num_kv_heads=4) == [6, 3, 3]  # 2/1/1 groups of 3 rows
    tp_shard.set_num_kv_heads(4)
    assert tp_shard.get_num_kv_heads() == 4
    assert tp_shard.get_shard_size_list(12, 3) == [6, 3, 3]
    for name in ("model.layers.0.mlp.fc", "layers.0.up_proj", "lm_head"):
        assert tp_shard.get_shard_size_list(12, 3, name=name) == [4, 4, 4], name
    assert tp_shard.get_shard_size_list(10, 3) == [4, 3, 3]  # 4 heads do not divide 10 rows


def test_grains_stay_whole_and_the_last_rank_takes_the_rest():
    tp_shard.set_tp_grain_size(4)
    assert tp_shard.get_shard_size_list(18, 2) == [8, 10]
    assert tp_shard.get_shard_size_list(3, 2) == [2, 1]  # smaller than a grain: an even share

