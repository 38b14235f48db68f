"""The DeepSpeed adapter: DeepSpeed 0.19.8's effective behaviour made explicit, every key accounted for."""

from __future__ import annotations

import pytest
from adapter_validator import Lossy, assert_accounted, validate_all

from torsh import adapters
from torsh.config import TorshConfig
from torsh.deferred import AUTO
from torsh.errors import ConfigError
from torsh.formats import parse_text
from torsh.translate import Fidelity

BASE = {"train_micro_batch_size_per_gpu": 4}


def read(raw: dict):
    translation = adapters.read(raw, "deepspeed")
    assert_accounted(raw, translation)
    return translation


def note(translation, source_path: str):
    found = [n for n in translation.notes if n.source_path == source_path]
    assert found, f"no note for {source_path}: {[str(n) for n in translation.notes]}"
    return found[0]


def write(cfg: TorshConfig | dict) -> dict:
    cfg = cfg if isinstance(cfg, TorshConfig) else TorshConfig.from_dict(cfg)
    return adapters.write(cfg, "deepspeed").result


# ---- defaults DeepSpeed applies silently are explicit in the core model ---------------------------------


def test_absent_clipping_is_deepspeed_s_1_0_not_off():
    t = read(BASE)
    assert t.result.gradients.clip_max_norm == 1.0
    assert note(t, "gradient_clipping").fidelity is Fidelity.DEFAULTED


def test_clipping_zero_disables_and_no_clipping_is_written_as_zero():
    assert read({**BASE, "gradient_clipping": 0}).result.gradients.clip_max_norm == 0.0
    out = write({"batch": {"micro_batch_size": 4}})  # a core config with no clipping
    assert out["gradient_clipping"] == 0.0, "absent would make DeepSpeed clip at 1.0"


@pytest.mark.parametrize(("section", "dtype"), [("bf16", "bf16"), ("fp16", "fp16"), ("bfloat16", "bf16")])
def test_mixed_precision_contract_follows_deepspeed(section, dtype):
    p = read({**BASE, section: {"enabled": True}, "zero_optimization": {"stage": 2}}).result.precision
    assert (p.param_dtype, p.reduce_dtype, p.grad_accum_dtype) == (dtype, dtype, dtype)
    assert (p.master_dtype, p.optimizer_state_dtype) == ("fp32", "fp32")
    assert p.skip_step_on_nonfinite is True


def test_communication_data_type_and_grad_accum_dtype_override_the_mode():
    p = read({**BASE, "bf16": {"enabled": True}, "communication_data_type": "FP32",
              "data_types": {"grad_accum_dtype": "fp32"}}).result.precision  # fmt: skip
    assert (p.reduce_dtype, p.grad_accum_dtype) == ("fp32", "fp32")


def test_fp16_and_bf16_together_are_rejected_like_deepspeed():
    with pytest.raises(ConfigError, match="cannot be simultaneously enabled"):
        read({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}})


@pytest.mark.parametrize(("stage", "semantics"),
                         [(0, "deepspeed_stage0"), (1, "deepspeed_zero"), (3, "deepspeed_zero")])
def test_fp16_loss_scaling_names_whose_rules_apply(stage, semantics):
    ls = read({**BASE, "fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 3},
               "zero_optimization": {"stage": stage}}).result.precision.loss_scaling  # fmt: skip
    assert (ls.mode, ls.semantics, ls.initial_scale, ls.hysteresis, ls.growth_interval) == (
        "dynamic", semantics, 4096.0, 3, 1000)


def test_static_loss_scale():
    ls = read({**BASE, "fp16": {"enabled": True, "loss_scale": 1024}}).result.precision.loss_scaling
    assert (ls.mode, ls.static_scale) == ("static", 1024.0)


def test_fp16_keys_without_fp16_are_inert_but_kept():
    raw = {**BASE, "fp16": {"enabled": False, "loss_scale_window": 500}}
    t = read(raw)
    assert t.result.precision.loss_scaling.mode == "none"
    assert note(t, "fp16.loss_scale_window").fidelity is Fidelity.IGNORED
    assert write(t.result)["fp16"] == {"loss_scale_window": 500}


# ---- optimizer and scheduler ----------------------------------------------------------------------------


def test_deepspeed_adam_is_adamw_with_weight_decay_zero():
    t = read({**BASE, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}})
    o = t.result.optimizer
    assert (o.name, o.lr, o.weight_decay, o.betas, o.eps) == ("AdamW", 1e-4, 0.0, (0.9, 0.999), 1e-8)
    assert "AdamW" in note(t, "optimizer.type").reason


def test_adam_w_mode_false_is_l2_adam_and_round_trips():
    t = read({**BASE, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}})
    assert t.result.optimizer.name == "Adam"
    assert write(t.result)["optimizer"]["params"]["adam_w_mode"] is False


def test_torch_adam_takes_torch_s_weight_decay_default():
    o = read({**BASE, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}).result.optimizer
    assert o.weight_decay == 0.01


def test_foreign_adamw_without_weight_decay_is_written_with_torch_s_default():
    out = write({"batch": {"micro_batch_size": 2}, "optimizer": {"name": "AdamW", "lr": 1e-3}})
    assert out["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}


@pytest.mark.parametrize("name", ["WarmupLR", "WarmupCosineLR"])
def test_scheduler_defaults_are_explicit_with_log_warmup(name):
    params = {"total_num_steps": 100} if name == "WarmupCosineLR" else {}
    s = read({**BASE, "scheduler": {"type": name, "params": params}}).result.scheduler
    assert (s.name, s.warmup_type, s.warmup_num_steps) == (name, "log", 1000)


def test_scheduler_missing_required_argument_is_an_error():
    with pytest.raises(ConfigError, match="total_num_steps"):
        read({**BASE, "scheduler": {"type": "WarmupDecayLR", "params": {}}})


def test_unknown_scheduler_argument_gets_a_suggestion():
    t = read({**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}})
    n = note(t, "scheduler.params.warmup_num_step")
    assert n.fidelity is Fidelity.DROPPED and "warmup_num_steps" in n.reason


@pytest.mark.parametrize(("given", "name"), [("adagrad", "Adagrad"), ("SGD", "SGD"), ("lamb", "Lamb")])
def test_optimizer_names_follow_deepspeed_s_matching(given, name):
    assert read({**BASE, "optimizer": {"type": given, "params": {"lr": 0.1}}}).result.optimizer.name == name


def test_unknown_optimizer_is_an_error_with_a_suggestion():
    with pytest.raises(ConfigError, match="did you mean 'AdamW'"):
        read({**BASE, "optimizer": {"type": "AdamWW"}})


def test_torch_scheduler_passes_through():
    t = read({**BASE, "scheduler": {"type": "StepLR", "params": {"step_size": 10}}})
    assert t.result.scheduler.kwargs == {"step_size": 10}
    assert write(t.result)["scheduler"] == {"type": "StepLR", "params": {"step_size": 10}}


# ---- "auto", removed keys, unknown keys -----------------------------------------------------------------


def test_auto_is_deferred_and_says_where_it_comes_from():
    t = read({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}})  # fmt: skip
    assert t.result.batch.global_batch_size is AUTO and t.result.gradients.clip_max_norm is AUTO
    assert "learning_rate" in note(t, "optimizer.params.lr").reason
    prefetch = note(t, "zero_optimization.stage3_prefetch_bucket_size")
    assert prefetch.fidelity is Fidelity.DEFERRED and "hidden_size" in prefetch.reason
    out = write(t.result)
    assert out["train_batch_size"] == "auto" and out["zero_optimization"]["prefetch_bucket_size"] == "auto"


@pytest.mark.parametrize("raw", [{"communication_data_type": "auto"}, {"torch_autocast": {"enabled": "auto"}}])
def test_auto_where_deepspeed_fails_on_it_is_an_error(raw):
    with pytest.raises(ConfigError, match="does not accept"):
        read({**BASE, **raw})


def test_auto_precision_flags_stay_auto():
    t = read({**BASE, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}})
    assert t.result.precision.param_dtype is AUTO
    out = write(t.result)
    assert out["fp16"]["enabled"] == "auto" and out["bf16"]["enabled"] == "auto"


@pytest.mark.parametrize(("key", "instead"), [
    ("amp", "bf16"), ("elasticity", "train_batch_size"), ("curriculum_learning", "data_efficiency"),
    ("sparse_attention", "scaled_dot_product_attention")])  # fmt: skip
def test_removed_sections_are_reported_with_what_to_use_instead(key, instead):
    t = read({**BASE, key: {"enabled": True}})
    n = note(t, key)
    assert n.fidelity is Fidelity.DROPPED and "removed" in n.reason and instead in n.reason
    assert key not in write(t.result)


def test_one_bit_adam_is_reported_removed_and_replaced_by_adamw():
    t = read({**BASE, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-4, "freeze_step": 400}}})
    assert note(t, "optimizer.type").fidelity is Fidelity.DROPPED
    assert note(t, "optimizer.params.freeze_step").fidelity is Fidelity.DROPPED
    assert write(t.result)["optimizer"]["type"] == "AdamW"


def test_misspelt_top_level_key_does_not_slip_through():
    t = read({**BASE, "gradient_clippping": 5.0})
    n = note(t, "gradient_clippping")
    assert n.fidelity is Fidelity.DROPPED and "did you mean 'gradient_clipping'" in n.reason
    assert t.result.gradients.clip_max_norm == 1.0  # what DeepSpeed would actually do
    assert n in t.lossy, "--strict must fail on it"


def test_misspelt_key_in_a_strict_section_is_an_error_as_in_deepspeed():
    # DeepSpeed 0.19.8's zero_optimization model forbids extra keys: it refuses the whole config
    with pytest.raises(ConfigError) as exc:
        read({**BASE, "zero_optimization": {"stage": 3, "stage3_param_persitance_threshold": 1e5}})
    problem, = exc.value.problems
    assert problem.path == "zero_optimization.stage3_param_persitance_threshold"
    assert problem.suggestion == "stage3_param_persistence_threshold" and "refuses" in problem.reason


def test_wrong_types_are_errors_naming_the_key():
    with pytest.raises(ConfigError) as exc:
        read({"train_batch_size": "8", "zero_optimization": {"stage": 5}})
    paths = {p.path for p in exc.value.problems}
    assert paths == {"train_batch_size", "zero_optimization.stage"}


# ---- ZeRO, offload, aliases ----------------------------------------------------------------------------


def test_offload_and_16bit_save():
    t = read({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False},
              "offload_optimizer": {"device": "cpu"}, "stage3_gather_16bit_weights_on_model_save": True}})  # fmt: skip
    c = t.result
    assert (c.offload.params, c.offload.optimizer, c.offload.pin_memory) == ("cpu", "cpu", False)
    assert c.checkpoint.save_full_weights is True


def test_offload_param_below_stage_3_is_inert_as_in_deepspeed():
    t = read({**BASE, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert t.result.offload.params == "none"
    assert "stage 3" in note(t, "zero_optimization.offload_param.device").reason


def test_two_offload_sections_with_different_pin_memory_are_reported():
    t = read({**BASE, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
              "offload_param": {"device": "cpu", "pin_memory": False}}})  # fmt: skip
    assert t.result.offload.pin_memory is True
    assert note(t, "zero_optimization.offload_param.pin_memory").fidelity is Fidelity.APPROXIMATE
    assert write(t.result)["zero_optimization"]["offload_param"]["pin_memory"] is False  # kept for DeepSpeed


def test_hierarchical_partitioning_is_run_as_zero3_over_all_ranks():
    # ZeRO++ hpZ shards optimizer state over every rank (HSDP would not): plain ZeRO-3, noted (tests/test_zeropp.py)
    t = read({**BASE, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})
    assert (t.result.sharding.stage, t.result.sharding.hybrid_shard_size) == (3, None)
    assert note(t, "zero_optimization.zero_hpz_partition_size").fidelity is Fidelity.APPROXIMATE


def test_legacy_cpu_offload_and_boolean_zero():
    assert read({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": True}}).result.offload.optimizer == "cpu"
    assert read({**BASE, "zero_optimization": True}).result.sharding.stage == 1


def test_stage3_prefixed_and_plain_spellings_are_read_into_one_field_and_written_in_the_current_one():
    raw = {**BASE, "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "prefetch_bucket_size": 5e7}}
    cfg = read(raw).result
    assert (cfg.sharding.buckets.max_live_parameters, cfg.sharding.buckets.prefetch_bucket_size) == (10**9, 5 * 10**7)
    out = write(cfg)
    assert out["zero_optimization"]["max_live_parameters"] == 10**9 and "stage3_max_live_parameters" not in out
    assert out["zero_optimization"]["prefetch_bucket_size"] == 5 * 10**7


def test_hjson_comments_and_trailing_commas_parse_and_duplicates_are_rejected():
    data = parse_text('{\n // ZeRO-2\n "train_batch_size": 8,\n "zero_optimization": {"stage": 2,},\n}', "json")
    assert read(data).result.sharding.stage == 2
    with pytest.raises(ConfigError, match="duplicate key"):
        parse_text('{"train_batch_size": 8, "train_batch_size": 16}', "json")


def test_sniff_detects_deepspeed_by_content():
    assert adapters.sniff({"train_batch_size": 8, "zero_optimization": {"stage": 1}}) == "deepspeed"


# ---- writing core configs from other dialects ------------------------------------------------------------


def test_cross_dialect_lossy_cells_are_reported():
    validate_all(
        {"batch": {"micro_batch_size": 2},
         "precision": {"param_dtype": "fp16", "loss_scaling": {"mode": "dynamic", "semantics": "torch_grad_scaler"}},
         "sharding": {"stage": 0, "sync_module_states": False}, "launch": {"nnodes": 2}},  # fmt: skip
        write={"deepspeed": Lossy({"precision.loss_scaling.semantics": "approximate",
                                   "sharding.sync_module_states": "unsupported", "launch.nnodes": "unsupported"},
                                  payload={"fp16": {"enabled": True, "loss_scale": 0}})},  # fmt: skip
    )


def test_exact_core_config_writes_without_loss_and_reads_back():
    validate_all(
        {"batch": {"global_batch_size": 32, "micro_batch_size": 4}, "sharding": {"stage": 2},
         "precision": {"param_dtype": "bf16", "skip_step_on_nonfinite": True}, "gradients": {"clip_max_norm": 1.0},
         "optimizer": {"name": "AdamW", "lr": 1e-4, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8},
         "offload": {"optimizer": "cpu"}},  # fmt: skip
        write={"deepspeed": Lossy({"offload.optimizer": "approximate"},
                                  payload={"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})},
    )


# ---- the schema describes the same surface as the map ----------------------------------------------------


def test_schema_is_valid_and_knows_every_top_level_key_of_the_map():
    import jsonschema

    from torsh import schemas
    from torsh.adapters import deepspeed

    schema = schemas.load("deepspeed")
    jsonschema.Draft202012Validator.check_schema(schema)
    top = {k.split(".")[0] for k in deepspeed.FIELD_MAP} | {k.split(".")[0] for k in deepspeed.ALIASES}
    assert top <= set(schema["properties"]), top - set(schema["properties"])
    zero = {k.split(".")[1] for k in list(deepspeed.FIELD_MAP) + list(deepspeed.ALIASES)
            if k.startswith("zero_optimization.")}  # fmt: skip
    assert zero <= set(schema["properties"]["zero_optimization"]["properties"])


def test_fp16_compression_from_another_dialect_becomes_communication_data_type():
    validate_all({"batch": {"micro_batch_size": 2}, "compression": {"method": "fp16"}},
                 write={"deepspeed": Lossy({"compression.method": "approximate"},
                                           payload={"communication_data_type": "fp16"})})  # fmt: skip
    validate_all({"batch": {"micro_batch_size": 2}, "compression": {"method": "powersgd", "rank": 2}},
                 write={"deepspeed": Lossy({"compression": "unsupported"})})


@pytest.mark.slow
def test_checked_in_schema_matches_the_installed_deepspeed():
    import json
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is needed to regenerate its schema")
    from torsh import schemas
    from torsh.schemas._generate_deepspeed import build

    assert json.loads(json.dumps(build())) == schemas.load("deepspeed"), (
        "schemas/deepspeed.schema.json is stale: DS_ACCELERATOR=cpu python -m torsh.schemas._generate_deepspeed")


def test_unknown_key_inside_a_section_kept_whole_is_an_error_as_in_deepspeed():
    """Sections with no core meaning are kept for round trips, but a key DeepSpeed's strict section models refuse
    (here a misspelt ``deepcompile``) is an error with a suggestion, as DeepSpeed refuses the file."""
    with pytest.raises(ConfigError) as exc:
        adapters.read({"train_batch_size": 8, "compile": {"deepcompil": True}}, "deepspeed")
    assert exc.value.problems[0].path == "compile.deepcompil" and exc.value.problems[0].suggestion == "deepcompile"


def test_unknown_key_in_a_lenient_section_stays_a_note():
    t = adapters.read({"train_batch_size": 8, "flops_profiler": {"enabled": False, "profile_stepp": 3}}, "deepspeed")
    assert any(n.source_path == "flops_profiler.profile_stepp" and n.lossy for n in t.notes)


def test_sizes_deepspeed_bounds_are_refused_naming_the_key_and_its_own_meanings_kept():
    # DeepSpeed 0.19.8: zero_hpz_partition_size is Field(1, ge=0) -> -5 is refused, 0 accepted (no hierarchy)
    with pytest.raises(ConfigError) as exc:
        read({**BASE, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": -5}})
    assert [p.path for p in exc.value.problems] == ["zero_optimization.zero_hpz_partition_size"]
    assert read({**BASE, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}}).result.sharding.stage == 3
    # pipeline.stages: a positive count or DeepSpeed's "auto"
    with pytest.raises(ConfigError) as exc:
        read({**BASE, "pipeline": {"stages": -5}})
    assert [p.path for p in exc.value.problems] == ["pipeline.stages"]
    # autotp_size has no bound in DeepSpeed (int = 0); its engine runs AutoTP only when > 1, so <= 1 means "no TP"
    t = read({**BASE, "tensor_parallel": {"autotp_size": -3}})
    assert note(t, "tensor_parallel").fidelity is Fidelity.IGNORED
    # "auto": DeepSpeed's config model drops it, so the default 0 (no TP), as DeepSpeedConfig accepts it
    t = read({**BASE, "tensor_parallel": {"autotp_size": "auto"}})
    assert note(t, "tensor_parallel").fidelity is Fidelity.IGNORED and t.result.parallelism.tp == 1
    # mics_shard_size: removed in 0.19.8 (DeepSpeedConfig raises on the key whatever its value, -1 included); a
    # file written for an older DeepSpeed still reads, with the key dropped and reported (--strict fails on it)
    for value in (-1, 4):
        t = read({**BASE, "zero_optimization": {"stage": 3, "mics_shard_size": value}})
        n = note(t, "zero_optimization.mics_shard_size")
        assert n.fidelity is Fidelity.DROPPED and "removed" in n.reason and n in t.lossy


# ---- values DeepSpeed accepts without effect -------------------------------------------------------


def test_steps_per_print_inf_from_accelerate_reads_as_never_print():
    """Accelerate (and the HF Trainer) pass ``steps_per_print: inf`` to silence DeepSpeed's progress lines."""
    t = read({**BASE, "steps_per_print": float("inf")})
    assert note(t, "steps_per_print").fidelity is Fidelity.IGNORED
    assert "never print" in note(t, "steps_per_print").reason
    assert t.result.monitoring.steps_per_print is None
    assert "steps_per_print" not in write(t.result)  # not written back: inf is not JSON


def test_negative_flops_profiler_step_is_accepted_as_deepspeed_does_and_the_profiler_stays_off():
    """DeepSpeed 0.19.8 reads profile_step unchecked and profiles when global_steps equals it: -1 never comes."""
    raw = {**BASE, "flops_profiler": {"enabled": True, "profile_step": -1, "module_depth": 2}}
    t = read(raw)
    assert note(t, "flops_profiler.profile_step").fidelity is Fidelity.IGNORED
    assert note(t, "flops_profiler.enabled").fidelity is Fidelity.IGNORED
    assert t.result.monitoring.profiler.enabled is False
    assert t.result.monitoring.profiler.module_depth == 2
    back = write(t.result)["flops_profiler"]
    assert back["enabled"] is True and back["profile_step"] == -1  # kept for DeepSpeed


def test_zero_flops_profiler_step_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match="flops_profiler.profile_step"):
        adapters.read({**BASE, "flops_profiler": {"enabled": True, "profile_step": 0}}, "deepspeed")


def test_the_schema_is_checked_once_per_read(monkeypatch):
    """One schema pass finds bad values and unknown keys inside sections kept whole alike (it used to run twice)."""
    import jsonschema

    from torsh import schemas

    conforms, passes = [], []
    original_conforms, original_iter = schemas.conforms, jsonschema.Draft202012Validator.iter_errors
    top = schemas.load("deepspeed")
    monkeypatch.setattr(schemas, "conforms", lambda data, schema: (schema is top and conforms.append(1))
                        or original_conforms(data, schema))  # fmt: skip
    monkeypatch.setattr(jsonschema.Draft202012Validator, "iter_errors",
                        lambda self, *a: passes.append(1) or original_iter(self, *a))  # fmt: skip
    read({**BASE, "zero_optimization": {"stage": 2}})
    assert (len(conforms), len(passes)) == (1, 0)  # valid: decided without jsonschema
    with pytest.raises(ConfigError) as exc:
        adapters.read({**BASE, "compile": {"deepcompil": True}, "fp16": {"enabled": True, "bogus": 1}}, "deepspeed")
    assert [p.path for p in exc.value.problems] == ["fp16.bogus", "compile.deepcompil"]
    assert (len(conforms), len(passes)) == (2, 1)


def test_values_deepspeed_accepts_read_as_what_deepspeed_does_with_them():
    """DeepSpeed clips only above 0, prints when (step + 1) % n == 0 (a negative n as its absolute value), and
    cancels the sign of gradient_predivide_factor (x 1/f before the reduction, x f/W after)."""
    t = adapters.read({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": -1.0, "steps_per_print": -5,
                       "gradient_predivide_factor": -2.0,
                       "flops_profiler": {"enabled": True, "top_modules": 0}}, "deepspeed")  # fmt: skip
    cfg = t.result
    assert cfg.gradients.clip_max_norm == 0.0 and cfg.monitoring.steps_per_print == 5
    assert cfg.gradients.predivide_factor == -2.0 and cfg.monitoring.profiler.top_modules == 0
    by_key = {n.source_path: n for n in t.notes}
    assert "no clipping" in by_key["gradient_clipping"].reason and "same as 5" in by_key["steps_per_print"].reason
    assert [n.source_path for n in t.notes].count("gradient_clipping") == 1
    out = adapters.write(cfg, "deepspeed").result
    assert out["gradient_predivide_factor"] == -2.0 and out["steps_per_print"] == 5


def test_a_zero_predivide_factor_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="predivide_factor"):
        adapters.read({"train_micro_batch_size_per_gpu": 1, "gradient_predivide_factor": 0}, "deepspeed")
