"""The optimizer, always built after sharding, and the user's scheduler re-pointed at it.

``fully_shard`` replaces every parameter with a new (DTensor) parameter, and low precision moves the update
onto fp32 master copies: an optimizer constructed by the training script before ``initialize`` holds the old
tensors and would silently not train (user pain 18). So a passed optimizer is rebuilt over the parameters the
step really updates, with its class, hyper-parameters and parameter groups; a callable is called with them.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from torsh.config import OptimizerConfig
from torsh.deferred import is_deferred
from torsh.errors import ConfigError, Problem

log = logging.getLogger("torsh.engine")

#: DeepSpeed optimizer names without a torch.optim equivalent, and why.
UNSUPPORTED = {
    "lamb": "DeepSpeed's FusedLamb has no torch.optim equivalent (and does not run on CPU in DeepSpeed either)",
    "lion": "DeepSpeed's FusedLion has no torch.optim equivalent",
    "onebitadam": "1-bit Adam was removed in DeepSpeed 0.19.8",
    "zerooneadam": "0/1 Adam was removed in DeepSpeed 0.19.8",
    "onebitlamb": "1-bit LAMB was removed in DeepSpeed 0.19.8",
    "muadam": "mup optimizers need the mup package", "muadamw": "mup optimizers need the mup package",
    "musgd": "mup optimizers need the mup package",
    "muon": "DeepSpeed's Muon splits parameters differently from torch.optim.Muon",
}  # fmt: skip

#: DeepSpeed-only keys of ``optimizer.params`` consumed here, never passed to the torch constructor.
DEEPSPEED_KEYS = ("adam_w_mode", "torch_adam", "fp32_optimizer_states", "bias_correction")


def named_groups(params: Iterable[Any] | None, name_of: dict[int, str], all_names: list[str]) -> list[dict]:
    """``model_parameters`` (tensors or group dicts, DeepSpeed's argument) as groups of parameter *names*."""
    if params is None:
        return [{"params": list(all_names)}]
    items = list(params)
    if not items:
        return [{"params": []}]
    if isinstance(items[0], dict):
        groups = [dict(g) for g in items]
    else:
        groups = [{"params": items}]
    out = []
    for i, g in enumerate(groups):
        tensors = g["params"] if isinstance(g["params"], (list, tuple)) else list(g["params"])
        if isinstance(g["params"], torch.Tensor):
            tensors = [g["params"]]
        names = []
        for t in tensors:
            if id(t) not in name_of:
                raise ConfigError([Problem(f"model_parameters[{i}]", tuple(t.shape), "is not a parameter of the "
                                           "model passed to initialize")])  # fmt: skip
            names.append(name_of[id(t)])
        out.append({**g, "params": names})
    return [g for g in out if g["params"]]  # DeepSpeed drops groups that end up empty


def _resolve(groups: list[dict], by_name: dict[str, torch.Tensor]) -> list[dict]:
    return [{**g, "params": [by_name[n] for n in g["params"]]} for g in groups]


def rebuild_optimizer(optimizer: torch.optim.Optimizer, name_of: dict[int, str],
                      by_name: dict[str, torch.Tensor]) -> tuple[type, dict, list[dict]]:  # fmt: skip
    """Class, constructor defaults and name-keyed parameter groups of an optimizer built by the script."""
    if getattr(optimizer, "state", None) and any(optimizer.state.values()):
        log.warning("the optimizer passed to initialize already has state (it has stepped); it is rebuilt over "
                    "the sharded parameters and that state is discarded")  # fmt: skip
    groups = []
    for i, g in enumerate(optimizer.param_groups):
        try:
            names = [name_of[id(p)] for p in g["params"]]
        except KeyError:
            raise ConfigError([Problem(f"optimizer.param_groups[{i}]", None, "holds a tensor that is not a "
                                       "parameter of the model passed to initialize")]) from None  # fmt: skip
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    return type(optimizer), _accepted(type(optimizer), optimizer.defaults), groups


def _accepted(cls: type, kwargs: dict) -> dict:
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


def optimizer_from_config(section: OptimizerConfig) -> tuple[type, dict]:
    """The torch class and keyword arguments for a config's optimizer, with DeepSpeed's names and defaults.

    ``Adam`` means AdamW (decoupled weight decay) unless ``adam_w_mode`` is false, and weight decay is 0
    unless set, as DeepSpeed's FusedAdam; with ``torch_adam`` true torch's own defaults apply (AdamW: 0.01).
    Any other name is a ``torch.optim`` class.
    """
    name = section.name or ""
    key = name.lower()
    extra = dict(section.kwargs)
    ds = {k: extra.pop(k) for k in DEEPSPEED_KEYS if k in extra}
    if key in UNSUPPORTED:
        raise ConfigError([Problem("optimizer.name", name, f"is not supported by the torsh engine: "
                                   f"{UNSUPPORTED[key]}; use AdamW, Adam, SGD or another torch.optim class")])
    if ds.get("bias_correction", True) is False:
        raise ConfigError([Problem("optimizer.kwargs.bias_correction", False, "Adam without bias correction has "
                                   "no torch.optim equivalent; remove it")])  # fmt: skip
    kwargs: dict[str, Any] = {"lr": section.lr}
    for field in ("weight_decay", "betas", "eps", "momentum"):
        value = getattr(section, field)
        if value is not None:
            kwargs[field] = tuple(value) if field == "betas" else value
    if key in ("adam", "adamw"):
        adamw = key == "adamw" or ds.get("adam_w_mode", True)
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        if not ds.get("torch_adam", False):
            kwargs.setdefault("weight_decay", 0.0)  # DeepSpeed's FusedAdam default, not torch AdamW's 0.01
    else:
        cls = getattr(torch.optim, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            options = [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                       and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"]  # fmt: skip
            from torsh.errors import did_you_mean

            raise ConfigError([Problem("optimizer.name", name, "is neither a DeepSpeed optimizer nor a torch.optim "
                                       "class", did_you_mean(name, options))])  # fmt: skip
    kwargs.update(extra)
    deferred = [k for k, v in kwargs.items() if is_deferred(v)]
    if deferred:
        raise ConfigError([Problem(f"optimizer.{k}", "auto", "was not resolved") for k in deferred])
    return cls, kwargs


def build_optimizer(*, section: OptimizerConfig | None, client: Any, groups: list[dict],
                    name_of: dict[int, str], by_name: dict[str, torch.Tensor],
                    zero_stage1: bool) -> torch.optim.Optimizer | None:  # fmt: skip
    """The optimizer over ``by_name`` (the tensors the step updates), or None when there is none.

    ``client`` is what the script passed (an optimizer, a callable, or None); it overrides ``section``.
    ``groups`` are ``model_parameters`` as names (:func:`named_groups`, taken before sharding replaced the
    tensors). ``zero_stage1`` wraps the result in ``ZeroRedundancyOptimizer`` (optimizer state sharded).
    """
    if isinstance(client, torch.optim.Optimizer):
        cls, defaults, groups = rebuild_optimizer(client, name_of, by_name)
    elif callable(client):
        groups = _resolve(groups, by_name)
        built = client(groups)
        if not zero_stage1:
            return built
        cls, defaults = type(built), _accepted(type(built), built.defaults)
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": g["params"]}
                  for g in built.param_groups]  # fmt: skip
        return _zero(cls, defaults, groups)
    elif section is not None and section.name:
        cls, defaults = optimizer_from_config(section)
    else:
        return None
    groups = _resolve(groups, by_name)
    if zero_stage1:
        return _zero(cls, defaults, groups)
    return cls(groups, **defaults)


def _zero(cls: type, defaults: dict, groups: list[dict]):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **defaults)


def rebind_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """Point a scheduler built on the script's (discarded) optimizer at the rebuilt one.

    The groups were copied with their ``lr``/``initial_lr``, so the schedule continues unchanged; torch's
    "optimizer.step() was overridden" check is satisfied the same way the scheduler itself does it.
    """
    scheduler.optimizer = optimizer
    step = optimizer.step
    if not hasattr(step, "_wrapped_by_lr_sched"):
        ref = weakref.ref(optimizer)

        def counted_step(*args, **kwargs):
            opt = ref()
            if opt is not None:
                opt._opt_called = True
            return step(*args, **kwargs)

        counted_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = counted_step  # type: ignore[method-assign]
    return scheduler


def call_scheduler(factory: Callable, optimizer: torch.optim.Optimizer) -> Any:
    """A scheduler callable is called with the optimizer, as DeepSpeed calls it with the basic optimizer."""
    return factory(optimizer)
