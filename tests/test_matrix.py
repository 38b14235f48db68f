"""The cross-dialect conversion matrix: one core config written to every dialect and read back.

Exact cells give a payload (a subset that must match, with no lossy note, and the read-back core config must be
unchanged); lossy cells are ``Lossy({core path: fidelity})`` - asserted, not hoped. The DeepSpeed column runs when
the deepspeed dialect is installed.
"""

from __future__ import annotations

import pytest
from adapter_validator import Lossy, validate_all

from torsh import adapters
from torsh.config import TorshConfig

# DeepSpeed cells assert the payload only (``Lossy({}, payload=...)`` when exact): reading DeepSpeed makes its own
# defaults explicit (gradient_clipping 1.0, ...), so a read-back differs from the core config by design.
A, U, D = "approximate", "unsupported", "dropped"

# Explicit where dialects' defaults differ (prefetch, start-up broadcast, checkpoint form), so that every exact
# cell reads back to the same core config.
_COMMON = {"backward_prefetch": "backward_pre", "sync_module_states": False, "wrap": {"module_classes": ["Block"]}}
CORES = {
    "zero3_bf16": {
        "sharding": {"stage": 3, **_COMMON},
        "precision": {"param_dtype": "bf16", "reduce_dtype": "bf16", "cast_forward_inputs": True},
        "checkpoint": {"state_dict_type": "sharded"},
    },
    "zero2": {"sharding": {"stage": 2, **_COMMON}, "checkpoint": {"state_dict_type": "sharded"}},
    "zero1": {"sharding": {"stage": 1}, "optimizer": {"name": "AdamW", "lr": 1e-4}},
    "hsdp": {"sharding": {"stage": 3, "hybrid_shard_size": 8, **_COMMON}, "checkpoint": {"state_dict_type": "sharded"}},
    "cpu_offload": {"sharding": {"stage": 3, **_COMMON}, "offload": {"params": "cpu", "optimizer": "cpu"},
                    "checkpoint": {"state_dict_type": "sharded"}},
    "nvme_offload": {"sharding": {"stage": 3}, "offload": {"params": "nvme", "optimizer": "nvme",
                                                           "nvme_path": "/local_nvme"}},
    "ddp_fp16": {"precision": {"param_dtype": "fp16", "autocast": True, "loss_scaling": {
        "mode": "dynamic", "semantics": "torch_grad_scaler", "growth_interval": 2000}}},
}  # fmt: skip

MATRIX = {
    "zero3_bf16": {
        "torsh": {"sharding": {"stage": 3}},
        "fsdp1": {"sharding_strategy": "FULL_SHARD", "auto_wrap_policy": {"transformer_layer_cls": ["Block"]},
                  "mixed_precision": {"param_dtype": "torch.bfloat16", "reduce_dtype": "torch.bfloat16"},
                  "state_dict_type": "SHARDED_STATE_DICT"},
        "fsdp2": {"fully_shard": {"reshard_after_forward": True, "mp_policy": {"param_dtype": "torch.bfloat16",
                                                                               "reduce_dtype": "torch.bfloat16"}},
                  "apply_to": ["Block"]},
        "fairscale": Lossy({"sharding.wrap": U, "precision.buffer_dtype": A},
                           payload={"fsdp": {"reshard_after_forward": True, "mixed_precision": True,
                                             "compute_dtype": "torch.bfloat16"}}),
        "accelerate": {"distributed_type": "FSDP", "mixed_precision": "bf16", "fsdp_config": {
            "fsdp_version": 2, "fsdp_reshard_after_forward": True, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "Block", "fsdp_state_dict_type": "SHARDED_STATE_DICT"}},
        "deepspeed": Lossy({"sharding.wrap": "ignored"}, payload={"zero_optimization": {"stage": 3}}),
    },
    # SHARD_GRAD_OP <-> ZeRO-2 <-> reshard_after_forward=False <-> FairScale OSS + ShardedDataParallel
    "zero2": {
        "fsdp1": {"sharding_strategy": "SHARD_GRAD_OP"},
        "fsdp2": {"fully_shard": {"reshard_after_forward": False}},
        "fairscale": Lossy({"sharding.wrap": U}, payload={"oss": {"optim": "torch.optim.SGD"}, "sdp": {}}),
        "accelerate": {"distributed_type": "FSDP", "fsdp_config": {"fsdp_reshard_after_forward": False}},
        "deepspeed": Lossy({"sharding.wrap": "ignored"}, payload={"zero_optimization": {"stage": 2}}),
    },
    # ZeRO-1: optimizer-state-only sharding has no FSDP equivalent; Accelerate reaches it through DeepSpeed.
    "zero1": {
        "torsh": {"sharding": {"stage": 1}},
        "fsdp1": Lossy({"sharding.stage": A}, payload={"sharding_strategy": "SHARD_GRAD_OP"}),
        "fsdp2": Lossy({"sharding.stage": A}, payload={"fully_shard": {"reshard_after_forward": False}}),
        "fairscale": {"oss": {"optim": "torch.optim.AdamW", "lr": 1e-4}},
        # Accelerate takes the optimizer from the script: only the sharding is in its file.
        "accelerate": Lossy({"optimizer.name": U}, payload={"distributed_type": "DEEPSPEED",
                                                           "deepspeed_config": {"zero_stage": 1}}),
        "deepspeed": Lossy({}, payload={"zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW"}}),
    },
    # HYBRID_SHARD <-> 2-D mesh <-> DeepSpeed zero_hpz_partition_size (approximate: hpZ is not HSDP)
    "hsdp": {
        "fsdp1": {"sharding_strategy": "HYBRID_SHARD", "device_mesh": {"shape": [-1, 8]}},
        "fsdp2": {"fully_shard": {"reshard_after_forward": True, "mesh": {"shape": [-1, 8]}}},
        "fairscale": Lossy({"sharding.hybrid_shard_size": U}, payload={"fsdp": {"reshard_after_forward": True}}),
        # FSDP2 HSDP in Accelerate is dp_replicate_size x dp_shard_size: it needs num_processes (next test).
        "accelerate": Lossy({"sharding.hybrid_shard_size": U}, payload={"distributed_type": "FSDP"}),
        "deepspeed": Lossy({"sharding.hybrid_shard_size": A}, payload={"zero_optimization": {
            "stage": 3, "zero_hpz_partition_size": 8}}),
    },
    "cpu_offload": {
        "fsdp1": {"cpu_offload": {"offload_params": True}},
        "fsdp2": {"fully_shard": {"offload_policy": {"pin_memory": True}}},
        "fairscale": Lossy({"sharding.wrap": U}, payload={"fsdp": {"move_params_to_cpu": True}}),
        "accelerate": {"fsdp_config": {"fsdp_offload_params": True}},
        "deepspeed": Lossy({"sharding.wrap": "ignored"}, payload={"zero_optimization": {
            "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}),
    },
    # DeepSpeed NVMe offload -> FSDP / FairScale unsupported; Accelerate keeps it through its DeepSpeed backend.
    "nvme_offload": {
        "fsdp1": Lossy({"offload.params": U}, payload={"sharding_strategy": "FULL_SHARD"}),
        "fsdp2": Lossy({"offload.params": U}, payload={"fully_shard": {"reshard_after_forward": True}}),
        "fairscale": Lossy({"offload": U}),
        "accelerate": Lossy({"offload.nvme_path": A}, payload={"distributed_type": "DEEPSPEED", "deepspeed_config": {
            "offload_param_device": "nvme", "offload_optimizer_device": "nvme",
            "offload_param_nvme_path": "/local_nvme"}}),
        "deepspeed": Lossy({}, payload={"zero_optimization": {"offload_param": {"device": "nvme",
                                                                                "nvme_path": "/local_nvme"}}}),
    },
    # DDP with fp16 autocast and GradScaler: Accelerate MULTI_GPU exactly; FSDP cannot replicate only.
    "ddp_fp16": {
        "torsh": {"precision": {"param_dtype": "fp16"}},
        "fsdp1": Lossy({"sharding.stage": A, "precision.loss_scaling.mode": U, "precision.autocast": U}),
        "fsdp2": Lossy({"sharding.stage": U, "precision.loss_scaling.mode": U}),
        "fairscale": Lossy({"sharding.stage": U, "precision.param_dtype": U}, payload={"scaler": {}}),
        "accelerate": {"distributed_type": "MULTI_GPU", "mixed_precision": "fp16"},
        "deepspeed": Lossy({"precision.loss_scaling": "exact"},
                           payload={"torch_autocast": {"enabled": True, "dtype": "float16"}}),
    },
}


def _cells(name: str) -> dict:
    return dict(MATRIX[name])


@pytest.mark.parametrize("name", list(MATRIX))
def test_matrix_row(name):
    validate_all(CORES[name], write=_cells(name))


def test_every_dialect_of_this_issue_is_in_every_row():
    for name, row in MATRIX.items():
        assert {"fsdp1", "fsdp2", "fairscale", "accelerate", "deepspeed"} <= set(row), name


@pytest.mark.parametrize("dialect", ["fsdp1", "fsdp2", "fairscale", "accelerate"])
def test_exact_cells_read_back_to_the_written_payload(dialect):
    """Writing what was read gives the same payload again (a second round trip changes nothing)."""
    for name, row in MATRIX.items():
        if isinstance(row.get(dialect), Lossy):
            continue
        first = adapters.write(TorshConfig.from_dict(CORES[name]), dialect).result
        second = adapters.write(adapters.read(first, dialect).result, dialect).result
        assert second == first, name


def test_hsdp_with_a_known_world_size_is_exact_in_accelerate_fsdp2():
    core = {**CORES["hsdp"], "launch": {"world_size": 32}}
    validate_all(core, write={"accelerate": {"distributed_type": "FSDP", "parallelism_config": {
        "parallelism_config_dp_replicate_size": 4, "parallelism_config_dp_shard_size": 8}}})
    fsdp1 = adapters.write(TorshConfig.from_dict(core), "accelerate", version="fsdp1")
    assert fsdp1.result["fsdp_config"]["fsdp_sharding_strategy"] == "HYBRID_SHARD"
    assert {n.source_path: n.fidelity.value for n in fsdp1.lossy} == {"sharding.hybrid_shard_size": A}


def test_zero2_spellings_read_to_the_same_core():
    """SHARD_GRAD_OP, ShardingStrategy.SHARD_GRAD_OP, 2, reshard_after_forward=False, OSS+SDP: all ZeRO-2."""
    sources = [
        ({"sharding_strategy": "SHARD_GRAD_OP"}, "fsdp"),
        ({"sharding_strategy": "ShardingStrategy.SHARD_GRAD_OP"}, "fsdp"),
        ({"sharding_strategy": 2}, "fsdp"),
        ({"fully_shard": {"reshard_after_forward": False}}, "fsdp"),
        ({"fsdp": {"reshard_after_forward": False}}, "fairscale"),
        ({"oss": {"optim": "torch.optim.AdamW"}, "sdp": {}}, "fairscale"),
        ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False}},
         "accelerate"),
        ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP"}}, "accelerate"),
        ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2}}, "accelerate"),
    ]
    for raw, dialect in sources:
        cfg = adapters.read(raw, dialect).result
        assert (cfg.sharding.stage, cfg.sharding.effective_reshard_after_forward) == (2, False), raw


def test_deepspeed_nvme_offload_is_unsupported_in_fsdp():
    cfg = TorshConfig.from_dict(CORES["nvme_offload"])
    for version in ("fsdp1", "fsdp2"):
        written = adapters.write(cfg, "fsdp", version=version)
        assert "offload" not in str(written.result)
        note = next(n for n in written.notes if n.source_path == "offload.params")
        assert note.fidelity.value == U and "NVMe" in note.reason


def test_docs_sharding_table_is_the_generated_one():
    from pathlib import Path

    from torsh.adapters._equivalence import render, table_in

    page = Path(__file__).resolve().parent.parent / "docs" / "guides" / "fsdp.md"
    assert table_in(page) == render(), "regenerate it: python -m torsh.adapters._equivalence docs/guides/fsdp.md"


@pytest.mark.parametrize("dialect", ["fsdp", "fsdp1", "fsdp2", "fairscale", "accelerate"])
def test_field_maps_have_the_dialect_shape_and_a_one_to_one_reverse(dialect):
    from torsh.translate import FieldMap

    module = adapters.get(dialect)
    for attribute in adapters.REQUIRED_ATTRIBUTES:
        assert hasattr(module, attribute), attribute
    reverse = FieldMap(module.FIELD_MAP, module.ALIASES).reverse()  # raises on two writers of one core path
    assert reverse and all(path.split(".")[0] in TorshConfig.model_fields for path in reverse)


def test_each_written_layout_has_a_one_to_one_reverse():
    from torsh.adapters import accelerate, fairscale, fsdp

    maps = [fsdp._V1_WRITE, fsdp._V2_WRITE, fairscale._WRITE_MAP]
    maps += [accelerate._write_map(backend) for backend in accelerate.VERSIONS]
    for field_map in maps:
        field_map.reverse()
