"""``torsh.initialize``: DeepSpeed's signature, config sources, return rules and "auto" resolution."""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import _engine_harness as h  # noqa: E402
import torsh  # noqa: E402
from torsh.config import TorshConfig, WrapPolicy  # noqa: E402
from torsh.errors import ConfigError  # noqa: E402

DEEPSPEED_ORDER = ["args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                   "distributed_port", "mpu", "dist_init_required", "collate_fn", "config", "mesh_param",
                   "config_params"]  # fmt: skip


def test_signature_is_deepspeeds():
    params = inspect.signature(torsh.initialize).parameters
    assert list(params) == DEEPSPEED_ORDER
    assert all(p.default is None for n, p in params.items() if n != "distributed_port")
    assert params["distributed_port"].default == 29500


def test_import_torsh_stays_torch_free():
    code = "import sys, torsh; assert 'torch' not in sys.modules; assert callable(torsh.initialize); print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "ok\n"


def test_add_config_arguments_like_deepspeed():
    args = torsh.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed_config", "ds.json"])
    assert args.deepspeed_config == "ds.json" and args.deepspeed is False and args.deepscale_config is None


# ---- config sources ------------------------------------------------------------------------------

def test_config_sources(tmp_path):
    from torsh.engine.initialize import load_config

    native = {"batch": {"micro_batch_size": 4}, "sharding": {"stage": 3}}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(native))
    assert load_config(None, None, native)[0].sharding.stage == 3  # config_params
    assert load_config(argparse.Namespace(deepspeed_config=str(path)), None, None)[0].batch.micro_batch_size == 4
    cfg = TorshConfig.from_dict(native)
    assert load_config(None, cfg, None) == (cfg, None)
    with pytest.raises(ConfigError, match="give the config once"):
        load_config(argparse.Namespace(deepspeed_config=str(path)), native, None)
    with pytest.raises(ConfigError, match="needs a config"):
        load_config(None, None, None)


# ---- "auto" -------------------------------------------------------------------------------------

def _resolve(cfg, **kw):
    from torsh.engine.auto import resolve_auto

    kw.setdefault("optimizer", None)
    kw.setdefault("training_data", None)
    return resolve_auto(TorshConfig.from_dict(cfg), model=h.build_model(), world_size=2, **kw)


def test_auto_batch_comes_from_the_dataloader_or_fails_clearly():
    auto = {"batch": {"micro_batch_size": "auto", "global_batch_size": "auto", "gradient_accumulation_steps": 2}}
    with pytest.raises(ConfigError, match="batch.micro_batch_size: needs the data"):
        _resolve(auto)
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=3)
    cfg, batch, values = _resolve(auto, training_data=loader)
    assert (batch.micro_batch_size, batch.gradient_accumulation_steps, batch.global_batch_size) == (3, 2, 12)
    assert "DataLoader" in values["batch.micro_batch_size"][1]


def test_auto_bucket_lr_and_clipping():
    cfg = {"batch": {"micro_batch_size": 1}, "ddp": {"bucket_cap_mb": "auto"},
           "optimizer": {"name": "AdamW", "lr": "auto", "betas": "auto"}, "gradients": {"clip_max_norm": "auto"},
           "scheduler": {"name": "WarmupLR", "warmup_max_lr": "auto", "warmup_num_steps": 10}}  # fmt: skip
    with pytest.raises(ConfigError, match="optimizer.lr: needs an optimizer"):
        _resolve(cfg)
    passed = torch.optim.AdamW(h.build_model().parameters(), lr=0.003, betas=(0.8, 0.9))
    resolved, _, values = _resolve(cfg, optimizer=passed)
    assert resolved.optimizer.lr == 0.003 and resolved.optimizer.betas == (0.8, 0.9)
    assert resolved.scheduler.warmup_max_lr == 0.003
    assert resolved.gradients.clip_max_norm == 1.0
    assert resolved.ddp.bucket_cap_mb == pytest.approx(32 * 32 * 4 / 2**20)  # widest 2-D weight of TinyLM: 32
    assert all(source for _, source in values.values())
    assert resolved.deferred_paths() == []


def test_auto_hybrid_shard_size_is_the_node_and_unresolvable_auto_is_named(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    resolved, _, values = _resolve({"batch": {"micro_batch_size": 1},
                                    "sharding": {"stage": 3, "hybrid_shard_size": "auto"}})  # fmt: skip
    assert resolved.sharding.hybrid_shard_size == 2 and "one node" in values["sharding.hybrid_shard_size"][1]
    with pytest.raises(ConfigError) as exc:
        _resolve({"batch": {"micro_batch_size": 1}, "precision": {"param_dtype": "auto"},
                  "parallelism": {"pp": "auto"}})  # fmt: skip
    assert {p.path for p in exc.value.problems} == {"precision.param_dtype"}  # pipeline "auto": no pipeline


# ---- wrapping -----------------------------------------------------------------------------------

def test_wrap_targets():
    from torsh.engine.zero.wrap import wrap_targets

    model = h.build_model()
    assert [type(m).__name__ for m in wrap_targets(model, WrapPolicy())] == ["Embedding", "Sequential", "LayerNorm",
                                                                             "Linear"]
    assert [type(m).__name__ for m in wrap_targets(model, WrapPolicy(module_classes=["Block"]))] == ["Block", "Block"]
    by_size = wrap_targets(model, WrapPolicy(min_num_params=1000))
    assert [type(m).__name__ for m in by_size] == ["Block", "Block"]
    with pytest.raises(ConfigError, match="sharding.wrap.module_classes: no module of these classes"):
        wrap_targets(model, WrapPolicy(module_classes=["DecoderLayer"]))


# ---- return rules (one process) -----------------------------------------------------------------

@pytest.fixture(scope="module")
def api(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "ds.json"
    path.write_text(json.dumps({"batch": {"micro_batch_size": 3}, "optimizer": {"name": "Adam", "lr": 0.01}}))
    (result,) = h.run([{"name": "api", "kind": "api", "config_path": str(path)}], world_size=1)
    rec = result["api"]
    assert "error" not in rec, rec.get("traceback")
    return rec


@pytest.mark.slow
def test_return_rules(api):
    assert api["no_optimizer"] == [True, True, True]  # stage 0 fp32 without optimizer: None, like DeepSpeed
    assert "zero stage 1 requires an optimizer" in api["stage1_without_optimizer"]
    assert api["stage3_without_optimizer"] is True
    assert api["fallthrough"] == "Embedding"


@pytest.mark.slow
def test_passed_optimizer_and_scheduler_are_rebuilt_and_rebound(api):
    new_opt, same_sched, rebound, lr, momentum, old_untouched = api["rebuilt"]
    assert new_opt and same_sched and rebound and old_untouched
    assert lr == pytest.approx(0.05) and momentum == 0.5  # the scheduler stepped the rebuilt optimizer


@pytest.mark.slow
def test_callables_and_param_groups(api):
    assert api["callables"] == ["Adam", [0.5, 0.01], 3, "LambdaLR"]  # head weight+bias, embedding


@pytest.mark.slow
def test_args_deepspeed_config(api):
    assert api["args"] == [0, 3, "Adam"]  # core names are torch.optim names
    assert "give the config once" in api["both_configs"]


@pytest.mark.slow
def test_engine_config_is_the_config_dict_as_deepspeeds(api):
    """DeepSpeed's engine.config is the config dict: the file's content for a path, the dict passed, and base64
    JSON text decoded (deepspeed.initialize takes all three)."""
    assert api["config_attribute"] == [True, True, True, 2]


@pytest.mark.slow
def test_batch_ramp_up_and_empty_partition_cache_as_deepspeeds(api):
    """set_train_batch_size changes the accumulation steps (a size that does not divide is DeepSpeed's ValueError);
    set_train_micro_batch_size keeps them; empty_partition_cache frees parameters an evaluation forward left
    gathered."""
    gas, size, steps, error, micro, gas_after, size_after = api["batch_ramp"]
    assert (gas, size, steps) == (4, 8, 1)
    assert error.startswith("Train batch size must be divisible by micro-batch data parallelism")
    assert (micro, gas_after, size_after) == (4, 4, 16)
    assert api["empty_partition_cache"] == [True, False]


@pytest.mark.slow
def test_engine_monitor_writes_the_scripts_events_as_deepspeeds_csv_monitor(api):
    enabled, files, rows = api["monitor"]
    assert enabled and files == ["Train_Samples_loss.csv", "eval_acc.csv"]
    assert rows == ["step,loss", "8,1.5", "16,1.25"]


@pytest.mark.slow
def test_deepspeed_json_config(api):
    assert api["deepspeed"] == [2, True, 1.0, "AdamW", 0.0, 4]  # DeepSpeed's Adam is AdamW with decay 0
    assert api["deepspeed_auto"] == [2, 1, 2, 1.0, 0.02, 0.1, True]
    assert api["deepspeed_fp16"] == [True, 256.0, "deepspeed_zero", ["torch.float32"]]
