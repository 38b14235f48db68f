"""The fsdp_plugin dialect: an ``fsdp_config`` JSON as transformers reads it (the real files are in the corpus and the
consumer test; these cover what the corpus does not show)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from golden import check_golden

from torsh import adapters
from torsh.errors import ConfigError
from torsh.formats import dump_text
from torsh.translate import Fidelity

ROOT = Path(__file__).resolve().parent.parent


def read(raw):
    return adapters.read(raw, "fsdp_plugin")


def _note(t, path):
    return next(n for n in t.notes if n.source_path == path)


def test_transformers_defaults_apply_with_or_without_the_prefix():
    """FSDP2 resharding after forward (ZeRO-3), a full state dict, no CPU-RAM-efficient loading."""
    for raw in ({"transformer_layer_cls_to_wrap": ["Block"]}, {"fsdp_transformer_layer_cls_to_wrap": "Block"}):
        t = read(raw)
        cfg = t.result
        assert (cfg.sharding.stage, cfg.checkpoint.state_dict_type) == (3, "full")
        assert cfg.sharding.wrap.module_classes == ["Block"]
        assert _note(t, "state_dict_type").fidelity is Fidelity.DEFAULTED


def test_the_trainer_fsdp_options_apply_as_transformers_applies_them():
    cfg = read({"fsdp": "shard_grad_op offload auto_wrap", "fsdp_config": {"version": 2}}).result
    assert (cfg.sharding.stage, cfg.offload.params) == (2, "cpu")
    with pytest.raises(ConfigError, match="hybrid_shard"):
        read({"fsdp": "hybrid_shard", "fsdp_config": {"version": 2}})


def test_fsdp1_only_keys_in_an_fsdp2_file_are_ignored_as_transformers_ignores_them():
    t = read({"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_backward_prefetch": "BACKWARD_POST"})
    assert t.result.sharding.stage == 3
    assert "only with FSDP1" in _note(t, "fsdp_sharding_strategy").reason


def test_unread_and_documentation_keys_are_kept_and_xla_is_unsupported():
    t = read({"_doc": "x", "activation_cpu_offload": True, "xla": True})
    assert _note(t, "_doc").fidelity is Fidelity.IGNORED
    assert _note(t, "xla").fidelity is Fidelity.UNSUPPORTED
    written = adapters.write(t.result, "fsdp_plugin").result
    assert (written["_doc"], written["activation_cpu_offload"], written["xla"]) == ("x", True, True)


def test_a_wrong_value_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as exc:
        read({"auto_wrap_policy": "EVERYTHING"})
    assert exc.value.problems[0].path == "auto_wrap_policy"


def test_sniffing_tells_plugin_files_from_accelerate_and_trainer_yaml():
    assert adapters.sniff({"fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_offload_params": False}) == "fsdp_plugin"
    assert adapters.sniff({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}) == "accelerate"


def test_the_deepspeed_example_converts_to_its_golden():
    example = ROOT / "migration_examples" / "fsdp_plugin"
    written = adapters.write(adapters.load(example / "zero3_offload_to_trainer.json").result, "fsdp_plugin")
    check_golden(example / "zero3_offload_to_trainer.expected.json", dump_text(written.result, "json"))
    assert json.loads(dump_text(written.result, "json"))["cpu_offload"] is True
