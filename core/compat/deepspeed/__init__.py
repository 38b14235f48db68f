"""DeepSpeed 0.19.8's public API on the torsh engine: what ``import deepspeed`` gives a script run by ``torsh run``.

``deepspeed.initialize`` is :func:`torsh.initialize`; the submodules real scripts import (``comm``,
``accelerator``, ``zero``, ``runtime.*``, ``utils``, ``ops.adam``, ``checkpointing``) are thin layers over torch;
what torsh does not run (``moe``, ``pipe``, ``ops.lamb``, inference) imports and fails with a clear message when
used. ``__version__`` is ``"0.19.8+torsh"``: the DeepSpeed version whose API this mirrors, with a local label
saying it is not DeepSpeed (version checks such as ``>= 0.9`` pass). Submodules load on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.19.8+torsh"
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8
version = __version__
git_hash = None
git_branch = None
__git_hash__, __git_branch__ = git_hash, git_branch

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

_SUBMODULES = {"comm", "accelerator", "runtime", "utils", "ops", "moe", "pipe", "profiling", "checkpoint",
               "git_version_info", "module_inject"}

#: name -> (module, attribute); attribute None: the module itself.
_LAZY = {
    "initialize": (__name__ + "._toplevel", "initialize"),
    "add_config_arguments": ("torsh.engine.initialize", "add_config_arguments"),
    "init_distributed": (__name__ + ".comm", "init_distributed"),
    "DeepSpeedEngine": ("torsh.engine.engine", "Engine"),
    "zero": (__name__ + ".runtime.zero", None),
    "checkpointing": (__name__ + ".runtime.activation_checkpointing.checkpointing", None),
    "get_accelerator": (__name__ + ".accelerator", "get_accelerator"),
    "log_dist": (__name__ + ".utils", "log_dist"),
    "logger": (__name__ + ".utils", "logger"),
    "OnDevice": (__name__ + ".utils", "OnDevice"),
    "DeepSpeedConfig": (__name__ + ".runtime.config", "DeepSpeedConfig"),
    "DeepSpeedConfigError": (__name__ + ".runtime.config", "DeepSpeedConfigError"),
    "PipelineModule": (__name__ + ".pipe", "PipelineModule"),
    "PipelineEngine": (__name__ + ".runtime.pipe", "PipelineEngine"),
    "DeepSpeedTransformerLayer": (__name__ + ".ops", "DeepSpeedTransformerLayer"),
    "DeepSpeedTransformerConfig": (__name__ + ".ops", "DeepSpeedTransformerConfig"),
    "init_inference": (__name__ + "._toplevel", "init_inference"),
    "tp_model_init": (__name__ + "._toplevel", "tp_model_init"),
    "add_tuning_arguments": (__name__ + "._toplevel", "add_tuning_arguments"),
    "DeepSpeedOptimizer": (__name__ + ".runtime.base_optimizer", "DeepSpeedOptimizer"),
    "ZeROOptimizer": (__name__ + ".runtime.base_optimizer", "ZeROOptimizer"),
}


def __getattr__(name: str):
    if name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name in _LAZY:
        module, attribute = _LAZY[name]
        value = importlib.import_module(module)
        if attribute is not None:
            value = getattr(value, attribute)
    else:
        raise AttributeError(f"module 'deepspeed' (torsh's DeepSpeed compatibility package) has no attribute "
                             f"{name!r}; docs/torsh-run.md lists the DeepSpeed API torsh covers")  # fmt: skip
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_SUBMODULES, *_LAZY})
