"""Which modules become their own sharding unit: the wrap policy (module classes, a parameter count, or each child
holding parameters), kept from splitting a tied parameter between units."""

from __future__ import annotations

import logging

from torch import nn

from torsh.config import WrapPolicy
from torsh.errors import ConfigError, Problem

log = logging.getLogger("torsh.engine")


def wrap_targets(model: nn.Module, wrap: WrapPolicy) -> list[nn.Module]:
    """The submodules that become their own FSDP2 unit, innermost first (the root is wrapped after them).

    ``module_classes``: every module of those classes; ``min_num_params``: every module holding at least that
    many parameters not already in a smaller unit; neither: each direct child that holds parameters. Containers
    without a forward of their own (``ModuleList``, ``ModuleDict``: a model's ``layers``) are never a unit; their
    children are considered in their place.
    """
    if wrap.module_classes:
        return modules_of_classes(model, wrap.module_classes, "sharding.wrap.module_classes")
    if wrap.min_num_params:
        return _by_size(model, wrap.min_num_params)
    return [child for child in _children(model) if any(True for _ in child.parameters())]


def _by_size(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """Innermost first, every module (not the root, not a container) holding at least ``min_num_params``
    parameters that no unit found before it holds."""
    targets, covered = [], set()
    for m in _post_order(model):
        if m is model or _is_container(m):
            continue
        own = [p for p in m.parameters() if id(p) not in covered]
        if sum(p.numel() for p in own) >= min_num_params:
            targets.append(m)
            covered.update(id(p) for p in own)
    return targets


def keep_ties_in_one_unit(model: nn.Module, targets: list[nn.Module]) -> list[nn.Module]:
    """``targets`` without the units that would split a tied parameter from another of its owners.

    A parameter held by several modules (a Hugging Face ``lm_head.weight`` that *is* ``embed_tokens.weight``)
    must be managed by one FSDP2 unit: a unit is kept only if it contains every owner of each tied parameter
    it contains; the owners of a dropped unit fall to the smallest enclosing unit (at worst the root).
    Ties are found by parameter identity.
    """
    tied = _tied_owners(model)
    if not tied:
        return targets
    kept = []
    for target in targets:
        if _splits_a_tie(target, tied):
            log.info("sharding: %s is not its own FSDP2 unit: it shares a tied parameter with a module outside it "
                     "(the parameter stays in one enclosing unit)", type(target).__name__)  # fmt: skip
        else:
            kept.append(target)
    return kept


def _tied_owners(model: nn.Module) -> list[list[nn.Module]]:
    """For each parameter held by more than one module (its own or registered as external), those modules."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
        for p in getattr(module, "_external_params", {}).values():  # deepspeed.zero.register_external_parameter
            owners.setdefault(id(p), []).append(module)
    return [mods for mods in owners.values() if len(mods) > 1]


def _splits_a_tie(target: nn.Module, tied: list[list[nn.Module]]) -> bool:
    """``target`` contains some but not all owners of a tied parameter."""
    inside = {id(m) for m in target.modules()}
    return any(0 < sum(id(m) in inside for m in mods) < len(mods) for mods in tied)


def modules_of_classes(model: nn.Module, classes: list[str], key: str) -> list[nn.Module]:
    """The submodules (not the root) whose class name is listed; a name no module has is an error naming ``key``."""
    known = {type(m).__name__ for m in model.modules()}
    missing = [c for c in classes if c not in known]
    if missing:
        raise ConfigError([Problem(key, missing, f"no module of these classes in the model; its classes are "
                                   f"{sorted(known)}")])  # fmt: skip
    return [m for m in model.modules() if m is not model and type(m).__name__ in classes]


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _children(module: nn.Module):
    """Direct children, looking through forward-less containers."""
    for child in module.children():
        if _is_container(child):
            yield from _children(child)
        else:
            yield child


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module
