"""The optimizer, always built after sharding (also when the script passed one), and its scheduler re-pointed.

``fully_shard`` replaces every parameter with a new (DTensor) parameter, and low precision moves the update
onto fp32 master copies: an optimizer constructed by the training script before ``initialize`` holds the old
tensors and would silently not train (user pain 18). So a passed optimizer is rebuilt over the parameters the
step really updates, with its class, hyper-parameters and parameter groups; a callable is called with them.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from torsh.config import OptimizerConfig
from torsh.errors import ConfigError, Problem

from .optim import all_sharded

log = logging.getLogger("torsh.engine")


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


def build_step_optimizer(*, section: OptimizerConfig | None, client: Any, groups: list[dict],
                    name_of: dict[int, str], by_name: dict[str, torch.Tensor], wrapper: str | None,
                    offload: bool) -> torch.optim.Optimizer | None:  # fmt: skip
    """The optimizer over ``by_name`` (the tensors the step updates), or None when there is none.

    ``client`` is what the script passed (an optimizer, a callable, or None); it overrides ``section``,
    which is built by :func:`torsh.engine.optim.build_optimizer`. ``groups`` are ``model_parameters`` as
    names (:func:`named_groups`, taken before sharding replaced the tensors). ``wrapper`` is the plan's
    (:attr:`torsh.plan.EnginePlan.optimizer_wrapper`): ``"ZeroRedundancyOptimizer"`` shards the state (ZeRO-1).
    """
    if isinstance(client, torch.optim.Optimizer):
        cls, defaults, named = rebuild_optimizer(client, name_of, by_name)
        params = _resolve(named, by_name)
        if defaults.get("foreach", False) is None and all_sharded(params):
            defaults["foreach"] = True  # left to torch by the script: foreach over FSDP2 shards, as configured ones
        built = cls(params, **defaults)
    elif callable(client):
        built = client(_resolve(groups, by_name))
    elif section is not None and section.name:
        from .optim import build_optimizer as build_configured

        built = build_configured(section, _resolve(groups, by_name), offload=offload)
    else:
        return None
    if wrapper is None:
        return built
    # ZeRO-1: the same class, hyper-parameters and groups, with the state sharded across ranks.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups = [dict(g) for g in built.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(built), **_accepted(type(built), built.defaults))


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
