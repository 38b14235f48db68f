"""ZeRO-3 leaf modules: a module whose parameters are gathered together when it runs, never per submodule
(Mixture-of-Experts blocks, where each rank calls a different subset of experts: per-expert gathers would wait on
ranks that never call them). DeepSpeed's flag (``_z3_leaf``, set by ``deepspeed.utils.set_z3_leaf_modules`` or the
config's ``zero_optimization.leaf_module``, whose default names the Mixtral and Qwen MoE blocks) is read when the
FSDP2 units are planned: a leaf's submodules are never units of their own, and each of its parameters gets a
gradient (zero when this rank's tokens skipped it), so every rank reduces the same tensors.
``deepspeed.utils.set_z3_leaf_modules`` and its siblings are these functions.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from torsh.config import LeafModules

log = logging.getLogger("torsh.engine")

#: DeepSpeed's ``deepspeed.utils`` functions (what ``from torsh.engine.zero.leaves import *`` gives the drop-in).
__all__ = ["get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules", "set_z3_leaf_modules_by_name",
           "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]  # fmt: skip

FLAG = "_z3_leaf"


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is flagged as a leaf module."""
    return bool(getattr(model, FLAG, False))


def z3_leaf_parameter(param: Any) -> bool:
    """Whether ``param`` is marked as belonging to a leaf module (DeepSpeed marks it while sharding)."""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` flagged as leaf modules."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    setattr(model, FLAG, flag)


def _matches(module: nn.Module, wanted: Any) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _flag_classes(model: nn.Module, classes: Any, flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    if not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"leaf_module_classes must be a list of classes or class names, got {classes!r}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    for module in found:
        set_z3_leaf_module(module, flag)
    if not found and raise_if_not_found:
        raise ValueError(f"No modules of type {classes} found in model {type(model).__name__}")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Flag every module of the given classes (classes, or class names plain or fully qualified); returns them.
    None found: ``ValueError`` (unless ``raise_if_not_found`` is False)."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Clear the flag on every module of the given classes; returns them."""
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found)


def _flag_names(model: nn.Module, wanted, flag: bool, raise_if_not_found: bool, by_suffix: bool):
    named = list(model.named_modules())
    found, missing = [], []
    for key in wanted:
        hits = [m for n, m in named if (n.endswith(key) if by_suffix else n == key)]
        if not hits:
            missing.append(key)
        for module in hits:
            set_z3_leaf_module(module, flag)
            found.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    return found, missing


def set_z3_leaf_modules_by_name(model: nn.Module, module_names, flag: bool = True, raise_if_not_found: bool = True):
    """Flag the modules named as in ``model.named_modules()``; returns (modules, names not found)."""
    return _flag_names(model, module_names, flag, raise_if_not_found, by_suffix=False)


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes, flag: bool = True,
                                  raise_if_not_found: bool = True):  # fmt: skip
    """Flag the modules whose name ends with one of the suffixes; returns (modules, suffixes not found)."""
    return _flag_names(model, module_name_suffixes, flag, raise_if_not_found, by_suffix=True)


#: DeepSpeed 0.19.8's ``zero_optimization.leaf_module`` defaults (``leaf_module_config.py``).
DEFAULT_CLASSES = ("transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                   "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                   "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock")  # fmt: skip


def apply_config(model: nn.Module, leaf_modules: LeafModules) -> list[nn.Module]:
    """Flag the leaf modules the plan names (DeepSpeed's ``zero_optimization.leaf_module``: ``classes``, ``names``,
    ``name_suffixes``; classes default to :data:`DEFAULT_CLASSES`, as DeepSpeed applies them to every model)."""
    classes = DEFAULT_CLASSES if leaf_modules.classes is None else leaf_modules.classes
    found = _flag_classes(model, list(classes), True, raise_if_not_found=False)
    for names, by_suffix in ((leaf_modules.names, False), (leaf_modules.name_suffixes, True)):
        if names:
            found += _flag_names(model, list(names), True, False, by_suffix=by_suffix)[0]
    unique = list({id(m): m for m in found}.values())
    if unique:
        log.info("sharding: ZeRO-3 leaf modules (parameters gathered together): %s",
                 ", ".join(sorted({type(m).__name__ for m in unique})))  # fmt: skip
    return unique


def inside_leaves(model: nn.Module) -> dict[int, nn.Module]:
    """``id(module) -> leaf`` for every module strictly inside a ZeRO-3 leaf module (DeepSpeed's ``_z3_leaf`` flag,
    set by ``deepspeed.utils.set_z3_leaf_modules``), the outermost leaf when leaves nest. A leaf's parameters are
    gathered together when it runs: an MoE block whose ranks each call other experts would wait forever on
    per-expert units."""
    found: dict[int, nn.Module] = {}

    def walk(module: nn.Module, leaf: nn.Module | None) -> None:
        for child in module.children():
            if leaf is not None:
                found[id(child)] = leaf
            walk(child, leaf if leaf is not None else child if z3_leaf_module(child) else None)

    walk(model, model if z3_leaf_module(model) else None)
    return found


def grads_for_every_parameter(module: nn.Module, args: Any, output: Any) -> Any:
    """A leaf module's output plus zero times each of its parameters: an expert no token of this rank picked still
    gets a (zero) gradient, so every rank reduce-scatters the same tensors (FSDP2 reduces only the parameters that
    have a gradient, and ranks routing to other experts would otherwise send different sizes); DeepSpeed's ZeRO-3
    also reduces zeros for them."""
    zero = sum(p.reshape(-1)[:1].sum() for p in module.parameters() if p.requires_grad) * 0.0
    if isinstance(output, torch.Tensor):
        return output + zero
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        if hasattr(output, "_fields"):  # a namedtuple
            return output._replace(**{output._fields[0]: output[0] + zero})
        return type(output)([output[0] + zero, *output[1:]])
    if getattr(module, "_torsh_leaf_warned", False):
        return output
    module._torsh_leaf_warned = True
    log.warning("sharding: the ZeRO-3 leaf module %s returns %s, not a tensor or a tuple starting with one: ranks "
                "whose tokens skip one of its experts may stall in the reduce-scatter", type(module).__name__,
                type(output).__name__)  # fmt: skip
    return output


def keep_leaves_whole(model: nn.Module, targets: list[nn.Module]) -> list[nn.Module]:
    """``targets`` with each unit inside a leaf module replaced by the leaf (one unit; the root needs none)."""
    leaf_of = inside_leaves(model)
    kept: list[nn.Module] = []
    for target in targets:
        leaf = leaf_of.get(id(target))
        if leaf is None:
            kept.append(target)
            continue
        if leaf is not model and all(leaf is not k for k in kept):
            kept.append(leaf)
        log.info("sharding: %s is not its own FSDP2 unit: it is inside the ZeRO-3 leaf module %s, whose parameters "
                 "are gathered together", type(target).__name__, type(leaf).__name__)  # fmt: skip
    return kept
