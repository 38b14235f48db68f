"""The core model: section validation, typed errors, batch resolution, "auto"."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from torsh.config import AUTO, BatchConfig, TorshConfig
from torsh.deferred import Deferred
from torsh.errors import ConfigError


def problems(data: dict) -> dict[str, object]:
    with pytest.raises(ConfigError) as exc:
        TorshConfig.from_dict(data)
    return {p.path: p for p in exc.value.problems}


# ---- every section rejects bad values and unknown keys with the right dotted path ------------

BAD_VALUES = [
    ({"batch": {"micro_batch_size": 0}}, "batch.micro_batch_size"),
    ({"batch": {"global_batch_size": "eight"}}, "batch.global_batch_size"),
    ({"sharding": {"stage": 4}}, "sharding.stage"),
    ({"sharding": {"wrap": {"min_num_params": -5}}}, "sharding.wrap.min_num_params"),
    ({"ddp": {"bucket_cap_mb": 0}}, "ddp.bucket_cap_mb"),
    ({"precision": {"param_dtype": "int8"}}, "precision.param_dtype"),
    ({"precision": {"loss_scaling": {"backoff_factor": 2.0}}}, "precision.loss_scaling.backoff_factor"),
    ({"offload": {"optimizer": "disk"}}, "offload.optimizer"),
    ({"optimizer": {"name": "AdamW", "lr": -1}}, "optimizer.lr"),
    ({"scheduler": {"name": "WarmupLR", "warmup_type": "cosine"}}, "scheduler.warmup_type"),
    ({"scheduler": {"name": "WarmupDecayLR"}}, "scheduler.total_num_steps"),
    ({"gradients": {"reduce_op": "max"}}, "gradients.reduce_op"),
    ({"compression": {"method": "quantize", "bits": 3}}, "compression.bits"),
    ({"activation_checkpointing": {"enabled": "sometimes"}}, "activation_checkpointing.enabled"),
    ({"communication": {"backend": "infiniband"}}, "communication.backend"),
    ({"launch": {"master_port": 70000}}, "launch.master_port"),
    ({"launch": {"hosts": [{"name": "a", "slots": 0}]}}, "launch.hosts.0.slots"),
    ({"checkpoint": {"tag_validation": "maybe"}}, "checkpoint.tag_validation"),
    ({"monitoring": {"steps_per_print": 0}}, "monitoring.steps_per_print"),
    ({"pipeline": {"schedule": "zigzag"}}, "pipeline.schedule"),
    ({"data": {"num_workers": -1}}, "data.num_workers"),
]


@pytest.mark.parametrize(("data", "path"), BAD_VALUES, ids=[p for _, p in BAD_VALUES])
def test_bad_value_names_dotted_path(data, path):
    found = problems(data)
    assert path in found, found
    assert found[path].reason


UNKNOWN = [
    ({"batch": {"micro_batchsize": 4}}, "batch.micro_batchsize", "micro_batch_size"),
    ({"sharding": {"stages": 2}}, "sharding.stages", "stage"),
    ({"ddp": {"bucket_size_mb": 25}}, "ddp.bucket_size_mb", "bucket_cap_mb"),
    ({"precision": {"param_type": "bf16"}}, "precision.param_type", "param_dtype"),
    ({"precision": {"loss_scaling": {"hysterisis": 2}}}, "precision.loss_scaling.hysterisis", "hysteresis"),
    ({"offload": {"param": "cpu"}}, "offload.param", "params"),
    ({"optimizer": {"name": "SGD", "momentom": 0.9}}, "optimizer.momentom", "momentum"),
    ({"scheduler": {"name": "WarmupLR", "warmup_num_step": 10}}, "scheduler.warmup_num_step", "warmup_num_steps"),
    ({"gradients": {"clip_max_nrom": 1.0}}, "gradients.clip_max_nrom", "clip_max_norm"),
    ({"compression": {"methods": "fp16"}}, "compression.methods", "method"),
    ({"activation_checkpointing": {"enable": True}}, "activation_checkpointing.enable", "enabled"),
    ({"communication": {"backnd": "gloo"}}, "communication.backnd", "backend"),
    ({"launch": {"nnode": 2}}, "launch.nnode", "nnodes"),
    ({"checkpoint": {"directory": "x"}}, "checkpoint.directory", None),
    ({"monitoring": {"tensorbord": {}}}, "monitoring.tensorbord", "tensorboard"),
    ({"parallelism": {"dp_replicas": 2}}, "parallelism.dp_replicas", "dp_replicate"),
    ({"data": {"droplast": True}}, "data.droplast", "drop_last"),
    ({"precison": {}}, "precison", "precision"),
]


@pytest.mark.parametrize(("data", "path", "suggestion"), UNKNOWN, ids=[p for _, p, _ in UNKNOWN])
def test_unknown_key_is_an_error_with_suggestion(data, path, suggestion):
    found = problems(data)
    assert path in found, found
    assert found[path].suggestion == suggestion
    assert "unknown key" in found[path].reason


def test_several_problems_are_reported_together():
    found = problems({"sharding": {"stage": 9}, "ddp": {"bucket_cap_mb": -1}, "gradients": {"clip": 1}})
    assert set(found) == {"sharding.stage", "ddp.bucket_cap_mb", "gradients.clip"}
    message = str(ConfigError(list(found.values())))
    assert message.startswith("3 problems:")


@pytest.mark.parametrize(("data", "needle"), [
    ({"sharding": {"stage": 1, "reshard_after_forward": True}}, "needs sharding.stage 2 or 3"),
    ({"sharding": {"stage": 0, "hybrid_shard_size": 8}}, "needs sharding.stage 2 or 3"),
    ({"offload": {"params": "cpu"}}, "offload.params='cpu' needs sharding.stage 2 or 3"),
    ({"offload": {"optimizer": "nvme"}}, "offload.nvme_path is required"),
    ({"compression": {"method": "fp16", "ratio": 0.1}}, "compression.ratio is read only when"),
    ({"compression": {"method": "topk"}}, "compression.ratio is required"),
    ({"precision": {"autocast": True}}, "precision.autocast needs"),
    ({"precision": {"loss_scaling": {"mode": "static"}}}, "static_scale is required"),
    ({"launch": {"nnodes": 4, "max_nnodes": 2}}, "launch.max_nnodes (2) is smaller"),
])  # fmt: skip
def test_cross_field_rules(data, needle):
    with pytest.raises(ConfigError) as exc:
        TorshConfig.from_dict(data)
    assert needle in str(exc.value)


def test_dtype_spellings_are_normalised():
    cfg = TorshConfig.from_dict({"precision": {"param_dtype": "torch.bfloat16", "reduce_dtype": "float32",
                                               "buffer_dtype": "half"}})  # fmt: skip
    assert (cfg.precision.param_dtype, cfg.precision.reduce_dtype, cfg.precision.buffer_dtype) == ("bf16", "fp32", "fp16")


def test_every_field_is_documented_and_none_defaults_are_none():
    def walk(model: type[BaseModel], prefix: str):
        for name, info in model.model_fields.items():
            yield f"{prefix}{name}", info
            for arg in (info.annotation, *getattr(info.annotation, "__args__", ())):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    yield from walk(arg, f"{prefix}{name}.")

    undocumented = [path for path, info in walk(TorshConfig, "") if not info.description]
    assert not undocumented
    # TOML has no null: a field that accepts None must default to None, or a None would be lost on write.
    for path, info in walk(TorshConfig, ""):
        args = getattr(info.annotation, "__args__", ())
        if type(None) in args and not info.is_required():
            assert info.default is None, path



def test_field_descriptions_are_the_attribute_docstrings_pydantic_itself_reads():
    # core/config.py reads its attribute docstrings in one pass over the file at import; pydantic's own reader,
    # class by class, must find the same text for every model of the module, and the one pass must find it all
    # (a field it cannot read falls back to pydantic's slow reader: correct, but the import gets slower).
    # The models are in torsh.config and the section modules it imports them from (each installs the reader).
    import sys

    import torsh.config
    from pydantic._internal._docs_extraction import extract_docstrings_from_cls

    models = [m for m in vars(torsh.config).values() if isinstance(m, type) and issubclass(m, BaseModel)
              and m.__module__.startswith("torsh.config")]  # fmt: skip
    assert len(models) > 25 and len({m.__module__ for m in models}) > 1
    for model in models:
        module = sys.modules[model.__module__]
        fast = torsh.config._attribute_docstrings(Path(module.__file__).read_text(encoding="utf-8"))
        expected = extract_docstrings_from_cls(model, use_inspect=True)
        assert {name: f.description for name, f in model.model_fields.items()} == expected, model.__name__
        assert fast[model.__name__] == expected, model.__name__

# ---- batch resolution: DeepSpeed 0.19.8's six cases, floor division, its error texts ---------

@pytest.mark.parametrize("world", [1, 2, 8])
def test_batch_six_cases(world):
    def r(**kw):
        b = BatchConfig(**kw).resolve(world)
        return b.global_batch_size, b.micro_batch_size, b.gradient_accumulation_steps

    assert r(global_batch_size=16 * world, micro_batch_size=4, gradient_accumulation_steps=4) == (16 * world, 4, 4)
    assert r(global_batch_size=16 * world, micro_batch_size=4) == (16 * world, 4, 4)
    assert r(global_batch_size=16 * world, gradient_accumulation_steps=2) == (16 * world, 8, 2)
    assert r(micro_batch_size=4, gradient_accumulation_steps=3) == (12 * world, 4, 3)
    assert r(global_batch_size=8 * world) == (8 * world, 8, 1)
    assert r(micro_batch_size=5) == (5 * world, 5, 1)


@pytest.mark.parametrize("kw", [{}, {"gradient_accumulation_steps": 4}])
def test_batch_needs_one_size(kw):
    with pytest.raises(ConfigError, match="Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"):
        BatchConfig(**kw).resolve(2)


@pytest.mark.parametrize(("kw", "world", "message"), [
    # floor division leaves a remainder: DeepSpeed's own example (tbs=7, gas=2, W=1)
    ({"global_batch_size": 7, "gradient_accumulation_steps": 2}, 1,
     "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * "
     "world_size 7 != 3 * 2 * 1"),
    ({"global_batch_size": 32, "micro_batch_size": 4, "gradient_accumulation_steps": 2}, 2,
     "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 32 != 4 * 2 * 2"),
    ({"global_batch_size": 30, "micro_batch_size": 4}, 8, "Gradient accumulation steps: 0 has to be greater than 0"),
    ({"global_batch_size": 4}, 8, "Micro batch size per gpu: 0 has to be greater than 0"),
])  # fmt: skip
def test_batch_inconsistent_values_use_deepspeed_text(kw, world, message):
    with pytest.raises(ConfigError) as exc:
        BatchConfig(**kw).resolve(world)
    assert message in str(exc.value)


def test_batch_auto_must_be_resolved_first():
    batch = BatchConfig(micro_batch_size="auto", gradient_accumulation_steps=2)
    with pytest.raises(ConfigError, match='batch.micro_batch_size: is "auto"'):
        batch.resolve(2)


# ---- "auto" --------------------------------------------------------------------------------------

def test_deferred_is_kept_and_resolvable():
    cfg = TorshConfig.from_dict({"batch": {"micro_batch_size": "auto"}, "ddp": {"bucket_cap_mb": "auto"},
                                 "optimizer": {"name": "AdamW", "lr": "auto", "weight_decay": "auto"},
                                 "scheduler": {"name": "WarmupDecayLR", "total_num_steps": "auto"}})  # fmt: skip
    assert cfg.batch.micro_batch_size is AUTO and isinstance(cfg.optimizer.lr, Deferred)
    assert sorted(cfg.deferred_paths()) == sorted(["batch.micro_batch_size", "ddp.bucket_cap_mb", "optimizer.lr",
                                                   "optimizer.weight_decay", "scheduler.total_num_steps"])
    dumped = cfg.model_dump(mode="json")
    assert dumped["optimizer"]["lr"] == "auto" and dumped["scheduler"]["total_num_steps"] == "auto"
    resolved = cfg.resolve_deferred({"batch.micro_batch_size": 8, "optimizer.lr": 3e-4})
    assert resolved.batch.micro_batch_size == 8 and resolved.optimizer.lr == 3e-4
    assert "optimizer.lr" not in resolved.deferred_paths() and cfg.optimizer.lr is AUTO  # the original is unchanged
    with pytest.raises(ConfigError, match="batch.micro_batch_size"):
        cfg.resolve_deferred({"batch.micro_batch_size": -1})


def test_auto_is_only_accepted_where_deferrable():
    found = problems({"sharding": {"stage": "auto"}, "offload": {"params": "auto"}})
    assert set(found) == {"sharding.stage", "offload.params"}


def test_torch_scheduler_passthrough_and_effective_reshard():
    cfg = TorshConfig.from_dict({"scheduler": {"name": "CosineAnnealingLR", "kwargs": {"T_max": 10}},
                                 "sharding": {"stage": 3}})  # fmt: skip
    assert cfg.scheduler.kwargs == {"T_max": 10}
    assert cfg.sharding.effective_reshard_after_forward is True
    assert TorshConfig.from_dict({"sharding": {"stage": 2}}).sharding.effective_reshard_after_forward is False
    assert TorshConfig().sharding.effective_reshard_after_forward is None
