"""The fairscale dialect: FairScale 0.4.13 FSDP, OSS (ZeRO-1), OSS + ShardedDataParallel (ZeRO-2), ShardedGradScaler."""

from __future__ import annotations

import pytest
from adapter_validator import assert_accounted, validate_identity

from torsh import adapters
from torsh.config import TorshConfig
from torsh.errors import ConfigError
from torsh.translate import Fidelity


def _note(translation, path: str):
    return next(n for n in translation.notes if n.source_path == path)


@pytest.mark.parametrize("raw", [
    {"fsdp": {"reshard_after_forward": True}},
    {"fsdp": {"reshard_after_forward": False, "mixed_precision": True, "fp32_reduce_scatter": True,
              "move_params_to_cpu": True, "flatten_parameters": False, "bucket_cap_mb": 50},
     "scaler": {"init_scale": 1024.0, "growth_interval": 100}},
    {"oss": {"optim": "torch.optim.AdamW", "lr": 0.0001, "betas": [0.9, 0.95], "amsgrad": True}},
    {"oss": {"optim": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9}, "sdp": {"broadcast_buffers": False}},
])  # fmt: skip
def test_identity(raw):
    validate_identity("fairscale", raw)


def test_oss_is_zero1_and_with_sharded_ddp_zero2():
    assert adapters.read({"oss": {"optim": "SGD"}}, "fairscale").result.sharding.stage == 1
    assert adapters.read({"oss": {"optim": "SGD"}, "sdp": {}}, "fairscale").result.sharding.stage == 2


def test_fsdp_mixed_precision_defaults():
    t = adapters.read({"fsdp": {"mixed_precision": True}}, "fairscale")
    p = t.result.precision
    assert (p.param_dtype, p.reduce_dtype, p.buffer_dtype, p.master_dtype) == ("fp16", "fp16", "fp16", "fp32")
    assert t.result.sharding.stage == 3  # reshard_after_forward defaults to True


def test_bf16_compute_with_fp32_reduce_scatter():
    raw = {"fsdp": {"mixed_precision": True, "compute_dtype": "torch.bfloat16", "fp32_reduce_scatter": True}}
    p = adapters.read(raw, "fairscale").result.precision
    assert (p.param_dtype, p.reduce_dtype) == ("bf16", "fp32")


def test_fp32_reduce_scatter_needs_mixed_precision_as_in_fairscale():
    with pytest.raises(ConfigError, match="fp32_reduce_scatter needs mixed_precision"):
        adapters.read({"fsdp": {"fp32_reduce_scatter": True}}, "fairscale")


def test_cpu_offload_is_a_legacy_spelling_of_move_params_to_cpu():
    t = adapters.read({"fsdp": {"cpu_offload": True}}, "fairscale")
    assert (t.result.offload.params, t.result.offload.optimizer) == ("cpu", "cpu")
    assert _note(t, "fsdp.cpu_offload").target_path == "offload.params"


def test_reduce_fp16_is_silently_disabled_by_fairscale_and_we_say_so():
    t = adapters.read({"oss": {"optim": "SGD"}, "sdp": {"reduce_fp16": True}}, "fairscale")
    assert t.result.compression.method == "none"
    assert _note(t, "sdp.reduce_fp16").fidelity is Fidelity.DROPPED
    on = adapters.read({"oss": {"optim": "SGD"}, "sdp": {"reduce_fp16": True, "reduce_buffer_size": 0}}, "fairscale")
    assert on.result.compression.method == "fp16"


def test_sharded_ddp_needs_oss_and_fsdp_excludes_oss():
    with pytest.raises(ConfigError, match="needs an OSS optimizer"):
        adapters.read({"sdp": {}}, "fairscale")
    with pytest.raises(ConfigError, match="one"):
        adapters.read({"fsdp": {}, "oss": {"optim": "SGD"}}, "fairscale")


def test_scaler_is_dynamic_grad_scaler_semantics():
    cfg = adapters.read({"fsdp": {"mixed_precision": True}, "scaler": {}}, "fairscale").result
    ls = cfg.precision.loss_scaling
    assert (ls.mode, ls.semantics) == ("dynamic", "torch_grad_scaler")
    assert (ls.initial_scale, ls.growth_interval) == (65536, 2000)


def test_oss_forwards_unknown_keys_to_the_optimizer():
    raw = {"oss": {"optim": "torch.optim.Adam", "lr": 1e-3, "foreach": False, "broadcast_buffer_size": 123}}
    t = adapters.read(raw, "fairscale")
    assert_accounted(raw, t)
    assert t.result.optimizer.kwargs == {"foreach": False}
    assert _note(t, "oss.broadcast_buffer_size").fidelity is Fidelity.DROPPED


def test_write_layout_follows_the_stage():
    def layout(core):
        return sorted(adapters.write(TorshConfig.from_dict(core), "fairscale").result)

    assert layout({"sharding": {"stage": 1}, "optimizer": {"name": "AdamW"}}) == ["oss"]
    assert layout({"sharding": {"stage": 2}, "optimizer": {"name": "AdamW"}}) == ["oss", "sdp"]
    assert layout({"sharding": {"stage": 2}, "offload": {"params": "cpu", "optimizer": "cpu"}}) == ["fsdp"]
    assert layout({"sharding": {"stage": 3}}) == ["fsdp"]


def test_deepspeed_loss_scaling_is_approximate_in_a_grad_scaler():
    cfg = TorshConfig.from_dict({"sharding": {"stage": 3}, "precision": {"param_dtype": "fp16", "loss_scaling": {
        "mode": "dynamic", "semantics": "deepspeed_zero", "growth_interval": 1000}}})
    written = adapters.write(cfg, "fairscale")
    assert written.result["scaler"]["growth_interval"] == 1000
    assert _note(written, "precision.loss_scaling.semantics").fidelity is Fidelity.APPROXIMATE


def test_fp16_compression_is_written_so_fairscale_applies_it():
    cfg = TorshConfig.from_dict({"sharding": {"stage": 2}, "optimizer": {"name": "SGD"},
                                 "compression": {"method": "fp16"}})  # fmt: skip
    sdp = adapters.write(cfg, "fairscale").result["sdp"]
    assert sdp == {"reduce_fp16": True, "reduce_buffer_size": 0}


# ---- what we write, FairScale 0.4.13 accepts -------------------------------------------------------------

_BUILD = r"""
import json, os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
from fairscale.nn import FullyShardedDataParallel, ShardedDataParallel
from fairscale.optim import OSS
from fairscale.optim.grad_scaler import ShardedGradScaler

def dtypes(kwargs):
    return {k: getattr(torch, v.split(".")[-1]) if isinstance(v, str) and v.startswith("torch.") else v
            for k, v in kwargs.items()}

for payload in json.loads(sys.stdin.read()):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    if "fsdp" in payload:
        FullyShardedDataParallel(model, compute_device=torch.device("cpu"), **dtypes(payload["fsdp"]))
    if "oss" in payload:
        oss = dict(payload["oss"])
        optim = getattr(torch.optim, oss.pop("optim").split(".")[-1])
        optimizer = OSS(model.parameters(), optim=optim, **oss)
        if "sdp" in payload:
            model = ShardedDataParallel(model, optimizer, **payload["sdp"])
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
    if "scaler" in payload:
        ShardedGradScaler(**payload["scaler"])
dist.destroy_process_group()
print("ok")
"""


@pytest.mark.slow
def test_written_kwargs_build_real_fairscale_objects():
    pytest.importorskip("fairscale", reason="FairScale 0.4.13 checks the written kwargs (CI installs it)")
    import json
    import socket
    import subprocess
    import sys

    cores = [
        {"sharding": {"stage": 1}, "optimizer": {"name": "AdamW", "lr": 1e-3, "betas": [0.9, 0.95]}},
        {"sharding": {"stage": 2}, "optimizer": {"name": "SGD", "lr": 0.1, "momentum": 0.9},
         "compression": {"method": "fp16"}, "ddp": {"broadcast_buffers": False}},
        {"sharding": {"stage": 3}, "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32",
                                                 "loss_scaling": {"mode": "dynamic", "growth_interval": 500}},
         "offload": {"params": "cpu", "optimizer": "cpu"}, "gradients": {"predivide_factor": 2.0}},
    ]  # fmt: skip
    payloads = [adapters.write(TorshConfig.from_dict(c), "fairscale").result for c in cores]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    proc = subprocess.run([sys.executable, "-c", _BUILD], input=json.dumps(payloads), capture_output=True, text=True,
                          env={"PORT": port, "PATH": "", "OMP_NUM_THREADS": "1"}, timeout=180)  # fmt: skip
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
