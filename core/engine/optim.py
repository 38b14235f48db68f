"""Build the optimizer a config names, with DeepSpeed's naming and defaults resolved to ``torch.optim``.

The core model stores a ``torch.optim`` class name: the DeepSpeed adapter has already turned DeepSpeed's
``"Adam"`` (decoupled weight decay unless ``adam_w_mode: false``) into ``AdamW`` or ``Adam`` and written
DeepSpeed's weight-decay default of 0 explicitly. This module builds that class over the (already sharded)
parameters, refuses the DeepSpeed-only optimizers torch has no equivalent for, and checks every
hyper-parameter against the class's constructor so a misspelt or foreign keyword is a config error naming
its key rather than a TypeError deep inside torch.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..deferred import is_deferred
from ..errors import ConfigError, Problem, did_you_mean

__all__ = ["UNSUPPORTED_OPTIMIZERS", "build_optimizer"]

#: DeepSpeed optimizer names with no torch.optim equivalent (lower-cased) -> what to use instead.
UNSUPPORTED_OPTIMIZERS = {
    "lamb": "AdamW (DeepSpeed's FusedLamb has no torch.optim counterpart)",
    "lion": "AdamW (torch.optim has no Lion)",
    "muadam": "Adam (mup's MuAdam needs the mup package's parameter groups)",
    "muadamw": "AdamW (mup's MuAdamW needs the mup package's parameter groups)",
    "musgd": "SGD (mup's MuSGD needs the mup package's parameter groups)",
    "muon": "AdamW, or torch.optim.Muon by name with your own parameter split",
    "onebitadam": "AdamW (1-bit Adam was removed from DeepSpeed 0.19)",
    "zerooneadam": "AdamW (0/1 Adam was removed from DeepSpeed 0.19)",
    "onebitlamb": "AdamW (1-bit LAMB was removed from DeepSpeed 0.19)",
}

# Hyper-parameters with their own field in the core model, in the order the constructor usually takes them.
_TYPED_FIELDS = ("lr", "weight_decay", "betas", "eps", "momentum")


def _torch_optimizer_names() -> list[str]:
    import torch

    return [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
            and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"]  # fmt: skip


def build_optimizer(cfg: Any, params: Any, *, offload: bool) -> Any:
    """The ``torch.optim`` optimizer the ``optimizer`` section names, over ``params`` (tensors or param groups).

    Returns None when there is no section or it names no class (the training script passes its own optimizer).
    ``offload``: the parameters live on the CPU (FSDP2 ``CPUOffloadPolicy``); the torch optimizer then steps on
    the CPU where they are (``capturable``, which needs accelerator-resident state, is refused). Unknown or
    DeepSpeed-only names, unresolved "auto" values and keywords the class does not take raise
    :class:`~torsh.errors.ConfigError`.
    """
    if cfg is None or cfg.name is None:
        return None
    cls = _optimizer_class(cfg.name)
    check_steppable(cls, sharded=all_sharded(params), key="optimizer.name")
    kwargs = _keywords(cfg)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    problems = _keyword_problems(cfg.name, kwargs, accepted, offload)
    if problems:
        raise ConfigError(problems)
    values = {key: value for key, (_, value) in kwargs.items()}
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    if "foreach" in accepted and "foreach" not in values and not values.get("fused") and all_sharded(params):
        # torch steps CPU tensors one at a time unless told otherwise; for FSDP2's DTensors every one of those
        # per-parameter ops is a DTensor dispatch (about 2.5 ms of a 28 ms ZeRO-2 step on 2 CPU ranks). One
        # foreach op per list dispatches once; on CUDA torch chooses foreach by itself. (fused excludes it.)
        values["foreach"] = True
    return cls(params, **values)


def _optimizer_class(name: str) -> type:
    """The ``torch.optim`` class ``name``; a DeepSpeed-only or unknown name is a ConfigError."""
    import torch

    if name.lower() in UNSUPPORTED_OPTIMIZERS:
        raise ConfigError([Problem("optimizer.name", name,
                                   f"unsupported by the engine: use {UNSUPPORTED_OPTIMIZERS[name.lower()]}")])
    names = _torch_optimizer_names()
    if name not in names:
        raise ConfigError([Problem("optimizer.name", name, "not a torch.optim optimizer class",
                                   did_you_mean(name, names))])  # fmt: skip
    return getattr(torch.optim, name)


def _keywords(cfg: Any) -> dict[str, tuple[str, Any]]:
    """Keyword -> (dotted path for messages, value): the typed fields that are set, then ``optimizer.kwargs``."""
    kwargs: dict[str, tuple[str, Any]] = {}
    for field in _TYPED_FIELDS:
        value = getattr(cfg, field)
        if value is not None:
            kwargs[field] = (f"optimizer.{field}", value)
    for key, value in cfg.kwargs.items():
        kwargs[key] = (f"optimizer.kwargs.{key}", value)
    return kwargs


def _keyword_problems(name: str, kwargs: dict[str, tuple[str, Any]], accepted: set[str], offload: bool
                      ) -> list[Problem]:  # fmt: skip
    """Keywords still "auto", keywords the class does not take, and ``capturable`` under CPU offload."""
    problems = []
    for key, (path, value) in kwargs.items():
        if is_deferred(value):
            problems.append(Problem(path, value, "still 'auto': resolve it before the optimizer is built"))
        elif key not in accepted:
            problems.append(Problem(path, value, f"{name} has no argument '{key}'",
                                    did_you_mean(key, accepted)))  # fmt: skip
    if offload and "capturable" in kwargs and kwargs["capturable"][1]:
        # CUDA-graph capture needs the optimizer state on the accelerator; offloaded parameters keep it on CPU.
        problems.append(Problem(kwargs["capturable"][0], kwargs["capturable"][1],
                                "capturable=True cannot be used with CPU offload (the step runs on the CPU)"))
    return problems


def all_sharded(params: Any) -> bool:
    """Every parameter is an FSDP2 shard (a DTensor), in a list of tensors or of param groups (also used when an
    optimizer the script passed is rebuilt, :func:`torsh.engine.rebuild.build_step_optimizer`)."""
    import torch
    from torch.distributed.tensor import DTensor

    if not isinstance(params, (list, tuple)):
        return False  # an iterator: looking would consume it
    tensors = []
    for item in params:
        group = item["params"] if isinstance(item, dict) else item
        if isinstance(group, torch.Tensor):
            tensors.append(group)
        elif isinstance(group, (list, tuple)):
            tensors += group
        else:
            return False
    return bool(tensors) and all(isinstance(t, DTensor) for t in tensors)


#: torch optimizers whose step cannot run where the engine calls it, whatever the stage: refused at initialize
#: (naming what to use), not by a traceback at the first step.
_UNSTEPPABLE = {
    "LBFGS": "its step() needs a closure that re-evaluates the model, and engine.step() passes none (neither does "
             "DeepSpeed's): use Adam, AdamW or SGD",
    "SparseAdam": "it steps sparse gradients only, and the engine's reduced gradients are dense (as DeepSpeed's): "
                  "use Adam or AdamW",
}
#: torch optimizers whose step torch cannot run on FSDP2's DTensor shards (ZeRO-3, HSDP): it raises on their
#: in-place ops over a sharded tensor.
_NOT_ON_SHARDS = frozenset({"Adafactor", "Rprop"})


def check_steppable(cls: type, *, sharded: bool, key: str = "optimizer") -> None:
    """A ConfigError (naming ``key``) for a torch optimizer class the engine cannot step; ``sharded``: the step
    tensors are FSDP2's DTensor shards."""
    if not cls.__module__.startswith("torch.optim"):
        return
    name = cls.__name__
    reason = _UNSTEPPABLE.get(name)
    if reason is None and name in _NOT_ON_SHARDS and sharded:
        reason = ("torch cannot step it on FSDP2's sharded parameters (DTensor shards, ZeRO stage 3 or hybrid "
                  "sharding): use stage 0, 1 or 2, or Adam, AdamW or SGD")  # fmt: skip
    if reason is not None:
        raise ConfigError([Problem(key, name, f"torch.optim.{name} cannot be the engine's optimizer: {reason}")])


#: torch optimizers whose update of an element reads only that element (and the step count): exact on a flat
#: partition. Others need whole tensors (a norm per parameter, a matrix) and are refused at ZeRO stages 1 and 2.
ELEMENTWISE = frozenset({"Adam", "AdamW", "SGD", "Adagrad", "Adadelta", "Adamax", "RMSprop", "Rprop", "NAdam",
                         "RAdam", "ASGD", "SparseAdam"})  # fmt: skip


def check_elementwise(client: Any, section: Any, cls: type | None, stage: int) -> None:
    """ZeRO-1/2 step flat partitions: a ConfigError for a torch optimizer (the script's class ``cls``, or the one
    ``section`` names when the script passes none) that updates whole tensors."""
    name = cls.__name__ if cls is not None else (section.name if client is None and section is not None else None)
    if not name or name in ELEMENTWISE or (cls is not None and not cls.__module__.startswith("torch.optim")):
        return
    where = "stage 0" if name in _NOT_ON_SHARDS else "stage 0 or 3"
    key, value = ("sharding.stage", stage) if cls is not None else ("optimizer.name", name)
    raise ConfigError([Problem(key, value, f"{name} updates whole tensors (not element by element); ZeRO-{stage} "
                               "steps flat partitions of the parameters (as DeepSpeed's), where it would compute "
                               f"something else: use {where}, or an elementwise optimizer (Adam, AdamW, SGD, "
                               "Adagrad)")])  # fmt: skip
