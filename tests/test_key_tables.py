"""Key tables generated from the frameworks themselves agree with the frameworks.

DeepSpeed: every numeric bound of ``schemas/deepspeed.schema.json`` is one DeepSpeed 0.19.8's own config parser
enforces (or one its engine fails on, listed with the reason), every bound of its pydantic config models is in the
schema, and every real DeepSpeed config that DeepSpeed accepts passes the schema. Accelerate, torchtitan and torchtune:
the checked-in tables under ``schemas/keys/`` are what their generators build from the installed framework, and our
readers do not refuse what the framework accepts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from torsh import adapters, schemas
from torsh.errors import ConfigError
from torsh.formats import load_file, parse_text

CORPUS = Path(__file__).parent / "fixtures" / "corpus"

# ---- DeepSpeed: bounds --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ds_config():
    """DeepSpeed 0.19.8's config parser, as ``deepspeed.initialize`` runs it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is needed to compare the schema with its parser")
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig


def _accepts(ds_config: Any, config: dict) -> bool:
    try:
        ds_config(config)
    except Exception:  # noqa: BLE001 - DeepSpeed raises AssertionError, pydantic errors, TypeError...
        return False
    return True


_BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")


def _schema_bounds(node: dict, path: tuple = ()) -> list[tuple[tuple, str, Any, str]]:
    """(key path, bound keyword, bound, JSON type) of every numeric bound in a schema."""
    found = [(path, k, node[k], node.get("type")) for k in _BOUNDS if k in node]
    for key, sub in node.get("properties", {}).items():
        found += _schema_bounds(sub, (*path, key))
    for branch in node.get("anyOf", []):
        found += _schema_bounds(branch, path)
    return found


def _property(schema: dict, path: tuple) -> dict:
    for key in path:
        schema = schema["properties"][key]
    return schema


def _config_with(path: tuple, value: Any) -> dict:
    """The smallest DeepSpeed config setting ``path`` to ``value`` (ZeRO keys under stage 3, where all apply)."""
    config: dict = {"train_micro_batch_size_per_gpu": 1}
    if path[0] == "zero_optimization":
        config["zero_optimization"] = {"stage": 3}
    if path[-2:-1] == ("offload_optimizer",) or path[-2:-1] == ("offload_param",):
        config["zero_optimization"][path[-2]] = {"device": "cpu"}
    node = config
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return config


def _beyond(keyword: str, bound: Any, json_type: str) -> Any:
    step = 1 if json_type == "integer" else 0.5
    return {"minimum": bound - step, "exclusiveMinimum": bound, "maximum": bound + step,
            "exclusiveMaximum": bound}[keyword]  # fmt: skip


def _within(keyword: str, bound: Any, json_type: str) -> Any:
    step = 1 if json_type == "integer" else 0.5
    return {"minimum": bound, "exclusiveMinimum": bound + step, "maximum": bound, "exclusiveMaximum": bound - step}[
        keyword]  # fmt: skip


def _bound_cases() -> list:
    schema = schemas.load("deepspeed")
    return [pytest.param(*case, id=".".join(case[0]) + f"-{case[1]}") for case in _schema_bounds(schema)]


@pytest.mark.parametrize(("path", "keyword", "bound", "json_type"), _bound_cases())
def test_a_value_the_schema_refuses_for_a_bound_deepspeed_refuses_too(path, keyword, bound, json_type, ds_config):
    """No false rejection: beyond each bound of the schema, DeepSpeed's own parser refuses the value as well (or its
    engine fails on it: the generator's RUNTIME_BOUNDS, each with the reason); at the bound, both accept it."""
    import jsonschema

    from torsh.schemas._generate_deepspeed import LENIENT_BOUNDS, RUNTIME_BOUNDS

    if ".".join(path) in LENIENT_BOUNDS:
        pytest.skip(f"the schema is wider than DeepSpeed here on purpose: {LENIENT_BOUNDS['.'.join(path)]}")
    field = jsonschema.Draft202012Validator(_property(schemas.load("deepspeed"), path))
    outside, inside = _beyond(keyword, bound, json_type), _within(keyword, bound, json_type)
    if not field.is_valid(outside):
        assert ".".join(path) in RUNTIME_BOUNDS or not _accepts(ds_config, _config_with(path, outside)), (
            f"the schema refuses {'.'.join(path)}={outside!r} but DeepSpeed 0.19.8 accepts it")
    assert field.is_valid(inside)
    assert _accepts(ds_config, _config_with(path, inside)), f"DeepSpeed refuses {'.'.join(path)}={inside!r}"


#: Where each DeepSpeed config model with bounded fields sits in a DeepSpeed config (None: not a training config key).
_MODEL_PATHS = {
    "DeepSpeedZeroConfig": ("zero_optimization",),
    "DeepSpeedZeroOffloadOptimizerConfig": ("zero_optimization", "offload_optimizer"),
    "DeepSpeedZeroOffloadParamConfig": ("zero_optimization", "offload_param"),
    "ZenFlowConfig": ("zero_optimization", "zenflow"),
    "HybridEngineConfig": ("hybrid_engine",),
    "DeepSpeedInferenceConfig": None,  # deepspeed.init_inference's argument, not a key of the training config
}


def _deepspeed_models() -> list:
    from pydantic import BaseModel

    seen, todo = [], list(BaseModel.__subclasses__())
    while todo:
        model = todo.pop()
        todo += model.__subclasses__()
        if model.__module__.startswith("deepspeed.") and model not in seen:
            seen.append(model)
    return seen


def test_every_bound_of_deepspeeds_config_models_is_in_the_schema(ds_config):
    """Every ``Field(ge/gt/le/lt)`` of every DeepSpeed pydantic config model is a bound of the schema: a bounded
    model the table does not place (a DeepSpeed upgrade) fails here."""
    from torsh.schemas._generate_deepspeed import BOUND_KEYWORDS, LENIENT_BOUNDS

    import deepspeed.runtime.zenflow.zenflow_config  # noqa: F401 - loads ZenFlowConfig
    import deepspeed.inference.config  # noqa: F401

    schema, checked = schemas.load("deepspeed"), 0
    for model in _deepspeed_models():
        for name, field in model.model_fields.items():
            bounds = {BOUND_KEYWORDS[a]: getattr(m, a) for m in field.metadata for a in BOUND_KEYWORDS
                      if getattr(m, a, None) is not None}  # fmt: skip
            if not bounds:
                continue
            assert model.__name__ in _MODEL_PATHS, f"{model.__name__}.{name} is bounded: place it in the schema"
            if _MODEL_PATHS[model.__name__] is None:
                continue
            for key in {name, field.alias} - {None}:
                if ".".join((*_MODEL_PATHS[model.__name__], key)) in LENIENT_BOUNDS:
                    continue
                node = _property(schema, (*_MODEL_PATHS[model.__name__], key))
                numeric = [b for b in node.get("anyOf", [node]) if b.get("type") in ("integer", "number")]
                assert any(bounds.items() <= b.items() for b in numeric), (model.__name__, key, bounds, node)
                checked += 1
    assert checked >= 20


#: Top-level sections whose schema is generated from a DeepSpeed pydantic model (the others DeepSpeed reads with
#: ``dict.get`` and checks no type of: the schema types them by the value DeepSpeed then uses).
_MODELLED = {"fp16", "bf16", "bfloat16", "weight_quantization", "zero_optimization", "tensorboard", "wandb",
             "csv_monitor", "comet", "comms_logger", "hybrid_engine", "compile", "tensor_parallel"}  # fmt: skip
#: Values of another JSON type that pydantic's lax mode turns into a boolean or a number (1 -> true, "1" -> 1): the
#: schema asks for the JSON type itself.
_COERCED = [0, 1, True, False, "true", "1"]
_PROBES = [*_COERCED, 2, -1, 0.5, "x", None, [], {}]


def _leaves(node: dict, path: tuple = ()) -> list[tuple[tuple, dict]]:
    if node.get("properties"):
        return [leaf for key, sub in node["properties"].items() for leaf in _leaves(sub, (*path, key))]
    return [(path, node)] if path else []


def test_a_value_the_schema_refuses_by_type_deepspeed_refuses_or_coerces(ds_config):
    """No false rejection by type in the sections DeepSpeed validates: a value of the wrong JSON type that DeepSpeed's
    models accept is only one pydantic coerces (1 or "true" for a boolean, "1" or true for a number)."""
    import jsonschema

    checked, coerced = 0, 0
    for path, node in _leaves(schemas.load("deepspeed")):
        if path[0] not in _MODELLED or "Removed" in node.get("description", ""):
            continue
        field = jsonschema.Draft202012Validator(node)
        for value in _PROBES:
            if field.is_valid(value) or not _accepts(ds_config, _config_with(path, value)):
                continue
            assert any(value == c and type(value) is type(c) for c in _COERCED), (
                f"the schema refuses {'.'.join(path)}={value!r} but DeepSpeed 0.19.8 accepts it")
            coerced += 1
        checked += 1
    assert checked >= 150 and coerced > 0


def test_null_batch_keys_are_unset_as_in_deepspeed(ds_config):
    """DeepSpeed derives a batch key written as null from the other two; the schema and the reader do the same."""
    raw = {"train_batch_size": None, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": None}
    assert _accepts(ds_config, dict(raw)) and schemas.check(raw, "deepspeed") == []
    assert adapters.read(raw, "deepspeed").result.batch.micro_batch_size == 2


def _corpus_files() -> list[Path]:
    return sorted(p for d in CORPUS.glob("deepspeed*") for p in d.iterdir() if p.name != "SOURCES.md")


def _load_ds(path: Path) -> dict:
    return load_file(path)[0] if path.suffix in (".json", ".hjson") else parse_text(path.read_text("utf-8"), "json")


def test_every_real_config_deepspeed_accepts_passes_the_schema(ds_config):
    """The corpus fed to DeepSpeed's own parser: none it accepts is refused by the schema."""
    accepted = [p for p in _corpus_files() if _accepts(ds_config, _load_ds(p))]
    refused = {p.name: schemas.check(_load_ds(p), "deepspeed") for p in accepted}
    assert not {name: problems for name, problems in refused.items() if problems}
    assert len(accepted) >= 20, len(accepted)  # most files hold "auto" (filled in by Hugging Face): not parsable


@pytest.mark.parametrize("config", [
    {"flops_profiler": {"enabled": True, "profile_step": -1}},
    {"flops_profiler": {"enabled": True, "top_modules": 0}},
    {"gradient_clipping": -1.0},
    {"steps_per_print": -1},
    {"gradient_predivide_factor": -2.0},
], ids=lambda c: str(c))  # fmt: skip
def test_values_deepspeed_accepts_pass_the_schema(config, ds_config):
    assert _accepts(ds_config, {"train_micro_batch_size_per_gpu": 1, **config})
    assert schemas.check({"train_micro_batch_size_per_gpu": 1, **config}, "deepspeed") == []


@pytest.mark.parametrize("config", [
    {"flops_profiler": {"enabled": True, "profile_step": -1}},
    {"flops_profiler": {"enabled": True, "top_modules": 0}},
    {"gradient_clipping": -1.0},
    {"steps_per_print": -1},
    {"gradient_predivide_factor": -2.0},
], ids=lambda c: str(c))  # fmt: skip
def test_the_deepspeed_reader_accepts_what_deepspeed_accepts(config):
    adapters.read({"train_micro_batch_size_per_gpu": 1, **config}, "deepspeed")


# ---- Accelerate ------------------------------------------------------------------------------------------------------

KEYS = Path(schemas.__file__).parent / "keys"


def _table(name: str) -> dict:
    import json

    return json.loads((KEYS / f"{name}.json").read_text("utf-8"))


def test_accelerate_table_matches_the_installed_accelerate():
    pytest.importorskip("accelerate", reason="Accelerate 1.15 is needed to regenerate its key table")
    from torsh.schemas._generate_accelerate_keys import build, render

    assert render(build()) == (KEYS / "accelerate.json").read_text("utf-8"), (
        "schemas/keys/accelerate.json is stale: python -m torsh.schemas._generate_accelerate_keys")


def test_a_top_level_key_accelerate_refuses_is_never_kept_or_written():
    """A key of the Accelerate dialect's map that is not in Accelerate's own table makes `accelerate launch` refuse
    the file ("unknown keys"): it must be read as dropped, never kept for a round trip or written (max_restarts,
    monitor_interval and num_cpu_threads_per_process were, as launcher flags mistaken for config keys)."""
    from torsh.adapters import accelerate
    from torsh.translate import Fidelity

    table = _table("accelerate")
    known = set(table["top_level"]) | set(table["sagemaker"]) | set(table["sections"])
    for key, meaning in accelerate.TOP_MAP.items():
        if key.split(".")[0] not in known:
            assert getattr(meaning, "fidelity", None) is Fidelity.DROPPED, key


def test_the_launch_reader_knows_every_accelerate_launch_option_and_its_arity():
    """Every option of `accelerate launch` (each spelling) is parsed with the same arity, and every destination has
    a meaning in the launch dialect: found missing by Accelerate's own Slurm example (`--mpirun_hostfile`)."""
    from torsh.adapters import _cmdline, launch

    table = _cmdline.LAUNCHER_FLAGS["accelerate"]
    options = _table("accelerate")["launch_options"]
    for dest, option in options.items():
        for flag in option["flags"]:
            name = _cmdline._normalise("accelerate", flag)
            assert name in table, flag
            assert table[name][1] == (1 if option["takes_value"] else 0), flag
    spelled = {_cmdline._normalise("accelerate", f) for option in options.values() for f in option["flags"]}
    assert set(table) <= spelled, set(table) - spelled  # nothing accelerate 1.15 does not have
    for name, (dest, _) in table.items():
        assert f"accelerate.{dest}" in launch.FIELD_MAP, name


def test_accelerate_launch_options_read_with_their_meaning():
    from torsh.adapters import launch
    from torsh.translate import Fidelity

    t = launch.read("accelerate launch --num_processes 4 --num_machines 2 --machine_rank 0 --main_process_ip h "
                    "--main_process_port 29500 --mpirun_hostfile hosts --fsdp_sharding_strategy FULL_SHARD "
                    "--tpu_use_sudo --env A=1 --env B=2 -t 3 train.py")  # fmt: skip
    notes = {n.source_path: n for n in t.notes}
    assert t.result.launch.hostfile == "hosts"
    assert notes["accelerate.fsdp_sharding_strategy"].fidelity is Fidelity.UNSUPPORTED
    assert notes["accelerate.tpu_use_sudo"].fidelity is Fidelity.IGNORED
    assert t.result.extensions["launch"]["accelerate.env"] == ["A=1", "B=2"]


#: A minimal valid file around a section's keys: the distributed_type under which Accelerate reads the section.
_ACCELERATE_BASE = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_processes": 2,
                    "mixed_precision": "no"}  # fmt: skip
_ACCELERATE_KIND = {"deepspeed_config": {"distributed_type": "DEEPSPEED"}, "fsdp_config": {"distributed_type": "FSDP"},
                    "megatron_lm_config": {"distributed_type": "MEGATRON_LM"}, "fp8_config": {"mixed_precision": "fp8"},
                    "parallelism_config": {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}},
                    "mpirun_config": {"distributed_type": "MULTI_CPU"}}  # fmt: skip


def _accelerate_cases() -> list:
    import json

    table, cases = _table("accelerate"), []
    for key, entry in table["top_level"].items():
        if "default" in entry:
            cases.append((f"{key}={json.dumps(entry['default'])}", {**_ACCELERATE_BASE, key: entry["default"]}))
    for section, spec in table["sections"].items():
        for key, entry in spec["keys"].items():
            raw = json.loads(json.dumps({**_ACCELERATE_BASE, **_ACCELERATE_KIND.get(section, {})}))
            raw[section] = {**raw.get(section, {}), key: entry.get("default")}
            cases.append((f"{section}.{key}={json.dumps(entry.get('default'))}", raw))
    return [pytest.param(raw, id=name) for name, raw in cases]


@pytest.mark.parametrize("raw", _accelerate_cases())
def test_the_accelerate_reader_accepts_every_key_of_the_table_at_its_default(raw):
    adapters.read(raw, "accelerate")


def _accelerate_files() -> list[Path]:
    return sorted(p for d in ("accelerate", "accelerate/configs") for p in (CORPUS / d).glob("*.y*ml"))


#: Section keys of real files that Accelerate 1.15 accepts without reading them (the launcher copies every section key
#: onto its arguments; nothing reads these): not in the table, and each one a key a reader should report as ignored.
ACCELERATE_IGNORED = {
    "deepspeed_config.seq_parallel_communication_data_type": "a DeepSpeed config key, not one Accelerate passes on",
    "mpirun_config.mpirun_ccl": "read by Accelerate 0.28 (oneCCL), by nothing in 1.15",
}


def test_every_real_accelerate_file_uses_only_keys_of_the_table():
    """The table is complete for real files: every key of every corpus file is in it (section keys with the prefix
    the launcher adds), or Accelerate ignores it (ACCELERATE_IGNORED), or Accelerate refuses the file."""
    import yaml

    table, unknown_top, unknown = _table("accelerate"), {}, set()
    top = set(table["top_level"]) | set(table["sagemaker"])
    for path in _accelerate_files():
        raw = yaml.safe_load(path.read_text("utf-8"))  # as Accelerate reads it (one file sets a key twice)
        for key, value in raw.items():
            if key not in top:
                unknown_top[path] = key
            elif key in table["sections"] and isinstance(value, dict):
                spec = table["sections"][key]
                prefix = spec["prefix_added_by_launcher"] or ""
                unknown |= {f"{key}.{k}" for k in value if k not in spec["keys"] and prefix + k not in spec["keys"]}
    assert len(_accelerate_files()) >= 50
    assert unknown == set(ACCELERATE_IGNORED), sorted(unknown)
    assert [p.name for p in unknown_top] == ["huggingface__accelerate__0_28_0_mpi.yaml"]
    pytest.importorskip("accelerate", reason="Accelerate 1.15 is needed to check it refuses unknown top-level keys")
    from accelerate.commands.config.config_args import ClusterConfig

    for path, key in unknown_top.items():
        with pytest.raises(ValueError, match=key):
            ClusterConfig.from_yaml_file(path)


@pytest.mark.parametrize("key", [
    "deepspeed_config.seq_parallel_communication_data_type",
    "mpirun_config.mpirun_ccl",
])  # fmt: skip
def test_the_accelerate_reader_does_not_refuse_a_section_key_accelerate_ignores(key):
    section, name = key.split(".")
    raw = {**_ACCELERATE_BASE, **_ACCELERATE_KIND.get(section, {})}
    raw[section] = {**raw.get(section, {}), name: "bf16"}
    adapters.read(raw, "accelerate")


# ---- torchtitan and torchtune: read from their source, never imported ----------------------------------------------


def _installed(name: str, version: str) -> None:
    """Skip unless ``name`` is installed (``make venv`` installs it with --no-deps: only its source is read)."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} {version} is not installed (pip install --no-deps {name}=={version})")
    installed = importlib.metadata.version(name)
    assert installed == version, f"{name} {installed} is installed; the table is from {version}"


def test_torchtitan_table_matches_the_installed_torchtitan():
    _installed("torchtitan", "0.2.2")
    from torsh.schemas._generate_torchtitan_keys import build, render

    assert render(build()) == (KEYS / "torchtitan.json").read_text("utf-8"), (
        "schemas/keys/torchtitan.json is stale: python -m torsh.schemas._generate_torchtitan_keys")


def test_torchtune_table_matches_the_installed_torchtune():
    _installed("torchtune", "0.6.1")
    from torsh.schemas._generate_torchtune_keys import build, render

    assert render(build()) == (KEYS / "torchtune.json").read_text("utf-8"), (
        "schemas/keys/torchtune.json is stale: python -m torsh.schemas._generate_torchtune_keys")


def _leaf_keys(data: dict, prefix: str = "") -> list[tuple[str, str]]:
    """(section, key) of every value of a TOML document; nested tables are dotted sections."""
    out = []
    for key, value in data.items():
        if isinstance(value, dict):
            out += _leaf_keys(value, f"{prefix}{key}.")
        else:
            out.append((prefix.rstrip("."), key))
    return out


#: torchtitan files whose run line (not the file) names the extension module (torchtitan's own scripts pass
#: --job.custom_config_module for them).
TORCHTITAN_EXTENSION_ON_COMMAND_LINE = {
    "pytorch__torchtitan__transformers_modeling_backend__debug_model.toml":
        "torchtitan.experiments.transformers_modeling_backend.job_config",
    "pytorch__torchtitan__transformers_modeling_backend__full.toml":
        "torchtitan.experiments.transformers_modeling_backend.job_config",
}  # fmt: skip
#: Keys of the 2024 files (torchtitan before its first release) that 0.2.2 no longer defines and so refuses.
TORCHTITAN_2024_KEYS = {
    "job.use_for_integration_test", "metrics.enable_color_printing", "model.norm_type", "training.batch_size",
    "training.warmup_steps", "training.data_parallel_replicate_degree", "training.data_parallel_shard_degree",
    "training.tensor_parallel_degree", "training.compile", "experimental.context_parallel_degree",
    "experimental.pipeline_parallel_degree", "experimental.enable_async_tensor_parallel",
    "checkpoint.enable_checkpoint", "checkpoint.interval_type", "checkpoint.model_weights_only",
    "float8.enable_float8_linear",
}  # fmt: skip


def test_every_real_torchtitan_file_uses_only_keys_of_the_table():
    """Complete for real files: every key of every corpus TOML of torchtitan's is one torchtitan 0.2.2 defines (with the
    extension module the file or its run line names), except keys of the 2024 files that torchtitan itself dropped;
    the forks' files hold keys of their own. Those keys, and only they, are the reader's dropped notes."""
    import tomllib

    table, unknown = _table("torchtitan"), {}
    files = sorted((CORPUS / "torchtitan").glob("*.toml"))
    for path in files:
        raw = tomllib.loads(path.read_text("utf-8"))
        module = raw.get("job", {}).get("custom_config_module") or TORCHTITAN_EXTENSION_ON_COMMAND_LINE.get(path.name)
        module = table["extension_aliases"].get(module, module)
        known = {section: set(keys) for section, keys in table["sections"].items()}
        for section, keys in table["extensions"].get(module, {}).items():
            known.setdefault(section, set()).update(keys)
        unknown[path.name] = {f"{s}.{k}".lstrip(".") for s, k in _leaf_keys(raw) if k not in known.get(s, ())}
    assert len(files) >= 25
    old = {name: keys for name, keys in unknown.items() if "__2024__" in name}
    assert len(old) == 4 and set().union(*old.values()) == TORCHTITAN_2024_KEYS
    forks = {name for name in unknown if not name.startswith("pytorch__torchtitan__")}  # with keys of their own
    assert len(forks) == 3 and all(unknown[name] for name in forks)
    assert not {name: keys for name, keys in unknown.items() if keys and name not in old and name not in forks}
    # the reader reads every file, and its dropped notes are exactly the keys outside the table
    for path in files:
        noted = {n.source_path for n in adapters.load(path).notes if n.refused}
        under = {key for key in unknown[path.name] if any(key == n or key.startswith(n + ".") for n in noted)}
        assert under == unknown[path.name] and all(any(k == n or k.startswith(n + ".") for k in under) for n in noted)


def test_torchtitan_table_has_the_distributed_keys():
    parallelism = _table("torchtitan")["sections"]["parallelism"]
    assert parallelism["fsdp_reshard_after_forward"]["choices"] == ["default", "always", "never"]
    assert parallelism["data_parallel_shard_degree"]["default"] == -1
    assert _table("torchtitan")["sections"]["training"]["mixed_precision_param"]["choices"] == ["bfloat16", "float32"]


#: Recipes the corpus names that torchtune 0.6.1 does not have (the file is from torchtune's main branch).
TORCHTUNE_LATER_RECIPES = {"dev/async_grpo_full_finetune_distributed"}
#: Keys of real recipe configs that torchtune 0.6.1's recipes do not read (torchtune ignores them), and why.
TORCHTUNE_NOT_READ = {
    "run_val_every_n_steps": "validation during training: torchtune's main branch after 0.6.1",
    "dataset_val": "validation during training: torchtune's main branch after 0.6.1",
    "batch_size_val": "validation during training: torchtune's main branch after 0.6.1",
    "data_parallel_shard_dim": "HSDP degrees: torchtune's main branch after 0.6.1",
    "data_parallel_replicate_dim": "HSDP degrees: torchtune's main branch after 0.6.1",
    "log_level": "read by the generation recipes (dev/generate_v2*) only",
    "optimizer_in_bwd": "read by the full-finetune recipes only; the LoRA configs set it anyway",
    "fsdp": "a section of older configs (fsdp.cpu_offload); 0.6.1 reads fsdp_cpu_offload",
    "output_dir": "the generation recipe writes nothing",
    "use_distributed_state_dict": "the Llama 4 generation config: torchtune's main branch after 0.6.1",
    "use_flex": "the Llama 4 generation config: torchtune's main branch after 0.6.1",
    "name": "the GRPO config's run name, read by no recipe",
    "base_model_path": "the GRPO config's interpolation variable (${base_model_path})",
}  # fmt: skip


def _torchtune_recipe(text: str) -> str | None:
    """The recipe a config is for, as its header says (``tune run ... full_finetune_distributed``, or ``Config for
    ... in full_finetune_distributed.py``)."""
    import re

    found = re.search(r"tune run[^\n]*?\b((?:dev/)?\w*distributed\w*)", text) or re.search(
        r"\A#[^\n]* in ((?:dev/)?\w+)\.py", text)
    return found.group(1) if found else None


def test_every_real_torchtune_file_uses_only_keys_its_recipe_reads():
    """Complete for real files: every top-level key of every corpus recipe config (and every key of a section the
    recipe reads key by key) is one its torchtune 0.6.1 recipe reads, or one listed in TORCHTUNE_NOT_READ."""
    import yaml

    recipes, not_read = _table("torchtune")["recipes"], set()
    files = sorted((CORPUS / "torchtune").glob("*.yaml"))
    for path in files:
        text = path.read_text("utf-8")
        recipe = _torchtune_recipe(text)
        assert recipe, path.name
        if recipe in TORCHTUNE_LATER_RECIPES:
            continue
        keys = recipes[recipe]
        for key, value in yaml.safe_load(text).items():
            if key not in keys:
                not_read.add(key)
            elif isinstance(value, dict) and any(k.startswith(f"{key}.") for k in keys) and not keys[key].get(
                    "component"):  # a section read key by key
                not_read |= {f"{key}.{sub}" for sub in value if f"{key}.{sub}" not in keys}
    assert len(files) >= 40
    assert not_read == set(TORCHTUNE_NOT_READ), sorted(not_read ^ set(TORCHTUNE_NOT_READ))


def test_torchtune_table_has_the_distributed_keys():
    full = _table("torchtune")["recipes"]["full_finetune_distributed"]
    assert full["fsdp_cpu_offload"] == {"default": False}
    assert full["fsdp_reshard_after_forward"] == {"default": True}
    assert full["enable_activation_checkpointing"] == {"default": False}
    assert full["dtype"] == {"required": True} and full["optimizer"]["component"]
    assert "lora_finetune_distributed" in _table("torchtune")["recipes"]


# ---- the torchtitan and torchtune readers against the tables (once those dialects exist) ----------------------------


def _dialect(name: str) -> None:
    if name not in adapters.names():
        pytest.skip(f"no {name} dialect in torsh.adapters yet")


def _refused(cases: dict[str, dict], dialect: str) -> dict[str, str]:
    """The cases (a key set on a real file) the reader refuses, with its first problem."""
    refused = {}
    for name, raw in cases.items():
        try:
            adapters.read(raw, dialect)
        except ConfigError as exc:
            refused[name] = str(exc.problems[0])
    return refused


def test_the_torchtitan_reader_accepts_every_key_of_the_table_at_its_default():
    """Each key torchtitan 0.2.2 defines, set to its default on a real job config: none is refused."""
    import copy
    import tomllib

    _dialect("torchtitan")
    base = tomllib.loads((CORPUS / "torchtitan" / "pytorch__torchtitan__llama3__debug_model.toml").read_text("utf-8"))
    cases = {}
    for section, keys in _table("torchtitan")["sections"].items():
        for key, entry in keys.items():
            default = entry.get("default")
            if default is None or isinstance(default, dict):  # TOML has no null; an expression is not a value
                continue
            raw = copy.deepcopy(base)
            node = raw
            for part in section.split("."):
                node = node.setdefault(part, {})
            node[key] = default
            cases[f"{section}.{key}"] = raw
    assert len(cases) >= 100
    assert not _refused(cases, "torchtitan")


def test_the_torchtune_reader_accepts_every_optional_key_of_its_recipe_at_its_default():
    """Each optional key full_finetune_distributed and lora_finetune_distributed read (``cfg.get(key, default)``),
    set to that default on a real recipe config of that recipe: none is refused."""
    import copy

    import yaml

    _dialect("torchtune")
    cases = {}
    for recipe, file in (("full_finetune_distributed", "pytorch__torchtune__llama3_2__1B_full.yaml"),
                         ("lora_finetune_distributed", "pytorch__torchtune__llama3_2__1B_lora.yaml")):  # fmt: skip
        base = yaml.safe_load((CORPUS / "torchtune" / file).read_text("utf-8"))
        for key, entry in _table("torchtune")["recipes"][recipe].items():
            if "." in key or "default" not in entry or isinstance(entry["default"], dict):
                continue
            raw = copy.deepcopy(base)
            raw[key] = entry["default"]
            cases[f"{recipe}: {key}"] = raw
    assert len(cases) >= 30
    assert not _refused(cases, "torchtune")


# ---- Horovod: read from its source distribution (it does not build against current torch) ------------------------


def _horovod_sdist():
    import sys

    path = Path(sys.prefix) / "sdist" / "horovod-0.28.1.tar.gz"
    if not path.exists():
        pytest.skip("Horovod 0.28.1's source distribution is not downloaded (make venv does: pip download --no-deps "
                    "--no-binary :all: horovod==0.28.1 -d .venv/sdist)")
    return path


def test_horovod_table_matches_horovods_source():
    from torsh.schemas._generate_horovod_keys import build, render

    assert render(build(_horovod_sdist())) == (KEYS / "horovod.json").read_text("utf-8"), (
        "schemas/keys/horovod.json is stale: python -m torsh.schemas._generate_horovod_keys")


def test_the_horovod_reader_knows_every_config_key_and_variable_of_the_table():
    from torsh.adapters import horovod

    table = _table("horovod")["config_keys"]
    tunables = {t.yaml: t.env for t in horovod.TUNABLES}
    assert set(tunables) | {"controller"} == set(table)
    assert {k: tunables[k] for k in tunables} == {k: v["env"] for k, v in table.items() if k in tunables}


def test_the_launch_reader_knows_every_horovodrun_option():
    """Every option horovodrun 0.28.1 defines is read; ours beyond them are argparse abbreviations horovodrun
    accepts (``--slots`` for ``--slots-per-host``)."""
    from torsh.adapters import _cmdline

    flags, ours = _table("horovod")["flags"], _cmdline._HOROVODRUN_FLAGS
    assert not set(flags) - set(ours)
    for extra in set(ours) - set(flags):
        assert len([f for f in flags if f.startswith(extra)]) == 1, extra
