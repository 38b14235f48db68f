"""FSDP2 units of a model, grouped as DeepSpeed fills its buckets.

FSDP2 issues one all-gather and one reduce-scatter per unit, so a unit's parameter count *is* its collective size:
small units (one block each) keep the fewest parameters gathered, large ones make fewer, larger collectives.
:func:`plan_units` groups consecutive blocks until a group holds about one DeepSpeed bucket
(:func:`torsh.sharding_plan.unit_target`), never more than half of ``max_live_parameters`` at stage 3 (FSDP2 holds
two units gathered at a time: the one computing and the one prefetched), keeps a stage-3 unit gathered from forward
to backward when DeepSpeed would (:func:`reuse_within`), and says why for every unit. The sizes and the policy come
from the engine plan's sharding section (:class:`torsh.sharding_plan.ShardingPlan`); this module adds the model.
Importing it does not import torch; the functions given a model do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torsh.config import ShardingConfig, WrapPolicy
from torsh.sharding_plan import (
    BucketSettings,
    ShardingPlan,
    bucket_settings,
    count,
    resolve_policy,
    unit_cap,
    unit_target,
)

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("torsh.engine")


# ------------------------------------------------------------------------------------------------
# FSDP2 units (stages 2 and 3)


@dataclass(frozen=True)
class Unit:
    """One FSDP2 unit: ``fully_shard`` over these modules (names as in ``model.named_modules()``), together."""

    modules: tuple[str, ...]
    numel: int
    reason: str
    reshard_after_forward: bool | None = None
    """This unit's own ``reshard_after_forward``; None: the sharding section's (as the stage implies)."""


@dataclass(frozen=True)
class UnitPlan:
    """The units of a model, in execution order (the root is wrapped after them and holds the rest)."""

    policy: str
    units: tuple[Unit, ...]
    root_numel: int
    """Parameters left to the root unit (embeddings, final norm, head: whatever no unit holds)."""
    summary: str
    """One line: the policy and the sizes that decided it."""

    def describe(self) -> list[str]:
        """What the engine log and ``explain`` print: the policy, each unit with its reason, the root."""
        lines = [self.summary]
        lines += [f"unit {i}: {_span(u.modules)} ({count(u.numel)} parameters): {u.reason}"
                  for i, u in enumerate(self.units)]  # fmt: skip
        lines.append(f"root: the remaining {count(self.root_numel)} parameters")
        return lines


def plan_units(model: nn.Module, layout: ShardingPlan, *, policy: str | None = None) -> UnitPlan:
    """The FSDP2 units of ``model`` for the plan's stage (2 or 3) and why each was chosen.

    ``"buckets"``: consecutive blocks of the model's repeated-block container grouped up to
    :func:`~torsh.sharding_plan.unit_target` parameters, bounded by :func:`~torsh.sharding_plan.unit_cap`;
    ``"per_layer"``: each block its own unit (the fewest parameters gathered: memory first); ``"wrap"``: the plan's
    wrap policy as written; ``"children"``: each direct child holding parameters. ``policy`` None: the plan's.
    """
    chosen = layout.policy if policy is None else resolve_policy(ShardingConfig(), policy)
    if chosen in ("wrap", "children"):
        return _plan_from_wrap(model, layout.wrap, chosen)
    found = find_blocks(model)
    if found is None:
        plan = _plan_from_wrap(model, layout.wrap, "children")
        return UnitPlan(chosen, plan.units, plan.root_numel,
                        f"units ({chosen}): no repeated-block container (a ModuleList or Sequential of two or more "
                        "modules of one class) in the model, so each direct child holding parameters is a unit")
    container, blocks = found
    total = _numel(model.parameters())
    if chosen == "per_layer":
        units = tuple(Unit((name,), size, "per layer: the fewest parameters gathered at once (memory first)")
                      for name, size in blocks)  # fmt: skip
        summary = f"units (per_layer): each of the {len(blocks)} blocks of {container} is its own unit"
    else:
        units, summary = _bucket_units(container, blocks, total, layout)
    return UnitPlan(chosen, units, total - sum(u.numel for u in units), summary)


def _bucket_units(container: str, blocks: list[tuple[str, int]], total: int,
                  layout: ShardingPlan) -> tuple[tuple[Unit, ...], str]:  # fmt: skip
    """The ``"buckets"`` policy: the blocks grouped by :func:`group_blocks` and, at stage 3 without an explicit
    ``reshard_after_forward``, those DeepSpeed reuses kept gathered (:func:`reuse_within`); and the summary."""
    settings = layout.buckets or bucket_settings(None)  # "buckets" asked for by name: DeepSpeed's defaults
    target, target_why = unit_target(settings, layout.stage)
    cap, cap_why = unit_cap(settings, layout.stage)
    units = group_blocks(blocks, target, cap)
    summary = (f"units (buckets): consecutive blocks of {container} grouped up to {count(target)} parameters, "
               f"the smaller of DeepSpeed's reduce and gather buckets: {target_why}"
               + (f"; at most {count(cap)} per unit, {cap_why}" if cap else ""))  # fmt: skip
    if layout.stage == 3 and layout.reshard_after_forward is None:
        units = reuse_within(units, total - sum(u.numel for u in units), settings)
    return units, summary


def reuse_within(units: tuple[Unit, ...], root_numel: int, settings: BucketSettings) -> tuple[Unit, ...]:
    """Stage-3 units DeepSpeed would keep gathered from forward to backward: not resharded after forward.

    After a submodule's forward, DeepSpeed's ZeRO-3 frees a parameter only if the modules that run before its next
    use (the rest of forward, then backward down to it) hold ``stage3_max_reuse_distance`` elements or more; with
    the default 1e9, a smaller model keeps every parameter gathered until backward, as FSDP2 does with
    ``reshard_after_forward=False``. A unit's distance is bounded here by twice the parameters of the units after
    it and of the root (which holds the head and final norm that run between): a unit below the window keeps its
    parameters, the others are resharded as stage 3 implies.
    """
    window = settings.max_reuse_distance
    later = [sum(u.numel for u in units[i + 1:]) for i in range(len(units))]
    kept = []
    for unit, after in zip(units, later):
        distance = 2 * (after + root_numel)
        if distance < window:
            unit = replace(unit, reshard_after_forward=False,
                           reason=f"{unit.reason}; kept gathered from forward to backward: reused within "
                                  f"{count(distance)} parameters, below {settings.describe('max_reuse_distance')}")
        kept.append(unit)
    return tuple(kept)


def group_blocks(blocks: list[tuple[str, int]], target: int, cap: int | None = None) -> tuple[Unit, ...]:
    """Consecutive ``(name, parameter count)`` blocks grouped as DeepSpeed fills its buckets: a block joins the
    open group while the group stays within ``target`` (and ``cap``), else it opens the next group; a block
    larger than both is a unit alone (a block is never split)."""
    limit = min(target, cap) if cap else target
    groups: list[list[tuple[str, int]]] = []
    for name, size in blocks:
        if groups and sum(s for _, s in groups[-1]) + size <= limit:
            groups[-1].append((name, size))
        else:
            groups.append([(name, size)])
    units = []
    for i, group in enumerate(groups):
        numel = sum(s for _, s in group)
        following = groups[i + 1][0] if i + 1 < len(groups) else None
        units.append(Unit(tuple(n for n, _ in group), numel, _group_reason(group, numel, following, target, cap)))
    return tuple(units)


def _group_reason(group, numel: int, following, target: int, cap: int | None) -> str:
    if len(group) == 1 and numel > (min(target, cap) if cap else target):
        over = "the per-unit bound" if cap and numel > cap else "the target"
        return f"one block of {count(numel)} is already above {over}; a block is never split"
    if following is None:
        return f"{len(group)} block(s), {count(numel)} <= {count(target)}: the last blocks"
    bound = "the per-unit bound" if cap and cap < target and numel + following[1] > cap else "the target"
    return (f"{len(group)} block(s), {count(numel)} <= {count(target)}; adding {following[0]} "
            f"({count(following[1])}) would exceed {bound}")


def find_blocks(model: nn.Module) -> tuple[str, list[tuple[str, int]]] | None:
    """The model's repeated-block container and its blocks ``(name, parameters)``: the ``ModuleList`` or
    ``Sequential`` of two or more children of one class that holds the most parameters (``layers``, ``h``,
    ``encoder.layer`` ...), never one inside a ZeRO-3 leaf module (an MoE block's experts). Blocks sharing a
    parameter with modules outside them (tied weights) are left out: a shared parameter must stay in one unit, the
    root. None when the model has no such container."""
    best = _largest_block_list(model)
    if best is None:
        return None
    container, children = best
    owners: dict[int, set[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), set()).add(pname)
    blocks = []
    for child, block in children:
        size = _numel(block.parameters())
        if size and _owns_its_parameters(block, f"{container}.{child}.", owners):
            blocks.append((f"{container}.{child}", size))
    return (container, blocks) if blocks else None


def _largest_block_list(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]] | None:
    """The ``ModuleList`` or ``Sequential`` (not the model itself, not inside a ZeRO-3 leaf) of two or more
    children of one class holding the most parameters: its name and its named children."""
    from torch import nn

    from .leaves import inside_leaves, z3_leaf_module

    in_leaf = inside_leaves(model)
    best, best_size = None, 0
    for name, module in model.named_modules():
        if module is model or not isinstance(module, (nn.ModuleList, nn.Sequential)) or id(module) in in_leaf \
                or z3_leaf_module(module):
            continue
        children = list(module.named_children())
        if len(children) < 2 or len({type(c) for _, c in children}) != 1:
            continue
        size = _numel(module.parameters())
        if size > best_size:
            best, best_size = (name, children), size
    return best


def _owns_its_parameters(block: nn.Module, prefix: str, owners: dict[int, set[str]]) -> bool:
    """No parameter of ``block`` is also held by a module outside it (a tied weight)."""
    return all(all(n.startswith(prefix) for n in owners[id(p)]) for p in block.parameters())


def _plan_from_wrap(model: nn.Module, wrap: WrapPolicy, policy: str) -> UnitPlan:
    from .leaves import keep_leaves_whole
    from .wrap import keep_ties_in_one_unit, wrap_targets  # the engine's own policies (imports torch)

    wrap = wrap if policy == "wrap" else WrapPolicy()
    names = {id(m): n for n, m in model.named_modules()}
    targets = keep_ties_in_one_unit(model, keep_leaves_whole(model, wrap_targets(model, wrap)))
    why = ("sharding.wrap.module_classes" if wrap.module_classes else
           f"sharding.wrap.min_num_params={wrap.min_num_params}" if wrap.min_num_params else
           "each direct child holding parameters")  # fmt: skip
    seen: set[int] = set()
    units = []
    for m in targets:
        own = [p for p in m.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        units.append(Unit((names[id(m)],), _numel(own), why))
    summary = f"units ({policy}): {why}"
    return UnitPlan(policy, tuple(units), _numel(model.parameters()) - sum(u.numel for u in units), summary)


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def _span(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} modules)"
