"""The torchtitan dialect: torchtitan 0.2.2's job-config TOML, read and written (the real files are in the corpus
and the consumer test; these cover what the corpus does not show)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from golden import check_golden

from torsh import adapters
from torsh.errors import ConfigError
from torsh.formats import dump_text
from torsh.translate import ErrorLevel, Fidelity, LossyTranslationError

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "fixtures" / "corpus" / "torchtitan"


def read(raw):
    return adapters.read(raw, "torchtitan")


def _note(t, path):
    return next(n for n in t.notes if n.source_path == path)


def test_a_file_that_says_nothing_trains_as_torchtitan_does_by_default():
    """FSDP over every rank (ZeRO-3), bfloat16 parameters, float32 reduction, selective activation checkpointing."""
    t = read({"job": {"description": "x"}})
    cfg = t.result
    assert cfg.sharding.stage == 3 and cfg.sharding.hybrid_shard_size is None
    assert (cfg.precision.param_dtype, cfg.precision.reduce_dtype) == ("bf16", "fp32")
    assert cfg.activation_checkpointing.enabled
    assert _note(t, "activation_checkpoint.mode").fidelity is Fidelity.DEFAULTED
    assert cfg.optimizer.name == "AdamW" and cfg.optimizer.betas == (0.9, 0.95)


@pytest.mark.parametrize("parallelism, stage, hybrid", [
    ({"data_parallel_shard_degree": -1, "fsdp_reshard_after_forward": "never"}, 2, None),
    ({"data_parallel_shard_degree": 8, "data_parallel_replicate_degree": 4}, 3, 8),
    ({"data_parallel_shard_degree": 1, "data_parallel_replicate_degree": 16}, 0, None),
    ({"data_parallel_shard_degree": -1, "fsdp_reshard_after_forward": "always"}, 3, None),
])  # fmt: skip
def test_data_parallel_degrees_decide_the_sharding(parallelism, stage, hybrid):
    cfg = read({"parallelism": parallelism}).result
    assert (cfg.sharding.stage, cfg.sharding.hybrid_shard_size) == (stage, hybrid)


def test_hybrid_sharding_over_the_remaining_ranks_is_the_replicate_degree_not_a_guessed_group():
    t = read({"parallelism": {"data_parallel_replicate_degree": 2}})
    assert t.result.sharding.hybrid_shard_size is None and t.result.parallelism.dp_replicate == 2
    assert adapters.write(t.result, "torchtitan").result["parallelism"]["data_parallel_replicate_degree"] == 2


def test_model_parallel_degrees_are_the_core_degrees_and_expert_parallelism_is_unsupported():
    t = read({"parallelism": {"tensor_parallel_degree": 8, "pipeline_parallel_degree": 1, "context_parallel_degree": 2,
                              "expert_parallel_degree": 4}})  # fmt: skip
    par = t.result.parallelism
    assert (par.tp, par.pp, par.cp) == (8, 1, 2)
    assert _note(t, "parallelism.tensor_parallel_degree").fidelity is Fidelity.APPROXIMATE
    assert _note(t, "parallelism.pipeline_parallel_degree").fidelity is Fidelity.IGNORED
    assert _note(t, "parallelism.expert_parallel_degree").fidelity is Fidelity.UNSUPPORTED
    written = adapters.write(t.result, "torchtitan").result["parallelism"]
    assert (written["tensor_parallel_degree"], written["context_parallel_degree"]) == (8, 2)


@pytest.mark.parametrize("raw, key", [
    ({"training": {"local_batch_size": "x"}}, "training.local_batch_size"),
    ({"parallelism": {"fsdp_reshard_after_forward": "sometimes"}}, "parallelism.fsdp_reshard_after_forward"),
    ({"parallelism": {"data_parallel_shard_degree": 0}}, "parallelism.data_parallel_shard_degree"),
    ({"training": {"mixed_precision_param": "float16"}}, "training.mixed_precision_param"),
])  # fmt: skip
def test_what_torchtitan_refuses_is_refused_naming_the_key(raw, key):
    with pytest.raises(ConfigError) as exc:
        read(raw)
    assert any(p.path == key for p in exc.value.problems), exc.value.problems


def _dropped(t) -> dict:
    """The notes of the keys torchtitan 0.2.2 does not define: dropped, refused by torchtitan, so lossy."""
    notes = {n.source_path: n for n in t.notes if n.refused}
    assert all(n.fidelity is Fidelity.DROPPED and n.target_path is None and n.lossy for n in notes.values())
    return notes


def test_a_misspelt_key_is_read_as_dropped_with_a_did_you_mean_and_fails_strict():
    """torchtitan refuses a misspelt key; torsh reads the rest of the file and notes the key where it is, with the
    spelling torchtitan knows, and --strict fails on it (a fork may define a key torchtitan lacks)."""
    t = read({"parallelism": {"fsdp_reshard_after_forwrd": "never"}, "training": {"local_batch_size": 4}})
    (note,) = _dropped(t).values()
    assert note.source_path == "parallelism.fsdp_reshard_after_forwrd"
    assert "did you mean 'fsdp_reshard_after_forward'?" in note.reason and "0.2.2 refuses it" in note.reason
    assert (t.result.sharding.stage, t.result.batch.micro_batch_size) == (3, 4)  # the default reshard policy
    assert "fsdp_reshard_after_forwrd" not in adapters.write(t.result, "torchtitan").result.get("parallelism", {})
    with pytest.raises(LossyTranslationError):
        t.check(ErrorLevel.RAISE)


def test_a_file_made_of_keys_torchtitan_lacks_is_refused_key_by_key_even_with_from_torchtitan():
    """Another framework's file given as torchtitan is not read as a torchtitan file of defaults."""
    raw = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    with pytest.raises(ConfigError) as exc:
        read(raw)
    assert {p.path for p in exc.value.problems} == set(raw)
    with pytest.raises(ConfigError):
        read({"training": {"a": 1, "b": 2, "c": 3, "d": 4}})  # one known section, mostly unknown keys


def test_keys_torchtitan_dropped_since_2024_are_read_as_dropped_with_their_current_spelling():
    raw = tomllib.loads((CORPUS / "pytorch__torchtitan__2024__llama3_8b.toml").read_text("utf-8"))
    assert adapters.sniff(raw) == "torchtitan"
    t = read(raw)
    by_path = _dropped(t)
    assert "did you mean 'training.local_batch_size'?" in by_path["training.batch_size"].reason
    assert "'parallelism.data_parallel_shard_degree'" in by_path["training.data_parallel_shard_degree"].reason
    assert "quantize.linear.float8" in by_path["float8"].reason and "delete it" in by_path["model.norm_type"].reason
    # only the renamed keys: the file is recognised as torchtitan, not read as a torsh file of unknown keys
    assert all("torchtitan 0.2" in n.reason for n in by_path.values())
    assert t.result.model_dump() == read(_without_keys(raw, by_path)).result.model_dump()


def _without_keys(raw: dict, paths) -> dict:
    out = {}
    for key, value in raw.items():
        if key not in paths:
            inner = {k: v for k, v in value.items() if f"{key}.{k}" not in paths} if isinstance(value, dict) else value
            out[key] = inner
    return out


def test_every_key_of_a_real_file_is_kept_for_a_round_trip():
    path = CORPUS / "pytorch__torchtitan__llama3__llama3_8b.toml"
    raw = tomllib.loads(path.read_text("utf-8"))
    written = adapters.write(adapters.load(path).result, "torchtitan")
    assert not written.lossy
    leaves = lambda d, p="": {f"{p}{k}": v for k, v in d.items() if not isinstance(v, dict)} | {  # noqa: E731
        x: y for k, v in d.items() if isinstance(v, dict) for x, y in leaves(v, f"{p}{k}.").items()}
    out = leaves(written.result)
    assert {k: out.get(k) for k in leaves(raw)} == leaves(raw)


def test_selective_checkpointing_is_written_back_as_selective_and_elsewhere_as_whole_blocks():
    t = read({"activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"}})
    assert _note(t, "activation_checkpoint.mode").fidelity is Fidelity.APPROXIMATE
    assert adapters.write(t.result, "torchtitan").result["activation_checkpoint"]["mode"] == "selective"


def test_auto_values_of_a_hugging_face_deepspeed_config_are_not_written():
    cfg = adapters.read({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                         "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}, "deepspeed").result  # fmt: skip
    text = dump_text(adapters.write(cfg, "torchtitan").result, "toml")
    assert "auto" not in text


def test_ddp_needs_the_world_size_and_hsdp_a_dividing_group():
    ddp = adapters.read({"sharding": {"stage": 0}, "launch": {"world_size": 8}}, "torsh").result
    assert adapters.write(ddp, "torchtitan").result["parallelism"] == {"data_parallel_shard_degree": 1,
                                                                       "data_parallel_replicate_degree": 8}
    hsdp = adapters.read({"sharding": {"stage": 3, "hybrid_shard_size": 8}, "launch": {"world_size": 32}},
                         "torsh").result  # fmt: skip
    out = adapters.write(hsdp, "torchtitan").result["parallelism"]
    assert (out["data_parallel_shard_degree"], out["data_parallel_replicate_degree"]) == (8, 4)
    assert read({"parallelism": out}).result.sharding.hybrid_shard_size == 8


def test_sniffing_finds_torchtitan_files_and_leaves_fsdp_excerpts_to_the_fsdp_dialect():
    raw = tomllib.loads((CORPUS / "pytorch__torchtitan__llama3__debug_model.toml").read_text("utf-8"))
    assert adapters.sniff(raw) == "torchtitan"
    assert adapters.sniff({"parallelism": {"data_parallel_shard_degree": -1}}) == "fsdp"


def test_the_deepspeed_example_converts_to_its_golden():
    example = ROOT / "migration_examples" / "torchtitan"
    written = adapters.write(adapters.load(example / "zero3_bf16_offload.json").result, "torchtitan")
    check_golden(example / "zero3_bf16_offload.expected.toml", dump_text(written.result, "toml"))


def test_a_key_no_torchtitan_defines_is_noted_where_it_is_naming_the_forks_module():
    """A fork that extends torchtitan through its own custom_config_module: torsh cannot read that module, so each
    key torchtitan 0.2.2 lacks is a dropped note saying the module may define it; the rest of the file is read."""
    raw = {"job": {"custom_config_module": "mimi.job_config"}, "training": {"steps": 10, "task": "a2a"},
           "parallelism": {"data_parallel_shard_degree": 1, "data_parallel_replicate_degree": 4}}  # fmt: skip
    assert adapters.sniff(raw) == "torchtitan"
    t = read(raw)
    (note,) = _dropped(t).values()
    assert note.source_path == "training.task" and "'mimi.job_config'" in note.reason and "0.2.2" in note.reason
    assert t.result.sharding.stage == 0
    assert note.to_dict()["refused"] is True and note.to_dict()["fidelity"] == "dropped"
