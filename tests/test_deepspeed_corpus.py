"""Real DeepSpeed configs from public repositories (tests/fixtures/corpus/deepspeed, sources in SOURCES.md).

Each one reads with every key accounted for, survives DeepSpeed -> core -> DeepSpeed with the same meaning,
and its export is accepted by DeepSpeed 0.19.8's own config parser.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from adapter_validator import validate_identity

from torsh import adapters
from torsh.config import LRRangeTest, OneCycle, TorshConfig, WarmupCosineLR, WarmupDecayLR, WarmupLR
from torsh.deferred import Deferred
from torsh.formats import load_file, parse_text
from torsh.sharding_plan import DEEPSPEED_DEFAULTS
from torsh.translate import Fidelity

CORPUS = Path(__file__).parent / "fixtures" / "corpus" / "deepspeed"
#: Corpus files DeepSpeed 0.19.8 itself refuses, and the key it names: torsh refuses them too (a ConfigError).
#: (Open-Assistant's deepspeed_rl*.json: their fp16 "enabled": "true" is read as DeepSpeed's fp16 model reads it,
#: as true; their top-level "gradient_accumulation_steps": "8" DeepSpeed keeps as text and fails on.)
REFUSED = {"microsoft__DeepSpeedExamples__ds_zero_stage_infinity_config.json":
           "zero_optimization.stage3_param_persitance_threshold",
           "CarperAI__trlx__ds_config_gpt_j.json": "fp16.opt_level", "CarperAI__trlx__ds_config_gptj.json":
           "fp16.opt_level", "CarperAI__trlx__ds_config_trlx_gptj_summarize.json": "fp16.min_loss_scale",
           "EleutherAI__gpt-neox__small_tune.json": "zero_optimization.stage",
           "EleutherAI__gpt-neox__tune_1-3B.json": "fp16.fp16", "EleutherAI__gpt-neox__tune_6-7B.json":
           "zero_optimization.stage", "LAION-AI__Open-Assistant__deepspeed_rl.json": "gradient_accumulation_steps",
           "LAION-AI__Open-Assistant__deepspeed_rl_zero3.json": "gradient_accumulation_steps",
           "axolotl-ai-cloud__axolotl__zero1_torch_compile.json": "compile.disable",
           "axolotl-ai-cloud__axolotl__zero2_torch_compile.json": "compile.disable",
           "ymcui__Chinese-LLaMA-Alpaca__ds_zero2_no_offload.json": "fp16.min_loss_scale"}  # fmt: skip
ALL_FILES = sorted(p for p in CORPUS.iterdir() if p.name != "SOURCES.md")
FILES = [p for p in ALL_FILES if p.name not in REFUSED]


def load(path: Path) -> dict:
    # The corpus has a ".conf" DeepSpeed file: parse it as DeepSpeed does (hjson/JSON), not by suffix.
    return load_file(path)[0] if path.suffix in (".json", ".hjson") else parse_text(path.read_text("utf-8"), "json")


def test_corpus_is_large_and_every_file_has_a_source():
    sources = (CORPUS / "SOURCES.md").read_text("utf-8")
    assert len(ALL_FILES) >= 30
    assert all(f"| {p.name} |" in sources for p in ALL_FILES), [p.name for p in ALL_FILES
                                                                 if f"| {p.name} |" not in sources]  # fmt: skip


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_files_deepspeed_refuses_are_refused_naming_the_key(name, ds_config_class):
    from torsh.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        adapters.read(load(CORPUS / name), "deepspeed")
    assert exc.value.problems[0].path == REFUSED[name]
    with pytest.raises(Exception):  # noqa: B017 - DeepSpeed's own error type varies (pydantic, TypeError)
        ds_config_class(load(CORPUS / name))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem[:60])
def test_reads_with_every_key_accounted_for_and_round_trips(path):
    # Compared through the core model: both sides then hold DeepSpeed's effective values (defaults explicit),
    # so equality is semantic equality.
    validate_identity("deepspeed", load(path), expect_lossless=False,
                      normalise=lambda ds: adapters.read(ds, "deepspeed").result.model_dump())


def test_removed_and_unknown_keys_in_the_corpus_are_reported_not_fatal():
    notes = {p.name: adapters.read(load(p), "deepspeed").notes for p in FILES}
    removed = {(n.source_path, name) for name, ns in notes.items() for n in ns
               if n.fidelity is Fidelity.DROPPED and "removed" in n.reason}  # fmt: skip
    removed_keys = {k for k, _ in removed}
    assert {"compression_training", "sparse_attention", "curriculum_learning", "optimizer.type"} <= removed_keys
    unknown = {n.source_path for ns in notes.values() for n in ns if "unknown key" in n.reason}
    assert "cuda_visible_devices" in unknown


# ---- the real DeepSpeed parser ----------------------------------------------------------------------------

#: Values a trainer would fill for "auto" (DeepSpeed itself cannot parse "auto" batch sizes or optimizer args).
FILLED = {"optimizer.lr": 1e-4, "optimizer.betas": (0.9, 0.999), "optimizer.eps": 1e-8,
          "optimizer.weight_decay": 0.0, "gradients.clip_max_norm": 1.0, "scheduler.warmup_min_lr": 0.0,
          "scheduler.warmup_max_lr": 1e-4, "scheduler.warmup_num_steps": 10, "scheduler.total_num_steps": 100,
          "precision.param_dtype": "bf16",
          # DeepSpeed reads "auto" in its ZeRO sizes as its default (what torsh.initialize fills)
          **{f"sharding.buckets.{k}": v for k, v in DEEPSPEED_DEFAULTS.items()}}  # fmt: skip


def resolved(cfg: TorshConfig) -> TorshConfig:
    """``cfg`` with "auto" filled the way a trainer would, and a batch size when the file has none."""
    values = {p: FILLED[p] for p in cfg.deferred_paths() if not p.startswith("batch.")}
    if "precision.param_dtype" in values:  # an "auto" fp16 flag resolves to fp16 (or off), never to bf16
        flags = cfg.extensions.get("deepspeed", {})
        values["precision.param_dtype"] = "bf16" if "bf16.enabled" in flags or "bfloat16.enabled" in flags else "fp16"
    b = cfg.batch
    if any(isinstance(v, Deferred) for _, v in b) or (b.global_batch_size is None and b.micro_batch_size is None):
        gbs = b.global_batch_size if isinstance(b.global_batch_size, int) else 2
        values.update({"batch.global_batch_size": gbs, "batch.micro_batch_size": gbs,
                       "batch.gradient_accumulation_steps": 1})  # fmt: skip
    return cfg.resolve_deferred(values) if values else cfg


SCHEDULERS = {m.__name__: m for m in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}


@pytest.fixture(scope="module")
def ds_config_class():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is needed to check exports against its parser")
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig


def effective(ds) -> dict:
    """What a parsed DeepSpeedConfig will do, with FusedAdam's defaults and the Adam/AdamW spelling normalised."""
    opt = dict(ds.optimizer_params or {})
    name = ds.optimizer_name
    if name in ("adam", "adamw"):
        adamw = name == "adamw" or opt.pop("adam_w_mode", True)
        opt.pop("adam_w_mode", None)
        name = "adamw" if adamw else "adam"
        opt = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
               "weight_decay": 0.01 if opt.get("torch_adam") and adamw else 0.0, **opt}  # fmt: skip
        opt["betas"] = list(opt["betas"])
        opt.pop("bias_correction", None) if opt.get("bias_correction", True) is True else None
    fp16, bf16 = ds.float16_config.model_dump(), ds.bfloat16_config.model_dump()
    fp16, bf16 = (d if d["enabled"] else {"enabled": False} for d in (fp16, bf16))  # a disabled section is inert
    zero = ds.zero_config.model_dump()
    for legacy in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"):  # effect is in offload_*
        zero.pop(legacy, None)
    scheduler = dict(ds.scheduler_params or {})
    model = SCHEDULERS.get(ds.scheduler_name)
    if model is not None:  # DeepSpeed's constructor defaults, which the export writes out
        scheduler = {k: f.default for k, f in model.model_fields.items() if k != "name" and not f.is_required()
                     and f.default is not None} | scheduler  # fmt: skip
    return {
        "batch": (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps),
        "clip": ds.gradient_clipping, "zero": zero, "fp16": fp16, "bf16": bf16, "comm": ds.communication_data_type,
        "grad": (ds.prescale_gradients, ds.gradient_predivide_factor, ds.gradient_allreduce_op),
        "optimizer": (name, opt), "scheduler": (ds.scheduler_name, scheduler),
        "monitor": (ds.steps_per_print, ds.wall_clock_breakdown, ds.dataloader_drop_last),
        "checkpoint": ds.checkpoint_tag_validation_enabled,
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem[:60])
def test_export_is_accepted_by_deepspeed(path, ds_config_class):
    cfg = resolved(adapters.read(load(path), "deepspeed").result)
    exported = adapters.write(cfg, "deepspeed").result
    ds_config_class(exported)  # raises on anything DeepSpeed 0.19.8 rejects


#: DeepSpeed keys a trainer fills for "auto", and the core field the resolved value is taken from.
TRAINER_FILLED = {"train_batch_size": "batch.global_batch_size", "train_micro_batch_size_per_gpu":
                  "batch.micro_batch_size", "gradient_accumulation_steps": "batch.gradient_accumulation_steps",
                  "gradient_clipping": "gradients.clip_max_norm"}  # fmt: skip


def filled_like_a_trainer(raw: dict, cfg: TorshConfig) -> dict:
    """The raw file with its "auto" values replaced by the values ``cfg`` (resolved) holds."""
    out = {**raw}
    for key, core in TRAINER_FILLED.items():
        value = cfg.model_dump().get(core.split(".")[0], {}).get(core.split(".")[1])
        if (out.get(key) == "auto" or key not in out) and value is not None and key.startswith(("train", "grad")):
            out[key] = value
    for section, core in (("optimizer", cfg.optimizer), ("scheduler", cfg.scheduler)):
        if section in out and "params" in out[section]:
            params = out[section]["params"]
            out[section] = {**out[section], "params": {k: (getattr(core, k) if v == "auto" else v)
                                                      for k, v in params.items()}}  # fmt: skip
    for section in ("fp16", "bf16"):
        if isinstance(out.get(section), dict) and out[section].get("enabled") == "auto":
            out[section] = {**out[section], "enabled": cfg.precision.param_dtype == section}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem[:60])
def test_deepspeed_parses_original_and_export_to_the_same_settings(path, ds_config_class):
    cfg = resolved(adapters.read(load(path), "deepspeed").result)
    raw = filled_like_a_trainer(load(path), cfg)
    try:
        original = ds_config_class(raw)
    except Exception:  # noqa: BLE001 - removed keys, "auto" batch sizes: DeepSpeed itself rejects the file
        pytest.skip("DeepSpeed 0.19.8 itself rejects this file as written")
    if str(original.optimizer_name).lower() in ("onebitadam", "zerooneadam", "onebitlamb"):
        pytest.skip("DeepSpeed 0.19.8 parses this file but its engine rejects the removed 1-bit optimizer")
    exported = ds_config_class(adapters.write(cfg, "deepspeed").result)
    assert effective(exported) == effective(original)


@pytest.mark.slow
@pytest.mark.parametrize("removed", [{"amp": {"enabled": True, "opt_level": "O1"}}, {"elasticity": {"enabled": False}},
                                     {"progressive_layer_drop": {"enabled": True}}, {"sparse_gradients": True}])
def test_configs_with_removed_keys_export_to_something_deepspeed_accepts(removed, ds_config_class):
    raw = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "mics_shard_size": 4}, **removed}
    with pytest.raises(Exception, match="removed"):
        ds_config_class(raw)
    ds_config_class(adapters.write(adapters.read(raw, "deepspeed").result, "deepspeed").result)
