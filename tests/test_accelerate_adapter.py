"""The accelerate dialect: `accelerate config` YAMLs (DDP, FSDP v1/v2, DeepSpeed inline and through a file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_accelerate_corpus import REFUSED
from adapter_validator import assert_accounted

from torsh import adapters
from torsh.config import AUTO, TorshConfig
from torsh.errors import ConfigError
from torsh.translate import Fidelity

CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus"


def _note(translation, path: str):
    return next(n for n in translation.notes if n.source_path == path)


def _fsdp(fsdp_config: dict, **top) -> dict:
    return {"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 8, **top,
            "fsdp_config": fsdp_config}


# ---- the FSDP1 strategy quirk ------------------------------------------------------------------------


def test_fsdp1_is_written_with_both_strategy_keys():
    cfg = TorshConfig.from_dict({"sharding": {"stage": 2}})
    written = adapters.write(cfg, "accelerate", version="fsdp1")
    fc = written.result["fsdp_config"]
    assert fc["fsdp_sharding_strategy"] == fc["fsdp_reshard_after_forward"] == "SHARD_GRAD_OP"
    assert fc["fsdp_version"] == 1
    note = next(n for n in written.notes if n.target_path == "fsdp_config.fsdp_reshard_after_forward")
    assert "every Accelerate version" in note.reason


def test_fsdp1_strategy_only_under_reshard_after_forward_is_read_with_a_warning_note():
    t = adapters.read(_fsdp({"fsdp_version": 1, "fsdp_reshard_after_forward": "SHARD_GRAD_OP"}), "accelerate")
    assert t.result.sharding.stage == 2
    note = _note(t, "fsdp_config.fsdp_reshard_after_forward")
    assert note.fidelity is Fidelity.APPROXIMATE and "runs FULL_SHARD" in note.reason


def test_fsdp1_with_a_bool_reshard_key_is_not_an_error_and_says_why_it_is_ignored():
    t = adapters.read(_fsdp({"fsdp_reshard_after_forward": False}), "accelerate")
    assert t.result.sharding.stage == 3  # the FSDP1 plugin's default FULL_SHARD
    assert "fsdp_version: 2" in _note(t, "fsdp_config.fsdp_reshard_after_forward").reason


def test_fsdp1_sharding_strategy_wins_over_a_different_reshard_key():
    raw = _fsdp({"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_reshard_after_forward": "SHARD_GRAD_OP"})
    t = adapters.read(raw, "accelerate")
    assert t.result.sharding.stage == 3
    assert _note(t, "fsdp_config.fsdp_reshard_after_forward").fidelity is Fidelity.DROPPED


@pytest.mark.parametrize("spelling", ["SHARD_GRAD_OP", "shard_grad_op", 2, "2", "ShardingStrategy.SHARD_GRAD_OP"])
def test_accelerate_strategy_spellings(spelling):
    assert adapters.read(_fsdp({"fsdp_sharding_strategy": spelling}), "accelerate").result.sharding.stage == 2


def test_keys_without_the_fsdp_prefix_are_legacy_spellings():
    t = adapters.read(_fsdp({"sharding_strategy": "SHARD_GRAD_OP", "offload_params": True}), "accelerate")
    assert (t.result.sharding.stage, t.result.offload.params) == (2, "cpu")


# ---- FSDP semantics -----------------------------------------------------------------------------------


def test_fsdp2_reads_reshard_as_a_bool_and_defaults_of_the_launcher():
    t = adapters.read(_fsdp({"fsdp_version": 2, "fsdp_reshard_after_forward": False,
                             "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}), "accelerate")  # fmt: skip
    cfg = t.result
    assert (cfg.sharding.stage, cfg.sharding.wrap.min_num_params) == (2, 100_000_000)
    assert cfg.checkpoint.state_dict_type == "sharded" and cfg.sharding.sync_module_states is True
    assert (cfg.precision.param_dtype, cfg.precision.reduce_dtype, cfg.precision.buffer_dtype) == ("bf16", "bf16", None)


def test_fsdp1_precision_and_prefetch_defaults():
    cfg = adapters.read(_fsdp({"fsdp_sharding_strategy": "FULL_SHARD"}), "accelerate").result
    assert cfg.precision.buffer_dtype == "bf16" and cfg.precision.cast_forward_inputs
    assert cfg.sharding.backward_prefetch == "none"  # Accelerate's default, unlike torch's BACKWARD_PRE
    assert cfg.checkpoint.state_dict_type == "full"


def test_fsdp2_forward_prefetch_is_passed_over_as_accelerate_launch_does():
    """The FSDP2 plugin raises for forward_prefetch only when given it as an argument; from accelerate launch's
    environment it does not read the key at all (differential test against the plugin)."""
    t = adapters.read(_fsdp({"fsdp_version": 2, "fsdp_forward_prefetch": True}), "accelerate")
    assert any(n.fidelity is Fidelity.IGNORED and "does not read" in n.reason for n in t.notes
               if n.source_path == "fsdp_config.fsdp_forward_prefetch")  # fmt: skip
    assert t.result.sharding.forward_prefetch is False


def test_hsdp_from_parallelism_config():
    raw = _fsdp({"fsdp_version": 2}, parallelism_config={"parallelism_config_dp_replicate_size": 2,
                                                         "parallelism_config_dp_shard_size": 4,
                                                         "parallelism_config_tp_size": 1})  # fmt: skip
    assert adapters.read(raw, "accelerate").result.sharding.hybrid_shard_size == 4
    with_tp = adapters.read(_fsdp({"fsdp_version": 2}, parallelism_config={"parallelism_config_tp_size": 2}),
                            "accelerate")  # fmt: skip
    assert _note(with_tp, "parallelism_config.parallelism_config_tp_size").fidelity is Fidelity.APPROXIMATE
    assert with_tp.result.parallelism.tp == 2


def test_unread_sections_are_noted_not_mapped():
    raw = {"distributed_type": "MULTI_GPU", "fsdp_config": {"fsdp_offload_params": True}, "num_processes": 2}
    t = adapters.read(raw, "accelerate")
    assert t.result.offload.params == "none" and t.result.sharding.stage == 0
    assert _note(t, "fsdp_config.fsdp_offload_params").fidelity is Fidelity.IGNORED


def test_unknown_section_keys_are_reported_with_suggestions_and_unknown_values_are_errors():
    """accelerate launch copies every section key onto its arguments and accepts a file with a key nothing reads:
    a misspelling is reported (dropped, with a did-you-mean; ``validate --strict`` exits 1) and kept, not refused."""
    t = adapters.read(_fsdp({"fsdp_ofload_params": True}), "accelerate")
    note = next(n for n in t.notes if n.source_path == "fsdp_config.fsdp_ofload_params")
    assert note.fidelity is Fidelity.DROPPED and "did you mean 'fsdp_offload_params'" in note.reason
    assert t.result.offload.params == "none"
    assert adapters.write(t.result, "accelerate").result["fsdp_config"]["fsdp_ofload_params"] is True
    with pytest.raises(ConfigError) as exc:
        adapters.read({"distributed_type": "FDSP"}, "accelerate")
    assert exc.value.problems[0].suggestion == "FSDP"


# ---- DDP and DeepSpeed ---------------------------------------------------------------------------------


def test_multi_gpu_fp16_is_autocast_with_a_grad_scaler():
    cfg = adapters.read({"distributed_type": "MULTI_GPU", "mixed_precision": "fp16"}, "accelerate").result
    p = cfg.precision
    assert (cfg.sharding.stage, p.param_dtype, p.autocast) == (0, "fp16", True)
    assert (p.loss_scaling.mode, p.loss_scaling.semantics, p.loss_scaling.growth_interval) == \
        ("dynamic", "torch_grad_scaler", 2000)


def test_inline_deepspeed_defaults_are_deferred_like_accelerate():
    t = adapters.read({"distributed_type": "DEEPSPEED", "mixed_precision": "bf16",
                       "deepspeed_config": {"offload_optimizer_device": "cpu"}}, "accelerate")  # fmt: skip
    cfg = t.result
    assert cfg.sharding.stage == 2 and cfg.offload.optimizer == "cpu"
    assert cfg.batch.micro_batch_size is AUTO and cfg.gradients.clip_max_norm is AUTO
    assert (cfg.precision.param_dtype, cfg.precision.reduce_dtype) == ("bf16", "bf16")


def test_deepspeed_config_file_cannot_be_mixed_with_inline_keys():
    raw = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": "ds.json", "zero_stage": 3}}
    with pytest.raises(ConfigError, match="deepspeed_config.zero_stage: Accelerate refuses"):
        adapters.read(raw, "accelerate")


def test_deepspeed_config_file_notes_are_prefixed_and_errors_located(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 5}}))
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                       "  deepspeed_config_file: ds.json\n")
    with pytest.raises(ConfigError) as exc:
        adapters.load(tmp_path / "acc.yaml")
    assert any(p.path.startswith("deepspeed_config.deepspeed_config_file:ds.json.zero_optimization.stage")
               for p in exc.value.problems)


def test_deepspeed_config_file_is_resolved_from_the_working_directory_as_accelerate_does(tmp_path, monkeypatch):
    (tmp_path / "run" / "configs").mkdir(parents=True)
    (tmp_path / "run" / "configs" / "ds.json").write_text(json.dumps({"train_batch_size": 8,
                                                                     "zero_optimization": {"stage": 2}}))
    (tmp_path / "yamls").mkdir()
    (tmp_path / "yamls" / "acc.yaml").write_text("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"
                                                 "  deepspeed_config_file: configs/ds.json\n")  # fmt: skip
    monkeypatch.chdir(tmp_path / "run")
    t = adapters.load(tmp_path / "yamls" / "acc.yaml")
    assert t.result.sharding.stage == 2
    assert not any("working directory" in n.reason for n in t.notes)


@pytest.mark.parametrize("content", ["root:x:0:0:root:/root:/bin/bash\nsecret_line: 1\n", "[1, 2]", '{"user": "x"}',
                                     '{"train_batch_size": 8, // comment\n}'])
def test_deepspeed_config_file_that_is_not_a_deepspeed_json_is_an_error_that_never_echoes_it(tmp_path, content):
    (tmp_path / "other").write_text(content)
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"
                                       f"  deepspeed_config_file: {tmp_path / 'other'}\n")  # fmt: skip
    with pytest.raises(ConfigError) as exc:
        adapters.load(tmp_path / "acc.yaml")
    text = str(exc.value)
    assert "not a DeepSpeed" in text and "root:x" not in text and "secret_line" not in text and "user" not in text


def test_deepspeed_config_file_found_only_next_to_the_yaml_is_read_with_a_note(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}))
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"
                                       "  deepspeed_config_file: configs/ds.json\n")  # fmt: skip
    monkeypatch.chdir("/")
    t = adapters.load(tmp_path / "acc.yaml")
    assert (t.result.sharding.stage, t.result.batch.micro_batch_size, t.result.launch.world_size) == (1, 4, 2)
    assert any(n.source_path.startswith("configs/ds.json:") for n in t.notes)
    note = next(n for n in t.notes if n.source_path == "deepspeed_config.deepspeed_config_file" and n.lossy)
    assert "working directory" in note.reason


# ---- writing ------------------------------------------------------------------------------------------


def test_backend_follows_the_stage_and_offload():
    def kind(core, version=None):
        return adapters.write(TorshConfig.from_dict(core), "accelerate", version=version).result["distributed_type"]

    assert kind({}) == "MULTI_GPU"
    assert kind({"sharding": {"stage": 1}}) == "DEEPSPEED"
    assert kind({"sharding": {"stage": 3}}) == "FSDP"
    assert kind({"sharding": {"stage": 2}, "offload": {"optimizer": "cpu"}}) == "DEEPSPEED"
    assert kind({"sharding": {"stage": 3}}, "deepspeed") == "DEEPSPEED"


def test_fp32_reduce_is_approximate_in_accelerate_mixed_precision():
    cfg = TorshConfig.from_dict({"sharding": {"stage": 3}, "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32",
                                                                         "cast_forward_inputs": True}})
    written = adapters.write(cfg, "accelerate")
    assert written.result["mixed_precision"] == "bf16"
    assert _note(written, "precision.reduce_dtype").fidelity is Fidelity.APPROXIMATE


def test_writing_reads_back_to_the_same_config_for_every_corpus_yaml():
    for path in sorted((CORPUS / "accelerate").glob("*.yaml")):
        if path.name in REFUSED:  # refused with a ConfigError naming the key (tests/test_accelerate_corpus.py)
            continue
        first = adapters.load(path)
        written = adapters.write(first.result, "accelerate")
        if "deepspeed_config_file" in path.read_text():
            # The settings came from a separate DeepSpeed file, which an Accelerate YAML cannot hold inline:
            # the report says to write that JSON (--to deepspeed) and name it.
            assert all("deepspeed_config_file" in n.reason or n.fidelity.value == "dropped" for n in written.lossy)
            continue
        assert not written.lossy, (path.name, [str(n) for n in written.lossy])
        again = adapters.read(written.result, "accelerate").result
        assert again.model_dump(exclude={"extensions"}) == first.result.model_dump(exclude={"extensions"}), path.name


def test_unsupported_sections_are_accounted_for():
    raw = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2},
           "dynamo_config": {"dynamo_backend": "INDUCTOR"},
           "ipex_config": {"ipex": True}, "tpu_env": [], "megatron_lm_config": {}}
    t = adapters.read(raw, "accelerate")
    assert_accounted(raw, t)
    assert _note(t, "dynamo_config").fidelity is Fidelity.UNSUPPORTED


def test_fsdp1_to_fsdp2_reports_the_buffer_dtype_fsdp2_does_not_cast():
    cfg = adapters.read(_fsdp({"fsdp_sharding_strategy": "FULL_SHARD"}), "accelerate").result
    written = adapters.write(cfg, "accelerate", version="fsdp2")
    assert _note(written, "precision.buffer_dtype").fidelity is Fidelity.APPROXIMATE
    assert not adapters.write(cfg, "accelerate", version="fsdp1").lossy


@pytest.mark.parametrize("bad", [0, -2, -5])
def test_a_process_count_accelerate_cannot_use_is_refused_naming_the_key(bad):
    with pytest.raises(ConfigError) as exc:
        adapters.read({"distributed_type": "MULTI_GPU", "num_processes": bad, "num_machines": 1}, "accelerate")
    assert [p.path for p in exc.value.problems] == ["num_processes"]


def test_num_processes_minus_one_is_accelerates_not_stated_and_num_machines_must_be_positive():
    # -1 is the default of Accelerate's ClusterConfig: accelerate launch then demands --num_processes
    t = adapters.read({"distributed_type": "MULTI_GPU", "num_processes": -1, "num_machines": 1}, "accelerate")
    assert "--num_processes" in _note(t, "num_processes").reason and t.result.launch.world_size is None
    for bad in (0, -1):
        with pytest.raises(ConfigError) as exc:
            adapters.read({"distributed_type": "MULTI_GPU", "num_processes": 2, "num_machines": bad}, "accelerate")
        assert [p.path for p in exc.value.problems] == ["num_machines"]
