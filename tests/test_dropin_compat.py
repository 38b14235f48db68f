"""torsh.compat.deepspeed and torsh run: the DeepSpeed module tree scripts import, and the launcher's modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torsh.compat.deepspeed import _unsupported


def _python(code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, **kwargs)  # fmt: skip


def test_import_torsh_as_deepspeed_exposes_submodules_without_importing_torch_first():
    proc = _python("""
        import sys
        import torsh as deepspeed
        assert "torch" not in sys.modules, "import torsh imported torch"
        assert deepspeed.comm.get_local_rank() == 0
        assert deepspeed.zero.Init and deepspeed.zero.GatheredParameters
        assert deepspeed.runtime.utils.set_random_seed and deepspeed.checkpointing.checkpoint
        assert deepspeed.get_accelerator().device_name() in ("cpu", "cuda")
        assert deepspeed.DeepSpeedEngine is deepspeed.Engine
        assert not any(m.split(".")[0] == "deepspeed" for m in sys.modules)
    """)
    assert proc.returncode == 0, proc.stderr


def test_alias_resolves_every_deepspeed_import_to_the_compatibility_package():
    proc = _python("""
        import sys
        from torsh.compat import install_deepspeed_alias
        install_deepspeed_alias()
        import deepspeed
        import deepspeed.comm as dist
        from deepspeed import comm, zero, checkpointing
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
        from deepspeed.runtime.utils import set_random_seed
        from deepspeed.runtime.lr_schedules import WarmupLR
        from deepspeed.utils import RepeatingLoader, logger, log_dist
        from deepspeed.utils.logging import logger as logger2
        from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam
        from deepspeed.pipe import PipelineModule
        from deepspeed.moe.layer import MoE
        assert dist is comm is sys.modules["deepspeed.comm"] and dist.__name__ == "torsh.compat.deepspeed.comm"
        assert deepspeed.__version__ == "0.19.8+torsh" and logger is logger2
        import importlib.metadata
        assert importlib.metadata.version("deepspeed") == "0.19.8+torsh"  # what Accelerate/Transformers check
        assert zero.GatheredParameters is deepspeed.runtime.zero.GatheredParameters
        real = [m for m in sys.modules if m.split(".")[0] == "deepspeed"
                and "site-packages" in str(getattr(sys.modules[m], "__file__", ""))]
        assert not real, real
        try:
            import deepspeed.inference.engine
        except ModuleNotFoundError as e:
            assert "does not provide 'deepspeed.inference'" in str(e), e
        else:
            raise AssertionError("deepspeed.inference imported")
    """)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("build, expected", [
    (lambda: __import__("torsh.compat.deepspeed.pipe", fromlist=["x"]).DualPipeVModule(layers=[]),
     "deepspeed.pipe.DualPipeVModule is not supported by torsh"),
    (lambda: __import__("torsh.compat.deepspeed", fromlist=["x"]).init_inference(None),
     "deepspeed.init_inference is not supported by torsh"),
])  # fmt: skip
def test_what_torsh_does_not_run_imports_and_fails_clearly_when_used(build, expected):
    with pytest.raises(_unsupported.NotSupportedByTorsh, match=expected.replace(".", r"\.")):
        build()


def test_initialize_takes_accelerates_infinite_steps_per_print():
    """Accelerate passes ``steps_per_print: inf`` to ``deepspeed.initialize``; the config reads (never print)."""
    from torsh.compat.deepspeed.runtime.config import DeepSpeedConfig

    given = {"steps_per_print": float("inf"), "train_micro_batch_size_per_gpu": 2}
    read = DeepSpeedConfig(given)
    assert read.train_micro_batch_size_per_gpu == 2
    assert given["steps_per_print"] == float("inf")  # the caller's dict is not changed


def _trained(optimizer_cls, steps=3, **kwargs):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3))
    opt = optimizer_cls([p], **kwargs)
    for _ in range(steps):
        opt.zero_grad()
        (p**2).sum().backward()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("name, mode_key", [("FusedAdam", "adam_w_mode"), ("DeepSpeedCPUAdam", "adamw_mode")])
def test_deepspeed_adams_are_torch_adam_with_deepspeeds_weight_decay_modes(name, mode_key):
    from torsh.compat.deepspeed.ops import adam

    cls = getattr(adam, name)
    common = {"lr": 0.1, "weight_decay": 0.2, "betas": (0.8, 0.9), "eps": 1e-6}
    assert torch.equal(_trained(cls, **common), _trained(torch.optim.AdamW, **common))
    assert torch.equal(_trained(cls, **common, **{mode_key: False}), _trained(torch.optim.Adam, **common))
    with pytest.raises(NotImplementedError, match="bias_correction"):
        cls([torch.nn.Parameter(torch.zeros(1))], bias_correction=False)


def test_an_engine_rebuilding_fused_adam_keeps_its_mode():
    from torsh.compat.deepspeed.ops.adam import FusedAdam
    from torsh.engine.optim import rebuild_optimizer

    p = torch.nn.Parameter(torch.zeros(2))
    cls, defaults, groups = rebuild_optimizer(FusedAdam([p], lr=0.5, adam_w_mode=False), {id(p): "w"}, {"w": p})
    rebuilt = cls([{**g, "params": [p]} for g in groups], **defaults)
    assert isinstance(rebuilt, FusedAdam) and rebuilt.param_groups[0]["decoupled_weight_decay"] is False
    assert rebuilt.param_groups[0]["lr"] == 0.5


def test_cpu_accelerator_answers_like_deepspeeds(monkeypatch):
    from torsh.compat.deepspeed import accelerator

    monkeypatch.setattr(accelerator, "_ACCELERATOR", None)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    acc = accelerator.get_accelerator()
    assert (acc.device_name(), acc.device_name(1), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.communication_backend_name() == "gloo" and acc.is_available() and acc.is_bf16_supported()
    assert torch.float in acc.supported_dtypes() and acc.on_accelerator(torch.zeros(1))
    acc.manual_seed(3)
    a = torch.rand(2)
    acc.manual_seed_all(3)
    assert torch.equal(a, torch.rand(2))
    assert isinstance(acc.memory_allocated(), int) and acc.total_memory() > 0
    assert acc.FloatTensor([1, 2]).dtype == torch.float32 and acc.pin_memory(a) is a
    monkeypatch.setattr(accelerator, "_ACCELERATOR", None)
    monkeypatch.setenv("DS_ACCELERATOR", "hpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='hpu'"):
        accelerator.get_accelerator()


def test_repeating_loader_and_set_random_seed():
    import random

    import numpy

    from torsh.compat.deepspeed.runtime.utils import set_random_seed
    from torsh.compat.deepspeed.utils import RepeatingLoader

    loader = RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    draws = []
    for _ in range(2):
        set_random_seed(2**40 + 5)  # larger than numpy accepts: reduced modulo 2**32
        draws.append((random.random(), numpy.random.rand(), torch.rand(1).item()))
    assert draws[0] == draws[1]


def test_activation_checkpointing_gives_the_same_gradients_and_reads_the_config():
    from torsh.compat.deepspeed.runtime.activation_checkpointing import checkpointing

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Tanh())
    x = torch.randn(3, 4, requires_grad=True)
    grads = []
    for use in (False, True):
        torch.manual_seed(1)
        out = checkpointing.checkpoint(layer, x) if use else layer(x)
        layer.zero_grad()
        x.grad = None
        out.sum().backward()
        grads.append((x.grad.clone(), layer[0].weight.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads))  # dropout replayed with the same mask
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}})
    assert checkpointing.is_configured() and checkpointing._options["checkpoint_in_cpu"] is True
    checkpointing._options["checkpoint_in_cpu"] = False


def test_torsh_command_names_its_one_subcommand(capsys):
    from torsh.run import cli

    assert cli(["train.py"]) == 2
    assert "unknown command 'train.py'" in capsys.readouterr().err
    assert cli([]) == 2 and "usage: torsh run" in capsys.readouterr().out


WORKER = """
import json, os, sys
import deepspeed
import deepspeed.comm as dist
import torch
deepspeed.init_distributed()
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t, op=dist.ReduceOp.AVG)
out = [torch.zeros(1) for _ in range(2)]
dist.all_gather(out, torch.tensor([float(dist.get_rank())]))
if dist.get_rank() == 0:
    with open(os.environ["OUT"], "w") as f:
        json.dump({"argv": sys.argv[1:], "name": __name__, "avg": t.item(), "gathered": [o.item() for o in out],
                   "local_rank": dist.get_local_rank(), "world": dist.get_world_size(), "file": deepspeed.__file__,
                   "path0": sys.path[0]}, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["script", "module", "run-path", "no-python"])
def test_torsh_run_launches_like_torchrun_in_every_mode(mode, tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(WORKER)
    blocker = tmp_path / "blocker" / "deepspeed"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("real DeepSpeed imported")\n')
    target = {"script": [str(pkg / "train.py")], "module": ["-m", "pkg.train"],
              "run-path": ["--run-path", str(pkg / "train.py")], "no-python": ["--no-python", str(tmp_path / "t.sh")]}
    (tmp_path / "t.sh").write_text(f'#!/bin/sh\nexec "{sys.executable}" "{pkg / "train.py"}" "$@"\n')
    (tmp_path / "t.sh").chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out.json"), "PYTHONPATH": str(tmp_path / "blocker")}
    cmd = [sys.executable, "-m", "torsh.run", "--nproc-per-node", "2", *target[mode], "--lr", "0.1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["argv"] == ["--lr", "0.1"] and got["name"] == "__main__"
    assert got["avg"] == 1.5 and got["gathered"] == [0.0, 1.0] and got["world"] == 2 and got["local_rank"] == 0
    assert "compat" in got["file"]
    assert Path(got["path0"]).resolve() == (tmp_path if mode == "module" else pkg).resolve()


GATHER_WORKER = """
import json, os
import deepspeed
import torch
from torch import nn

deepspeed.init_distributed()
rank = torch.distributed.get_rank()
torch.manual_seed(rank)  # different weights on each rank
with deepspeed.zero.Init():
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
with deepspeed.zero.GatheredParameters(model[0].weight, modifier_rank=0):
    if rank == 0:
        model[0].weight.data.fill_(0.5)
record = {"init_broadcast": model[0].weight.eq(0.5).all().item()}
config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
sharded = engine.module[2].weight
record["sharded_local_rows"] = sharded.to_local().shape[0]
with deepspeed.zero.GatheredParameters(engine.module.parameters(), modifier_rank=0):
    record["full_shape_inside"] = list(engine.module[2].weight.shape)
    record["state_dict_full"] = list(engine.module.state_dict()["2.weight"].shape)
    if rank == 0:
        engine.module[2].weight.data.fill_(2.0)
with deepspeed.zero.GatheredParameters([engine.module[2].weight]):
    record["written_back"] = engine.module[2].weight.eq(2.0).all().item()
    engine.module[2].weight.data.fill_(-1.0)  # no modifier_rank: discarded on exit
with deepspeed.zero.GatheredParameters([engine.module[2].weight]):
    record["discarded"] = engine.module[2].weight.eq(2.0).all().item()
record["shard_restored"] = engine.module[2].weight is sharded
# the handle a script kept (named_parameters() before the context), as the ZeRO-3 save helpers use it
status = deepspeed.runtime.zero.partition_parameters.ZeroParamStatus
record["ds_attributes"] = [sharded.ds_status == status.NOT_AVAILABLE, list(sharded.ds_shape), sharded.ds_numel,
                           isinstance(sharded.ds_id, int)]
with deepspeed.zero.GatheredParameters([sharded], modifier_rank=0):
    record["handle_data"] = [type(sharded.data).__name__, list(sharded.data.shape), sharded.ds_status.name]
    if rank == 0:
        sharded.data[0].fill_(3.0)  # written back on exit
with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
    with deepspeed.zero.GatheredParameters([sharded]):  # nested: already whole
        record["nested"] = [sharded.data[0].eq(3.0).all().item(), sharded.data[1].eq(2.0).all().item()]
try:
    with deepspeed.zero.GatheredParameters([sharded]):
        raise KeyError("in the context")
except KeyError:
    record["after_error"] = [type(sharded).__name__, sharded.ds_status.name, type(sharded.data).__name__]
loss = engine(torch.ones(2, 6)).sum()
engine.backward(loss)
engine.step()
record["trains"] = True


class Root(nn.Module):  # code in the forward reads a parameter of the root's unit (TRL's fused LM-head loss reads
    def __init__(self):  # lm_head.weight so) and asks ds_status whether it must gather it first
        super().__init__()
        self.body, self.head = nn.Linear(6, 4), nn.Parameter(torch.ones(3, 4))

    def forward(self, x):
        seen.append([getattr(getattr(self.head, "ds_status", None), "name", None), list(self.head.shape)])
        return nn.functional.linear(self.body(x), self.head)


seen, model = [], Root()
root, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
root.backward(root(torch.ones(2, 6)).sum())
record["status_in_forward"] = seen[0]
all_records = [None, None]
torch.distributed.all_gather_object(all_records, record)
if rank == 0:
    with open(os.environ["OUT"], "w") as f:
        json.dump(all_records, f)
"""


@pytest.mark.slow
def test_gathered_parameters_under_zero_init_and_fsdp2(tmp_path):
    (tmp_path / "w.py").write_text(GATHER_WORKER)
    env = {**os.environ, "OUT": str(tmp_path / "out.json")}
    cmd = [sys.executable, "-m", "torsh.run", "--nproc-per-node", "2", str(tmp_path / "w.py")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = json.loads((tmp_path / "out.json").read_text())
    assert [r.pop("sharded_local_rows") for r in records] == [2, 1]  # 3 rows sharded over 2 ranks
    for record in records:
        assert record == {"init_broadcast": True, "full_shape_inside": [3, 4], "state_dict_full": [3, 4],
                          "written_back": True, "discarded": True, "shard_restored": True, "trains": True,
                          "status_in_forward": ["AVAILABLE", [3, 4]],
                          "ds_attributes": [True, [3, 4], 12, True], "handle_data": ["Tensor", [3, 4], "AVAILABLE"],
                          "nested": [True, True], "after_error": ["DTensor", "NOT_AVAILABLE", "DTensor"]}


def test_deepspeed_config_reads_back_what_scripts_ask(tmp_path):
    from torsh.compat.deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    raw = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}
    cfg = DeepSpeedConfig(raw)
    assert cfg._param_dict is raw and cfg.zero_optimization_stage == 2 and cfg.zero_enabled
    assert cfg.bfloat16_enabled and not cfg.fp16_enabled and cfg.gradient_clipping == 0.5
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 4)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DeepSpeedConfigError, match="bad.json"):
        DeepSpeedConfig(str(tmp_path / "bad.json"))


def test_deepspeed_chat_lora_helpers_import_and_act_as_deepspeeds():
    """DeepSpeed-Chat's ``dschat/utils/module/lora.py`` imports them from the deprecated compression.helper."""
    proc = _python("""
        import warnings
        import torch
        from torsh.compat import install_deepspeed_alias
        install_deepspeed_alias()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from deepspeed.compression.helper import recursive_getattr, recursive_setattr
        assert [w.category for w in caught] == [FutureWarning], caught  # deprecated, as in DeepSpeed 0.19.8
        from deepspeed.utils.module_utils import recursive_getattr as same
        assert same is recursive_getattr
    """)
    assert proc.returncode == 0, proc.stderr
    real = pytest.importorskip("deepspeed.utils.module_utils", reason="DeepSpeed 0.19.8 is installed by "
                               "requirements-dev.txt")  # fmt: skip
    from torsh.compat.deepspeed.utils import module_utils as ours

    results = []
    for helpers in (real, ours):
        model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 3)), torch.nn.ReLU())
        found = [helpers.recursive_getattr(model, "0.0.weight").shape, type(helpers.recursive_getattr(model, "1"))]
        helpers.recursive_setattr(model, "0.0", torch.nn.Identity())
        helpers.recursive_setattr(model, "1", torch.nn.Tanh())
        results.append([*found, repr(model)])
    assert results[0] == results[1]


def test_the_weights_only_safe_globals_idiom_imports_as_on_deepspeed():
    """Training scripts register DeepSpeed's checkpoint classes with torch's ``weights_only`` loader at import."""
    proc = _python("""
        import torch
        from torsh.compat import install_deepspeed_alias
        install_deepspeed_alias()
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.runtime.fp16.loss_scaler import LossScaler, DynamicLossScaler
        torch.serialization.add_safe_globals([LossScaler, ZeroStageEnum, DynamicLossScaler])
        import deepspeed
        assert deepspeed.runtime.fp16.loss_scaler.LossScaler is LossScaler
        try:
            LossScaler(scale=1.0)
        except NotImplementedError as e:
            assert "scales the loss itself" in str(e), e
        else:
            raise AssertionError("LossScaler constructed")
        print({m.name: int(m) for m in ZeroStageEnum.__members__.values()})
    """)
    assert proc.returncode == 0, proc.stderr
    real = pytest.importorskip("deepspeed.runtime.zero.config", reason="DeepSpeed 0.19.8 is installed by "
                               "requirements-dev.txt")  # fmt: skip
    from torsh.compat.deepspeed.runtime.zero.config import ZeroStageEnum

    assert {k: int(v) for k, v in ZeroStageEnum.__members__.items()} == {
        k: int(v) for k, v in real.ZeroStageEnum.__members__.items()}


def test_more_deepspeed_import_forms_of_real_scripts_resolve():
    """Import forms real scripts and libraries use: Lightning Fabric's checkpoint loading (base_optimizer),
    OpenFold (``deepspeed.comm.comm``), start-up memory estimates, the optimizers' defining modules."""
    proc = _python("""
        from torsh.compat import install_deepspeed_alias
        install_deepspeed_alias()
        import torch
        import deepspeed
        from deepspeed.comm import comm
        from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live
        from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam
        from deepspeed.ops.adam.fused_adam import FusedAdam
        assert comm is deepspeed.comm and deepspeed.comm.comm.is_initialized() is False
        assert DeepSpeedCPUAdam is deepspeed.ops.adam.DeepSpeedCPUAdam and FusedAdam is deepspeed.ops.adam.FusedAdam
        assert issubclass(ZeROOptimizer, DeepSpeedOptimizer)
        assert not isinstance(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), DeepSpeedOptimizer)
        model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
        estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=8)
        estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=8, num_nodes=2)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "ZeRO-3 estimate" in proc.stdout and "ZeRO-2 estimate" in proc.stdout and "offload_param=cpu" in proc.stdout


def test_memory_estimates_equal_deepspeeds():
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3", reason="DeepSpeed 0.19.8 is installed by "
                                 "requirements-dev.txt")  # fmt: skip
    from deepspeed.runtime.zero import stage_1_and_2

    from torsh.compat.deepspeed.runtime.zero import stage3 as ours3
    from torsh.compat.deepspeed.runtime.zero import stage_1_and_2 as ours2

    for params, largest, gpus, nodes, factor in ((7_000_000_000, 500_000_000, 8, 1, 1.5), (123_457, 4_097, 3, 5, 1.0),
                                                 (1, 1, 1, 1, 2.0)):  # fmt: skip
        for offload in (True, False):
            assert ours2.estimate_zero2_model_states_mem_needs(params, gpus, nodes, offload, factor) == \
                stage_1_and_2.estimate_zero2_model_states_mem_needs(params, gpus, nodes, offload, factor)
            for offload_params in (True, False):
                for zero_init in (True, False):
                    args = (params, largest, gpus, nodes, offload, offload_params, zero_init, factor)
                    assert ours3.estimate_zero3_model_states_mem_needs(*args) == \
                        stage3.estimate_zero3_model_states_mem_needs(*args), args


def test_detach_variable_acts_as_deepspeeds():
    real = pytest.importorskip("deepspeed.runtime.activation_checkpointing.checkpointing", reason="DeepSpeed 0.19.8 "
                               "is installed by requirements-dev.txt")  # fmt: skip
    from torsh.compat.deepspeed.runtime.activation_checkpointing import checkpointing as ours

    leaf = torch.ones(2, requires_grad=True)
    inputs = (leaf * 2, torch.zeros(3), "mask", None)
    results = [helpers.detach_variable(inputs) for helpers in (real, ours)]
    for got in results:
        assert [type(x).__name__ for x in got] == ["Tensor", "Tensor", "str", "NoneType"]
        assert got[0].requires_grad and got[0].grad_fn is None and not got[1].requires_grad
        assert torch.equal(got[0], inputs[0]) and got[2] == "mask"
    for helpers in (real, ours):
        with pytest.raises(RuntimeError):
            helpers.detach_variable([leaf])


def test_deepspeed_utils_logging_is_deepspeeds_submodule_and_lightning_strategies_construct():
    """``deepspeed.utils.logging.logger`` (Lightning's DeepSpeedStrategy sets its level in ``__init__``) is the
    DeepSpeed logger, not Python's logging module; set_log_level_from_string still works after the import."""
    pytest.importorskip("lightning", reason="Lightning 2.6.6 is installed by requirements-dev.txt")
    proc = _python("""
        from torsh.compat import install_deepspeed_alias
        install_deepspeed_alias()
        import logging
        import deepspeed
        assert deepspeed.utils.logging.logger is deepspeed.utils.logger
        from deepspeed.utils.logging import logger
        deepspeed.utils.set_log_level_from_string("error")
        assert logger.level == logging.ERROR
        from lightning.pytorch.strategies import DeepSpeedStrategy
        from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy
        DeepSpeedStrategy(stage=3, logging_level=logging.WARNING)
        FabricDeepSpeedStrategy(stage=2)
        assert logger.level == logging.WARNING  # Fabric's default logging_level is WARN as well
    """)
    assert proc.returncode == 0, proc.stderr
