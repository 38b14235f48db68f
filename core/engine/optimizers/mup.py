"""mup's ``MuAdam`` / ``MuAdamW`` / ``MuSGD`` (https://github.com/microsoft/mup), as DeepSpeed 0.19.8 builds them:
imported from the ``mup`` package and called with the parameters and the config's values.

DeepSpeed has no fallback: without mup it logs "Install mup to use MuAdam optimizer" and then fails on the
missing name. Here that is a ConfigError saying what to install. mup's optimizers read each parameter's
``infshape`` (set by ``mup.set_base_shapes`` on the model) to put parameters of different widths into groups with
scaled learning rates; the engine's step tensors carry it where they are the model's own parameters (stage 0 in
fp32). ZeRO's flat fp32 masters, FSDP2's shards and low-precision masters are new tensors without it: there the
ConfigError names the stages that run it.
"""

from __future__ import annotations

import importlib
from typing import Any

from torsh.errors import ConfigError, Problem


def build_mup(name: str, values: dict[str, Any], params: Any) -> Any:
    """``mup.<name>(params, **values)``; a ConfigError when mup is missing or the parameters carry no infshape."""
    try:
        mup = importlib.import_module("mup")
    except ImportError:
        raise ConfigError([Problem("optimizer.name", name, f"DeepSpeed builds mup.{name}, and the mup package is "
                                   f"not installed (DeepSpeed logs 'Install mup to use {name} optimizer' and fails): "
                                   "pip install mup, and call mup.set_base_shapes on the model before "
                                   "initialize")]) from None  # fmt: skip
    tensors = [t for g in params for t in (g["params"] if isinstance(g, dict) else [g])]
    if not all(hasattr(t, "infshape") for t in tensors):
        raise ConfigError([Problem("optimizer.name", name, f"mup.{name} reads each parameter's infshape "
                                   "(mup.set_base_shapes), which the tensors this stage steps do not carry (ZeRO's "
                                   "flat masters, FSDP2's shards, fp32 master copies): torsh runs it at ZeRO stage "
                                   "0 in fp32; call mup.set_base_shapes on the model first")])  # fmt: skip
    return getattr(mup, name)(params, **values)
