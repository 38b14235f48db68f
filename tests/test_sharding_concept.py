"""The sharding-layout concept: each framework's words for the data-parallel layout, both ways, checked against the
frameworks themselves where they are installed."""

from __future__ import annotations

import pytest

from torsh.concepts import sharding


@pytest.mark.parametrize("name", sharding.FSDP1_STRATEGIES)
def test_every_fsdp1_strategy_is_written_back_from_its_layout(name):
    stage, hybrid = sharding.FSDP1_LAYOUTS[name]
    assert sharding.fsdp1_strategy(stage, None, hybrid) == name


def test_fsdp1_strategy_of_stage_1_and_of_an_explicit_reshard():
    assert sharding.fsdp1_strategy(1, None, False) == "SHARD_GRAD_OP"  # no ZeRO-1 of its own: it shards more
    assert sharding.fsdp1_strategy(3, False, False) == "SHARD_GRAD_OP"
    assert sharding.fsdp1_strategy(2, True, True) == "HYBRID_SHARD"


@pytest.mark.parametrize(("value", "name"), [
    ("FULL_SHARD", "FULL_SHARD"), ("shard_grad_op", "SHARD_GRAD_OP"), (3, "NO_SHARD"), ("4", "HYBRID_SHARD"),
    ("HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2"), ("_hybrid_shard_zero2", "_HYBRID_SHARD_ZERO2"),
    (5, "_HYBRID_SHARD_ZERO2"),
    (0, None), (6, None), (True, None), (["FULL_SHARD"], None), ("ShardingStrategy.FULL_SHARD", None), ("full", None),
])  # fmt: skip
def test_fsdp1_strategy_name_reads_plain_values_only(value, name):
    assert sharding.fsdp1_strategy_name(value) == name


def test_the_fsdp1_strategies_are_torchs_in_order():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    assert tuple(m.name for m in sorted(fsdp.ShardingStrategy, key=lambda m: m.value)) == sharding.FSDP1_STRATEGIES
    assert [m.value for m in sorted(fsdp.ShardingStrategy, key=lambda m: m.value)] == [1, 2, 3, 4, 5]


def test_the_trainer_options_are_transformers():
    trainer_utils = pytest.importorskip("transformers.trainer_utils")
    options = {o.value for o in trainer_utils.FSDPOption} - {"offload", "auto_wrap"}
    assert options == set(sharding.TRAINER_OPTIONS)
    assert set(sharding.TRAINER_FSDP2_OPTIONS) <= options


def test_the_lightning_strategy_names_are_lightnings():
    registry = pytest.importorskip("lightning.pytorch.strategies").StrategyRegistry
    for name, (strategy, kwargs) in sharding.LIGHTNING_STRATEGIES.items():
        assert registry[name]["strategy"].__name__ == strategy, name
        assert registry[name]["init_params"] == kwargs, name
    assert sharding.lightning_strategy("ddp") is None


def test_reshard_switch_and_stage():
    assert [sharding.stage_of_reshard(flag) for flag in (True, False)] == [3, 2]
    assert [sharding.reshards(stage, None) for stage in (0, 1, 2, 3)] == [False, False, False, True]
    assert sharding.reshards(2, True) and not sharding.reshards(3, False) and not sharding.reshards(1, True)


def test_fairscale_layouts_cover_every_stage():
    assert [sharding.fairscale_layout(stage) for stage in range(4)] == ["none", "oss", "oss+sdp", "fsdp"]


@pytest.mark.parametrize(("replicate", "shard", "layout"), [
    (2, 4, "hybrid"), (2, -1, "replicate_rest"), (1, 4, "flat"), (1, -1, "flat"), (-1, 4, "flat"), (2, 1, "flat"),
    (True, 4, "flat"), (2, True, "flat"), ("2", 4, "flat"),
])  # fmt: skip
def test_hybrid_degrees(replicate, shard, layout):
    assert sharding.hybrid_degrees(replicate, shard) == layout


def test_hybrid_mesh_needs_known_numbers_that_divide():
    assert sharding.hybrid_mesh(4, 16) == (4, 4)
    assert sharding.hybrid_mesh(3, 16) is None
    assert sharding.hybrid_mesh(4, None) is None
    assert sharding.hybrid_mesh("auto", 16) is None
    assert sharding.data_parallel_ranks(16, 2) == 8
    assert sharding.data_parallel_ranks(15, 2) == 15  # not divisible: left to the writer's own check
    assert sharding.data_parallel_ranks(None, 2) is None


def test_a_2d_mesh_shards_over_its_last_dimension():
    assert sharding.MESH_DIMS.index("shard") == 1
