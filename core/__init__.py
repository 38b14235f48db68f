"""torsh-distributed: one typed model for distributed-training configs, and an engine that runs them.

Importing ``torsh`` (and ``torsh.config``, ``torsh.adapters``) never imports torch; the engine and
``torsh.initialize`` load it on first use. ``import torsh as deepspeed`` also gives DeepSpeed's submodules
(``deepspeed.comm``, ``deepspeed.zero``, ...) from the compatibility package :mod:`torsh.compat.deepspeed`.
"""

from __future__ import annotations

__version__ = "0.1.0"

#: Public names that need torch, loaded on first access so that ``import torsh`` stays torch-free.
_LAZY = {
    "initialize": "torsh.engine.initialize",
    "add_config_arguments": "torsh.engine.initialize",
    "init_distributed": "torsh.engine.initialize",
    "Engine": "torsh.engine.engine",
}

#: DeepSpeed's top-level names, so that ``import torsh as deepspeed`` exposes what ``import deepspeed`` does
#: (resolved in ``torsh.compat.deepspeed`` on first access).
_DEEPSPEED_NAMES = frozenset({
    "comm", "accelerator", "zero", "runtime", "utils", "ops", "checkpointing", "moe", "pipe", "profiling",
    "DeepSpeedEngine", "DeepSpeedConfig", "DeepSpeedConfigError", "get_accelerator", "log_dist", "logger",
    "OnDevice", "PipelineModule", "PipelineEngine", "DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig",
    "init_inference", "tp_model_init", "add_tuning_arguments", "DeepSpeedOptimizer", "ZeROOptimizer",
})  # fmt: skip


#: The extra that installs PyTorch (named in the error when it is missing).
_ENGINE_EXTRA = "pip install 'torsh-distributed[engine]'"


def _torch_missing(what: str, exc: ModuleNotFoundError) -> ModuleNotFoundError:
    """The error for ``what`` needing PyTorch when ``exc`` says torch is not installed (``exc`` itself otherwise)."""
    if exc.name is None or exc.name.split(".")[0] != "torch":
        return exc
    # docs/getting-started.md (Install) says how to get a CPU-only build (the default wheel on Linux is a CUDA one).
    return ModuleNotFoundError(f"{what} needs PyTorch: {_ENGINE_EXTRA}", name=exc.name)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        try:
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as exc:
            raise _torch_missing(f"torsh.{name}", exc) from None
        value = getattr(module, name)
        globals()[name] = value
        return value
    if name in _DEEPSPEED_NAMES:
        import importlib

        value = getattr(importlib.import_module("torsh.compat.deepspeed"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torsh' has no attribute {name!r}")
