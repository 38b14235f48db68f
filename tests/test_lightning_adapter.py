"""The lightning dialect: DeepSpeedStrategy / FSDPStrategy arguments with the Trainer's (the real files are in the
corpus and the consumer test; these cover what the corpus does not show)."""

from __future__ import annotations

from pathlib import Path

import pytest
from golden import check_golden

from torsh import adapters
from torsh.errors import ConfigError
from torsh.formats import dump_text
from torsh.translate import Fidelity

ROOT = Path(__file__).resolve().parent.parent


def read(raw):
    return adapters.read(raw, "lightning")


def _note(t, path):
    return next(n for n in t.notes if n.source_path == path)


def test_deepspeed_strategy_defaults_are_lightnings():
    """Stage 2, no offload; the Trainer's precision becomes DeepSpeed's fp16 / bf16 section as Lightning adds it."""
    t = read({"Trainer": {"devices": 8, "precision": "bf16-mixed"}, "DeepSpeedStrategy": {}})
    cfg = t.result
    assert (cfg.sharding.stage, cfg.offload.optimizer, cfg.precision.param_dtype) == (2, "none", "bf16")
    assert cfg.launch.nproc_per_node == 8
    assert _note(t, "DeepSpeedStrategy.stage").fidelity is Fidelity.DEFAULTED


def test_offload_devices_and_nvme_path_are_the_offload_they_configure():
    cfg = read({"DeepSpeedStrategy": {"stage": 3, "offload_parameters": True, "offload_params_device": "nvme",
                                      "nvme_path": "/nvme"}}).result  # fmt: skip
    assert (cfg.offload.params, cfg.offload.nvme_path) == ("nvme", "/nvme")
    t = read({"DeepSpeedStrategy": {"offload_optimizer_device": "nvme"}})
    assert "no effect without offload_optimizer" in _note(t, "DeepSpeedStrategy.offload_optimizer_device").reason


def test_fsdp_strategy_reads_lightnings_spellings():
    t = read({"Fabric": {"precision": "bf16-mixed"},
              "FSDPStrategy": {"sharding_strategy": "SHARD_GRAD_OP", "state_dict_type": "sharded",
                               "auto_wrap_policy": "{Block}", "activation_checkpointing_policy": "{Block, MLP}"}})
    cfg = t.result
    assert (cfg.sharding.stage, cfg.checkpoint.state_dict_type) == (2, "sharded")
    assert cfg.sharding.wrap.module_classes == ["Block"]
    assert cfg.activation_checkpointing.enabled and cfg.activation_checkpointing.modules == ["Block", "MLP"]
    assert (cfg.precision.param_dtype, cfg.precision.reduce_dtype) == ("bf16", "bf16")


def test_fsdp_strategy_arguments_round_trip():
    raw = {"FSDPStrategy": {"sharding_strategy": "FULL_SHARD", "state_dict_type": "full", "auto_wrap_policy": "{Block}",
                            "limit_all_gathers": True, "cpu_offload": True}}  # fmt: skip
    written = adapters.write(read(raw).result, "lightning", version="fsdp").result["FSDPStrategy"]
    assert (written.get("state_dict_type", "full"), written["auto_wrap_policy"], written["limit_all_gathers"]) == (
        "full", "{Block}", True)  # "full" is Lightning's default: left out
    assert read({"FSDPStrategy": written}).result == read(raw).result


@pytest.mark.parametrize("raw", [
    {"DeepSpeedStrategy": {}, "FSDPStrategy": {}},
    {"DeepSpeedStrategy": {"stage": 4}},
    {"DeepSpeedStrategy": {}, "Strategy": {}},
])  # fmt: skip
def test_bad_input_is_refused_with_the_key(raw):
    with pytest.raises(ConfigError):
        read(raw)


@pytest.mark.parametrize(("section", "key", "value"), [("Fabric", "num_nodes", -1), ("Trainer", "num_nodes", 2**64),
                                                       ("Trainer", "devices", 0), ("Fabric", "devices", 10**6)])
def test_a_process_count_out_of_range_is_refused_with_its_key(section, key, value):
    with pytest.raises(ConfigError, match=f"{section}.{key}: Lightning needs a count from 1"):
        read({section: {key: value}, "DeepSpeedStrategy": {"stage": 2}})


def test_devices_minus_one_is_every_device_known_when_the_script_runs():
    translation = read({"Trainer": {"devices": -1, "num_nodes": 2}, "DeepSpeedStrategy": {"stage": 2}})
    assert translation.result.launch.nproc_per_node is None and translation.result.launch.nnodes == 2
    assert [n.fidelity for n in translation.notes if n.source_path == "Trainer.devices"] == [Fidelity.DROPPED]


def test_the_deepspeed_example_converts_to_its_golden():
    example = ROOT / "migration_examples" / "lightning"
    written = adapters.write(adapters.load(example / "deepspeed_zero3_offload.json").result, "deepspeed")
    check_golden(example / "deepspeed_zero3_offload.expected.json", dump_text(written.result, "json"))
