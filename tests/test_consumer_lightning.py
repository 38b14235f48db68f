"""Lightning 2.x builds its strategies from what torsh reads and writes: the DeepSpeed config Lightning's own
DeepSpeedStrategy builds from a corpus file's arguments means what torsh read from them, and DeepSpeedStrategy /
FSDPStrategy accept the arguments torsh writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from consumers import converted_sources, load_or_skip

from torsh import adapters
from torsh.errors import ConfigError

CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus"
LIGHTNING = sorted((CORPUS / "lightning").glob("*.json"))
CONVERTED = LIGHTNING + converted_sources(15, 0, 15)
_PRECISION = {16: "16-mixed", "16": "16-mixed", "bf16": "bf16-mixed", 32: "32-true"}


@pytest.fixture(scope="module")
def strategies():
    pytest.importorskip("lightning", reason="Lightning 2.x is needed: pip install -r requirements-dev.txt")
    pytest.importorskip("deepspeed", reason="DeepSpeedStrategy imports DeepSpeed")
    from lightning.fabric.strategies.deepspeed import _format_precision_config
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    return DeepSpeedStrategy, FSDPStrategy, _format_precision_config


def _core(cfg):
    return (cfg.sharding.stage, cfg.offload.params, cfg.offload.optimizer, cfg.offload.nvme_path,
            cfg.precision.param_dtype, cfg.optimizer, cfg.scheduler)  # fmt: skip


@pytest.mark.parametrize("path", [p for p in LIGHTNING if "DeepSpeedStrategy" in p.read_text("utf-8")],
                         ids=lambda p: p.stem)  # fmt: skip
def test_lightning_builds_the_deepspeed_config_torsh_reads_from_the_arguments(path, strategies):
    DeepSpeedStrategy, _, format_precision = strategies
    raw = json.loads(path.read_text("utf-8"))
    built = DeepSpeedStrategy(**raw["DeepSpeedStrategy"]).config
    precision = _PRECISION.get(raw.get("Trainer", raw.get("Fabric", {})).get("precision"), "32-true")
    format_precision(built, precision, 0, 1000, 1, 16, 2)  # Trainer defaults of DeepSpeedStrategy's scaler
    try:
        expected = adapters.read(built, "deepspeed").result
    except ConfigError:
        with pytest.raises(ConfigError):
            adapters.load(path)
        return
    assert _core(adapters.load(path).result) == _core(expected)


@pytest.mark.parametrize("path", CONVERTED, ids=lambda p: f"{p.parent.name}/{p.name[:50]}")
def test_lightning_strategies_accept_what_torsh_writes(path, strategies):
    DeepSpeedStrategy, FSDPStrategy, _ = strategies
    cfg = load_or_skip(path)
    written = adapters.write(cfg, "lightning").result["DeepSpeedStrategy"]
    assert DeepSpeedStrategy(**written).config.get("zero_optimization", {}).get("stage", 0) == cfg.sharding.stage
    kwargs = dict(adapters.write(cfg, "lightning", version="fsdp").result["FSDPStrategy"])
    import torch
    from torch.distributed.fsdp import CPUOffload, MixedPrecision

    names = {}  # class sets written as "{Block}": the script's classes, here stand-ins of those names
    for key in ("auto_wrap_policy", "activation_checkpointing_policy"):
        if isinstance(kwargs.get(key), str) and kwargs[key].startswith("{"):
            kwargs[key] = {names.setdefault(n, type(n, (torch.nn.Module,), {})) for n in
                           kwargs[key].strip("{}").replace(" ", "").split(",")}  # fmt: skip
    if isinstance(kwargs.get("mixed_precision"), dict):
        kwargs["mixed_precision"] = MixedPrecision(**{k: getattr(torch, v.split(".")[-1]) if "dtype" in k else v
                                                      for k, v in kwargs["mixed_precision"].items()})  # fmt: skip
    if isinstance(kwargs.get("cpu_offload"), dict):
        kwargs["cpu_offload"] = CPUOffload(**kwargs["cpu_offload"])
    if isinstance(kwargs.get("device_mesh"), list):
        kwargs["device_mesh"] = tuple(kwargs["device_mesh"])
    try:
        strategy = FSDPStrategy(**kwargs)
    except RuntimeError as exc:  # HYBRID_SHARD without a mesh or a wrap policy: reported when written
        assert "hybrid" in str(exc).lower() and cfg.sharding.hybrid_shard_size is not None
        return
    assert strategy._state_dict_type == kwargs.get("state_dict_type", "full")
    assert strategy.cpu_offload.offload_params is (cfg.offload.params == "cpu")
