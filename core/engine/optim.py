"""The optimizer the engine steps, built after sharding: the one the script passed (rebuilt over the tensors the
step updates), a callable's, or the one the config's ``optimizer`` section names; and the script's optimizer and
scheduler re-pointed at it. :func:`build_step_optimizer` is the one entry point (ZeRO-1/2 build theirs over the
flat fp32 partition with the same pieces, :func:`torsh.engine.zero.partition.partition_and_optimizer`).

Why rebuild: ``fully_shard`` replaces every parameter with a new (DTensor) parameter, and low precision moves the
update onto fp32 master copies: an optimizer constructed by the training script before ``initialize`` holds the old
tensors and would silently not train (user pain 18). So a passed optimizer is rebuilt over the parameters the step
really updates, with its class, hyper-parameters and parameter groups; a callable is called with them. Where
nothing about the parameters changed (stage 0 in fp32: DDP keeps the module's own parameters) the script's
optimizer already holds the step tensors and is kept itself, as DeepSpeed keeps it.

A configured optimizer: the core model stores a ``torch.optim`` class name (the DeepSpeed adapter has already turned
DeepSpeed's ``"Adam"``, decoupled weight decay unless ``adam_w_mode: false``, into ``AdamW`` or ``Adam`` and written
DeepSpeed's weight-decay default of 0 explicitly). It is built over the (already sharded) parameters; DeepSpeed's
own optimizers torch has no class for (Lion, Lamb, Muon with its auxiliary Adam, mup's) are built by
:mod:`torsh.engine.optimizers`, the removed 1-bit ones refused, and every hyper-parameter is checked against the
class's constructor so that a misspelt or foreign keyword is a config error naming its key rather than a TypeError
deep inside torch. Optimizers the engine cannot step (LBFGS, SparseAdam; whole-tensor updates on ZeRO-1/2's flat
partitions) are refused at ``initialize``, naming what to use.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from torsh.config import OptimizerConfig
from torsh.deferred import is_deferred
from torsh.errors import ConfigError, Problem, did_you_mean

from . import optimizers

__all__ = ["UNSUPPORTED_OPTIMIZERS", "build_optimizer", "build_step_optimizer"]

log = logging.getLogger("torsh.engine")


# ---- the entry point: the optimizer over the step tensors ----------------------------------------------------


def build_step_optimizer(*, section: OptimizerConfig | None, client: Any, groups: list[dict],
                         name_of: dict[int, str], by_name: dict[str, torch.Tensor],
                         offload: bool) -> torch.optim.Optimizer | None:  # fmt: skip
    """The optimizer over ``by_name`` (the tensors the step updates), or None when there is none.

    ``client`` is what the script passed (an optimizer, a callable, or None); it overrides ``section``,
    which is built by :func:`build_optimizer`. An optimizer is rebuilt over ``by_name``
    unless it already holds those tensors (:func:`holds_step_tensors`); then it is returned itself. ``groups``
    are ``model_parameters`` as names (:func:`named_groups`, taken before sharding replaced the tensors).
    ZeRO-1/2 build theirs over the flat fp32 partition instead (:func:`torsh.engine.zero.partition.build_zero`).
    """
    _FLAT_NEXT[0] = None  # whole tensors or FSDP2 shards here, never flat partitions
    if isinstance(client, torch.optim.Optimizer):
        check_steppable(type(client), sharded=_sharded(by_name))
        if holds_step_tensors(client, name_of, by_name):
            return client  # DeepSpeed's stage 0 in fp32: the script's object steps (``initialize`` returns it)
        cls, defaults, named = rebuild_optimizer(client, name_of, by_name)
        params = _resolve(named, by_name)
        defaults, params = adopt_construction(cls, defaults, params)
        built = construct(cls, params, defaults)
        forward_client(client, built)  # schedulers on the script's optimizer drive the one that steps
        return built
    if callable(client):
        built = client(_resolve(groups, by_name))
        check_steppable(type(built), sharded=_sharded(by_name))
        return built
    if section is not None and section.name:
        groups = split_for(section, groups, by_name)
        return build_optimizer(section, _resolve(groups, by_name), offload=offload)
    return None


def split_for(section: OptimizerConfig | None, groups: list[dict], by_name: dict[str, torch.Tensor]) -> list[dict]:
    """``groups`` (by name) as the configured optimizer needs them before the engine shards the parameters:
    DeepSpeed's Muon splits each group into a Muon half (matrices) and an Adam half (the rest,
    :func:`torsh.engine.optimizers.split_groups`); other optimizers take them as they are. ``by_name``: the
    parameters (whole, or FSDP2 shards, whose shape is the whole shape)."""
    if section is None or optimizers.canonical(section.name or "") != "Muon":
        return groups
    settings = optimizers.muon_settings(_keywords(section))
    return optimizers.split_groups(groups, settings, shape_of=lambda n: tuple(by_name[n].shape),
                                   trainable=lambda n: n in by_name and by_name[n].requires_grad)  # fmt: skip


def holds_step_tensors(optimizer: torch.optim.Optimizer, name_of: dict[int, str],
                       by_name: dict[str, torch.Tensor]) -> bool:  # fmt: skip
    """Whether the script's optimizer can step as it is: each tensor in its groups is the very parameter the step
    updates (not replaced by sharding, not moved onto an fp32 master), and the implementation switches it was
    built with are the ones :func:`adopt_construction` would keep on them.

    DeepSpeed keeps the script's optimizer object when it puts no wrapper around it (stage 0, fp32): ``initialize``
    returns it and ``engine.optimizer`` is it. Its state (it may have stepped already) and every scheduler and
    reference the script holds stay valid without forwarding (:func:`forward_client`).
    """
    groups = optimizer.param_groups
    tensors = [p for g in groups for p in g["params"]]
    if not tensors or any(by_name.get(name_of.get(id(p), "")) is not p for p in tensors):
        return False
    on = _StepTensors.of(groups)
    notes: dict[str, None] = {}
    for values in (optimizer.defaults, *groups):
        adjusted = _adjusted(dict(values), on, notes)
        if any(adjusted.get(k) != values.get(k) for k in _SWITCHES):
            return False  # e.g. foreach left to torch over FSDP2 shards: rebuilt with foreach=True
    return True


def named_groups(params: Iterable[Any] | None, name_of: dict[int, str], all_names: list[str], *,
                 section: OptimizerConfig | None = None,
                 by_name: dict[str, torch.Tensor] | None = None) -> list[dict]:  # fmt: skip
    """``model_parameters`` (tensors or group dicts, DeepSpeed's argument) as groups of parameter *names*.

    With the configured ``section`` (when the script passes no optimizer) and the model's parameters ``by_name``,
    the groups are also split as that optimizer needs before the engine partitions them (:func:`split_for`:
    Muon's halves, which ZeRO-1/2 partition as groups of their own, as DeepSpeed's do)."""
    if params is None:
        out = [{"params": list(all_names)}]
    else:
        items = list(params)
        if not items:
            return [{"params": []}]
        groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
        out = [{**g, "params": _names_of(i, g["params"], name_of)} for i, g in enumerate(groups)]
        out = [g for g in out if g["params"]]  # DeepSpeed drops groups that end up empty
    return split_for(section, out, by_name) if by_name is not None else out


def _names_of(index: int, params: Any, name_of: dict[int, str]) -> list[str]:
    tensors = [params] if isinstance(params, torch.Tensor) else list(params)
    unknown = [t for t in tensors if id(t) not in name_of]
    if unknown:
        raise ConfigError([Problem(f"model_parameters[{index}]", tuple(unknown[0].shape), "is not a parameter of the "
                                   "model passed to initialize")])  # fmt: skip
    return [name_of[id(t)] for t in tensors]


def _resolve(groups: list[dict], by_name: dict[str, torch.Tensor]) -> list[dict]:
    return [{**g, "params": [by_name[n] for n in g["params"]]} for g in groups]


# ---- a configured optimizer -------------------------------------------------------------------------------

#: DeepSpeed optimizer names the engine does not build (lower-cased) -> what to use instead. (Lamb, Lion, Muon and
#: the mup optimizers are built by :mod:`torsh.engine.optimizers`.)
UNSUPPORTED_OPTIMIZERS = {
    "onebitadam": "AdamW (1-bit Adam was removed from DeepSpeed 0.19)",
    "zerooneadam": "AdamW (0/1 Adam was removed from DeepSpeed 0.19)",
    "onebitlamb": "Lamb (1-bit LAMB was removed from DeepSpeed 0.19)",
}

# Hyper-parameters with their own field in the core model, in the order the constructor usually takes them.
_TYPED_FIELDS = ("lr", "weight_decay", "betas", "eps", "momentum")


def _torch_optimizer_names() -> list[str]:
    return [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
            and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"]  # fmt: skip


def build_optimizer(section: OptimizerConfig | None, params: Any, *, offload: bool) -> Any:
    """The ``torch.optim`` optimizer the ``optimizer`` section names, over ``params`` (tensors or param groups).

    Returns None when there is no section or it names no class (the training script passes its own optimizer).
    ``offload``: the parameters live on the CPU (FSDP2 ``CPUOffloadPolicy``); the torch optimizer then steps on
    the CPU where they are (``capturable``, which needs accelerator-resident state, is refused). Unknown or
    DeepSpeed-only names, unresolved "auto" values and keywords the class does not take raise
    :class:`~torsh.errors.ConfigError`.
    """
    if section is None or section.name is None:
        return None
    flat_stage, _FLAT_NEXT[0] = _FLAT_NEXT[0], None
    if optimizers.canonical(section.name):
        problems = [Problem(path, value, "still 'auto': resolve it before the optimizer is built")
                    for path, value in _keywords(section).values() if is_deferred(value)]  # fmt: skip
        if problems:
            raise ConfigError(problems)
        built = optimizers.build(section.name, _keywords(section), params)
        if flat_stage is not None:
            optimizers.expect_flat(built, flat_stage)
        return built
    cls = _optimizer_class(section.name)
    check_steppable(cls, sharded=all_sharded(params), key="optimizer.name")
    kwargs = _keywords(section)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    problems = _keyword_problems(section.name, kwargs, accepted, offload)
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
    if name.lower() in UNSUPPORTED_OPTIMIZERS:
        raise ConfigError([Problem("optimizer.name", name,
                                   f"unsupported by the engine: use {UNSUPPORTED_OPTIMIZERS[name.lower()]}")])
    names = _torch_optimizer_names()
    if name not in names:
        raise ConfigError([Problem("optimizer.name", name, "not a torch.optim optimizer class",
                                   did_you_mean(name, names))])  # fmt: skip
    return getattr(torch.optim, name)


def _keywords(section: OptimizerConfig) -> dict[str, tuple[str, Any]]:
    """Keyword -> (dotted path for messages, value): the typed fields that are set, then ``optimizer.kwargs``."""
    kwargs: dict[str, tuple[str, Any]] = {}
    for field in _TYPED_FIELDS:
        value = getattr(section, field)
        if value is not None:
            kwargs[field] = (f"optimizer.{field}", value)
    for key, value in section.kwargs.items():
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


# ---- the script's optimizer, rebuilt over the step tensors ---------------------------------------------------


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
    cls, defaults = type(optimizer), optimizer.defaults
    inner = getattr(optimizer, "_optim_constructor", None)
    if _is_zero_redundancy(optimizer) and isinstance(inner, type):
        # torch's ZeroRedundancyOptimizer: the engine's ZeRO stage partitions (or not); its optimizer class steps
        log.info("initialize: the script's ZeroRedundancyOptimizer is rebuilt as its %s over the tensors the "
                 "step updates; the configured ZeRO stage decides the partition", inner.__name__)  # fmt: skip
        cls, defaults = inner, {**optimizer.defaults, **getattr(optimizer, "_optim_defaults", {})}
    check_steppable(cls, sharded=_sharded(by_name))
    return cls, _accepted(cls, defaults), groups


def construct(cls: type, params: list[dict], defaults: dict) -> torch.optim.Optimizer:
    """``cls(params, **defaults)``: the script's optimizer class built again over the tensors the step updates; a
    class that cannot be built from its parameter groups and ``defaults`` (a wrapper taking another optimizer) is a
    ConfigError saying what to pass instead."""
    flat_stage, _FLAT_NEXT[0] = _FLAT_NEXT[0], None
    try:
        built = cls(params, **defaults)
    except TypeError as exc:
        raise ConfigError([Problem("optimizer", cls.__name__, f"the optimizer passed to initialize is rebuilt over "
                                   f"the tensors the step updates (sharded parameters or fp32 masters) as "
                                   f"{cls.__name__}(param_groups, **defaults), which fails: {exc}; pass the "
                                   "optimizer it wraps, a callable that builds it from parameters, or configure "
                                   "the optimizer section")]) from None  # fmt: skip
    if flat_stage is not None and isinstance(built, (optimizers.Lamb, optimizers.MuonWithAuxAdam)):
        optimizers.expect_flat(built, flat_stage)
    return built


def _sharded(by_name: dict[str, torch.Tensor]) -> bool:
    return bool(by_name) and all_sharded([list(by_name.values())])


def _is_zero_redundancy(optimizer: Any) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


#: Implementation switches of torch optimizers: how the step runs, not what it computes (per group and default).
_SWITCHES = ("fused", "foreach", "capturable", "differentiable")


def adopt_construction(cls: type, defaults: dict, groups: list[dict]) -> tuple[dict, list[dict]]:
    """The script's implementation switches (``fused``, ``foreach``, ``capturable``, ``differentiable``), kept as
    torch allows them on the tensors the step updates; each one changed is logged.

    The script chose them for its own parameters; the step tensors may differ (fp32 masters, FSDP2 shards, CPU
    offload): ``fused`` needs floating-point tensors on a device with fused kernels (the CPU has them), and
    ``capturable`` a device with CUDA-graph support. ``fused`` excludes ``foreach``; when the script left
    ``foreach`` to torch (None, not fused), FSDP2 shards get ``foreach=True``, as a configured optimizer does
    (:func:`build_optimizer`): one DTensor dispatch per list instead of one per tensor.
    """
    where = _StepTensors.of(groups)
    notes: dict[str, None] = {}  # each change logged once, not once per group
    new_defaults = _adjusted(defaults, where, notes)
    new_groups = []
    for g in groups:
        if any(k in g for k in _SWITCHES):
            # torch copies the defaults into every group, so the group's own switches are the ones used
            g = {**g, **{k: v for k, v in _adjusted(g, where, notes).items() if k in _SWITCHES}}
        new_groups.append(g)
    for note in notes:
        log.warning("%s rebuilt over the step tensors: %s", cls.__name__, note)
    return new_defaults, new_groups


@dataclass(frozen=True)
class _StepTensors:
    """What decides the implementation switches torch allows on the tensors the step updates."""

    where: str
    floating: bool
    fused_ok: bool
    capturable: tuple[str, ...]
    devices: frozenset[str]
    sharded: bool

    @classmethod
    def of(cls, groups: list[dict]) -> _StepTensors:
        from torch.optim.optimizer import _get_capturable_supported_devices
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        tensors = [t for g in groups for t in g["params"]]
        devices = {t.device.type for t in tensors}
        floating = all(t.is_floating_point() for t in tensors)
        return cls(where="/".join(sorted(devices)) or "no device", floating=floating,
                   fused_ok=devices <= set(_get_fused_kernels_supported_devices()) and floating,
                   capturable=tuple(_get_capturable_supported_devices()), devices=frozenset(devices),
                   sharded=all_sharded(groups))  # fmt: skip


def _adjusted(values: dict, on: _StepTensors, notes: dict[str, None]) -> dict:
    """``values``' switches as torch allows them ``on`` the step tensors; each change noted."""
    values = _fused_adjusted(dict(values), on, notes)
    if values.get("capturable") and on.devices - set(on.capturable):
        notes[f"capturable=True needs the step tensors on {'/'.join(on.capturable)}; they are on "
              f"{on.where}: capturable=False"] = None
        values["capturable"] = False
    if "foreach" in values and values["foreach"] is None and not values.get("fused") and on.sharded:
        values["foreach"] = True  # left to torch by the script: foreach over FSDP2 shards, as configured ones
    return values


def _fused_adjusted(values: dict, on: _StepTensors, notes: dict[str, None]) -> dict:
    if values.get("fused") and values.get("differentiable"):
        notes["fused=True does not support differentiable=True: fused=False"] = None
        values["fused"] = False
    if values.get("fused") and not on.fused_ok:
        notes[f"fused=True needs floating-point tensors on a device with fused kernels; the step tensors are "
              f"{'floating point' if on.floating else 'not all floating point'} on {on.where}: fused=False"] = None
        values["fused"] = False
    if values.get("fused") and values.get("foreach"):
        notes["fused=True and foreach=True cannot be combined: fused is kept, foreach=None"] = None
        values["foreach"] = None
    return values


def _accepted(cls: type, kwargs: dict) -> dict:
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


# ---- what the engine can step -------------------------------------------------------------------------------


def all_sharded(params: Any) -> bool:
    """Every parameter is an FSDP2 shard (a DTensor), in a list of tensors or of param groups (also used when an
    optimizer the script passed is rebuilt, :func:`build_step_optimizer`)."""
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
#: DeepSpeed's Lion is elementwise too; its Lamb and Muon read whole parameters and gather what they need
#: (:mod:`torsh.engine.optimizers.pieces`).
ELEMENTWISE = frozenset({"Adam", "AdamW", "SGD", "Adagrad", "Adadelta", "Adamax", "RMSprop", "Rprop", "NAdam",
                         "RAdam", "ASGD", "SparseAdam"})  # fmt: skip

#: The ZeRO-1/2 stage the next optimizer built by :func:`build_optimizer` or :func:`construct` steps flat masters
#: at, when it is a whole-tensor optimizer of :mod:`torsh.engine.optimizers` (set by :func:`check_elementwise`,
#: which the ZeRO-1/2 builders call just before they build it; cleared by every build).
_FLAT_NEXT: list[int | None] = [None]


def check_elementwise(client: Any, section: OptimizerConfig | None, cls: type | None, stage: int) -> None:
    """ZeRO-1/2 step flat partitions: a ConfigError for a torch optimizer (the script's class ``cls``, or the one
    ``section`` names when the script passes none) that updates whole tensors. DeepSpeed's optimizers built by
    :mod:`torsh.engine.optimizers` run there (Lamb and Muon gather what they need; the one built next is told)."""
    name = cls.__name__ if cls is not None else (section.name if client is None and section is not None else None)
    _FLAT_NEXT[0] = stage if _whole_tensor_ours(cls, name) else None
    if not name or name in ELEMENTWISE or (cls is not None and not cls.__module__.startswith("torch.optim")):
        return
    if cls is None and optimizers.canonical(name):
        return
    where = "stage 0" if name in _NOT_ON_SHARDS else "stage 0 or 3"
    key, value = ("sharding.stage", stage) if cls is not None else ("optimizer.name", name)
    raise ConfigError([Problem(key, value, f"{name} updates whole tensors (not element by element); ZeRO-{stage} "
                               "steps flat partitions of the parameters (as DeepSpeed's), where it would compute "
                               f"something else: use {where}, or an elementwise optimizer (Adam, AdamW, SGD, "
                               "Adagrad, Lion)")])  # fmt: skip


def _whole_tensor_ours(cls: type | None, name: str | None) -> bool:
    if cls is not None:
        return issubclass(cls, (optimizers.Lamb, optimizers.MuonWithAuxAdam))
    return bool(name) and optimizers.canonical(name) in optimizers.WHOLE_TENSOR


# ---- the script's optimizer and scheduler, re-pointed at the one that steps ---------------------------------


def forward_client(client: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> None:
    """Make the script's optimizer a view of the rebuilt one: the same ``param_groups`` (list and dicts) and ``state``.

    Under DeepSpeed the script's optimizer keeps stepping (its ZeRO optimizer wraps it and steps it over the flat
    fp32 partitions), so everything that holds the script's object sees the learning rate that is used: a
    scheduler built before ``initialize`` and not passed to it (the Trainer of transformers 4.x, Accelerate's
    ``prepare`` of a torch scheduler), one built after on the object the script still holds, and a script's own
    ``for g in optimizer.param_groups: g["lr"] = ...``. Re-pointing ``scheduler.optimizer`` reaches only a
    scheduler passed to ``initialize`` (:func:`rebind_scheduler`); the others cannot be found from here. Sharing
    the groups reaches all of them in any order, since a scheduler reads ``optimizer.param_groups`` at every
    step. The groups were copied with ``lr``/``initial_lr``, so a schedule already started continues. torch's
    "lr_scheduler.step() before optimizer.step()" check reads ``_opt_called`` on the script's object: the
    rebuilt optimizer's step sets it there too. torch's ``load_state_dict`` (a checkpoint resumed) puts new
    ``param_groups`` and ``state`` on the rebuilt optimizer; the script's object is pointed at those again, so that
    it shows the restored learning rate and its schedulers keep reaching the step.
    """
    if client is optimizer:
        return
    client.param_groups = optimizer.param_groups
    client.state = optimizer.state
    ref = weakref.ref(client)

    def mark_stepped(*_args, **_kwargs):
        opt = ref()
        if opt is not None:
            opt._opt_called = True  # type: ignore[attr-defined]

    def share_loaded(loaded: torch.optim.Optimizer) -> None:
        opt = ref()
        if opt is not None:
            opt.param_groups = loaded.param_groups
            opt.state = loaded.state

    optimizer.register_step_post_hook(mark_stepped)
    optimizer.register_load_state_dict_post_hook(share_loaded)


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
