"""Sharding units and DDP buckets sized from DeepSpeed's own settings.

DeepSpeed's config says how large its user wants the collectives: ZeRO reduces gradients in buckets of
``reduce_bucket_size`` elements, gathers stage-2 parameters in buckets of ``allgather_bucket_size``, fetches stage-3
parameters ``stage3_prefetch_bucket_size`` elements ahead, keeps at most ``stage3_max_live_parameters`` gathered by
prefetching, and does not free a parameter after forward when it is used again within ``stage3_max_reuse_distance``
elements (backward's use, for a model below that size). FSDP2 issues one all-gather and one reduce-scatter per unit,
so a unit's parameter count *is* its collective size: small units (one block each) keep the fewest parameters
gathered, large ones make fewer, larger collectives. :func:`plan_units` groups consecutive blocks until a group
holds about one DeepSpeed bucket, never more than half of ``stage3_max_live_parameters`` at stage 3 (FSDP2 holds two
units gathered at a time: the one computing and the one prefetched), keeps a stage-3 unit gathered from forward to
backward when DeepSpeed would (:func:`reuse_within`), and says why for every unit. DDP (stages 0/1) counts its
buckets in MiB of gradient bytes: :func:`ddp_bucket_cap_mb` converts ``reduce_bucket_size``.

The DeepSpeed keys have no core field; the DeepSpeed reader keeps them in ``extensions["deepspeed"]`` under
their dotted path as written (``zero_optimization.stage3_prefetch_bucket_size`` or its newer spelling
``zero_optimization.prefetch_bucket_size``). Importing this module does not import torch (``torsh-migrate
explain`` uses :func:`describe_policy`); the functions given a model import it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from torsh.config import DdpConfig, ShardingConfig, TorshConfig
from torsh.deferred import is_deferred
from torsh.errors import ConfigError, Problem

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("torsh.engine")

Policy = Literal["buckets", "per_layer", "wrap", "children"]
POLICIES = ("buckets", "per_layer", "wrap", "children")

#: DeepSpeed 0.19.8's defaults (elements), used when its config leaves a key out.
DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "prefetch_bucket_size": 50_000_000,
    "max_live_parameters": 1_000_000_000,
    "max_reuse_distance": 1_000_000_000,
}
#: Where each setting is kept in ``extensions["deepspeed"]``: the name users know first, then its other spelling.
_PATHS = {
    "reduce_bucket_size": ("zero_optimization.reduce_bucket_size",),
    "allgather_bucket_size": ("zero_optimization.allgather_bucket_size",),
    "prefetch_bucket_size": ("zero_optimization.stage3_prefetch_bucket_size",
                             "zero_optimization.prefetch_bucket_size"),
    "max_live_parameters": ("zero_optimization.stage3_max_live_parameters",
                            "zero_optimization.max_live_parameters"),
    "max_reuse_distance": ("zero_optimization.stage3_max_reuse_distance",
                           "zero_optimization.max_reuse_distance"),
}  # fmt: skip
#: The settings DeepSpeed 0.19.8 accepts at 0 (its ``ge=0``): no prefetch, no bucketing, no reuse window.
_ZERO_ALLOWED = frozenset({"allgather_bucket_size", "prefetch_bucket_size", "max_reuse_distance"})
#: "auto" as the Hugging Face Trainer fills it (a factor of hidden_size**2); other "auto"s take DeepSpeed's default.
_HF_AUTO = {"reduce_bucket_size": 1.0, "prefetch_bucket_size": 0.9}
#: Bytes per element of the gradients DDP buckets (the compute dtype of the parameters).
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# ------------------------------------------------------------------------------------------------
# DeepSpeed's settings


@dataclass(frozen=True)
class BucketSettings:
    """DeepSpeed's collective sizes and parameter-reuse window in elements, and where each value came from."""

    reduce_bucket_size: int
    allgather_bucket_size: int
    prefetch_bucket_size: int
    max_live_parameters: int
    max_reuse_distance: int
    sources: Mapping[str, str]
    """Per setting: ``"zero_optimization.reduce_bucket_size=2e+07"``, ``"DeepSpeed's default 5e+08"``, ..."""

    def describe(self, key: str) -> str:
        """``key`` with its value and origin, for a reason text."""
        return f"{key} {getattr(self, key):.3g} ({self.sources[key]})"


def bucket_settings(extensions: Mapping[str, Any], *, hidden_size: int | None = None) -> BucketSettings:
    """DeepSpeed's bucket sizes from a config's ``extensions``, its defaults for the keys left out.

    ``"auto"`` is filled as the Hugging Face Trainer does (``hidden_size**2`` elements for the reduce bucket,
    0.9 of that for the prefetch bucket) when ``hidden_size`` is given, else DeepSpeed's default applies. A value
    outside DeepSpeed's bounds (below 1 for ``reduce_bucket_size`` and ``stage3_max_live_parameters``, below 0 for
    the others) is a :class:`ConfigError` naming its key.
    """
    kept = extensions.get("deepspeed", {}) or {}
    values, sources, problems = {}, {}, []
    for key, paths in _PATHS.items():
        read = _setting(key, paths, kept, hidden_size)
        if isinstance(read, Problem):
            problems.append(read)
        else:
            values[key], sources[key] = read
    if problems:
        raise ConfigError(problems)
    return BucketSettings(**values, sources=sources)


def _setting(key: str, paths: tuple[str, ...], kept: Mapping[str, Any], hidden_size: int | None
             ) -> tuple[int, str] | Problem:  # fmt: skip
    """One setting in elements and where it came from (the first of its spellings that is present), or what is
    wrong with its value."""
    path = next((p for p in paths if p in kept), None)
    default = DEEPSPEED_DEFAULTS[key]
    if path is None:
        return default, f"DeepSpeed's default {default:.3g}"
    value = kept[path]
    if value == "auto" or is_deferred(value):
        return _auto_setting(key, path, hidden_size)
    problem = _out_of_bounds(key, path, value)
    if problem is not None:
        return problem
    return int(value), f"{path}={value:.3g}"


def _out_of_bounds(key: str, path: str, value: Any) -> Problem | None:
    """What is wrong with a value outside DeepSpeed's bounds for ``key`` (not a number, or below 1; below 0 for
    the settings where 0 means no prefetch, no bucketing or no reuse)."""
    low = 0 if key in _ZERO_ALLOWED else 1
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
        kind = "non-negative" if low == 0 else "positive"
        return Problem(f"extensions.deepspeed.{path}", value, f"must be a {kind} number of elements "
                       f"(DeepSpeed's default is {DEEPSPEED_DEFAULTS[key]:.3g})")  # fmt: skip
    return None


def _auto_setting(key: str, path: str, hidden_size: int | None) -> tuple[int, str]:
    """``"auto"`` (or a value deferred to the model) filled as the Hugging Face Trainer does when the hidden size
    is known, else DeepSpeed's default."""
    if hidden_size and key in _HF_AUTO:
        return (int(_HF_AUTO[key] * hidden_size * hidden_size),
                f"{path}=auto: {_HF_AUTO[key]:g} x hidden_size**2, hidden_size {hidden_size}")
    default = DEEPSPEED_DEFAULTS[key]
    return default, f"{path}=auto: DeepSpeed's default {default:.3g}"


def unit_target(settings: BucketSettings, stage: int) -> tuple[int, str]:
    """The parameter count a unit should approach at ``stage`` (2 or 3), and which setting gave it.

    A unit's reduce-scatter carries its gradients (DeepSpeed: ``reduce_bucket_size``) and its all-gather its
    parameters: at stage 3 in forward, fetched ahead (``stage3_prefetch_bucket_size``), at stage 2 once per
    step (``allgather_bucket_size``). The smaller of the two keeps both collectives within DeepSpeed's sizes.
    """
    gather = "prefetch_bucket_size" if stage == 3 else "allgather_bucket_size"
    # a gather size of 0 (DeepSpeed: no prefetch / no bucketing) bounds nothing: the reduce bucket sizes the units
    keys = ("reduce_bucket_size", gather) if getattr(settings, gather) > 0 else ("reduce_bucket_size",)
    key = min(keys, key=lambda k: getattr(settings, k))
    return getattr(settings, key), settings.describe(key)


def unit_cap(settings: BucketSettings, stage: int) -> tuple[int | None, str]:
    """The most parameters one unit may hold at ``stage``, and why (None: no bound).

    At stage 3 FSDP2 keeps two units gathered at once (the one computing, the next one prefetched), so a unit
    holds at most half of ``stage3_max_live_parameters``. At stage 2 every parameter stays gathered from forward
    to backward whatever the units (DeepSpeed applies the bound at stage 3 only).
    """
    if stage != 3:
        return None, "stage 2 keeps all parameters gathered between forward and backward"
    cap = max(1, settings.max_live_parameters // 2)
    return cap, f"half of {settings.describe('max_live_parameters')}: two units are gathered at once"


def is_deepspeed_sized(extensions: Mapping[str, Any], source: str | None) -> bool:
    """Whether DeepSpeed's bucket settings (or its defaults) describe this job: a DeepSpeed config, or one
    carrying DeepSpeed keys (an Accelerate config with a DeepSpeed plugin)."""
    return source == "deepspeed" or bool(extensions.get("deepspeed"))


# ------------------------------------------------------------------------------------------------
# DDP buckets (stages 0 and 1)


def ddp_bucket_cap_mb(ddp: DdpConfig, extensions: Mapping[str, Any], *, grad_bytes: int,
                      source: str | None = None) -> tuple[float, str]:  # fmt: skip
    """DDP's ``bucket_cap_mb`` and why: DeepSpeed's ``reduce_bucket_size`` (elements) as MiB of gradients.

    ``grad_bytes`` is the size of one gradient element in DDP's buckets, which hold gradients in the parameters'
    (compute) dtype; a communication hook casts to the reduce dtype afterwards. An explicit ``ddp.bucket_cap_mb``
    (any value other than the core default) wins; a config that is not DeepSpeed's keeps ``ddp.bucket_cap_mb``.
    """
    default = DdpConfig.model_fields["bucket_cap_mb"].default
    if not is_deepspeed_sized(extensions, source):
        return float(ddp.bucket_cap_mb), f"ddp.bucket_cap_mb={ddp.bucket_cap_mb:g}"
    if ddp.bucket_cap_mb != default:
        return float(ddp.bucket_cap_mb), f"ddp.bucket_cap_mb={ddp.bucket_cap_mb:g}, set explicitly"
    settings = bucket_settings(extensions)
    mb = settings.reduce_bucket_size * grad_bytes / 2**20
    return mb, (f"{settings.describe('reduce_bucket_size')} x {grad_bytes} bytes per gradient element "
                f"= {mb:.1f} MiB")  # fmt: skip


def with_deepspeed_buckets(cfg: TorshConfig, *, source: str | None = None, rank: int = 0) -> TorshConfig:
    """``cfg`` with ``ddp.bucket_cap_mb`` from DeepSpeed's ``reduce_bucket_size`` at stages 0/1 (see
    :func:`ddp_bucket_cap_mb`); unchanged otherwise. Logged on rank 0 with the reason."""
    if cfg.sharding.stage > 1 or not is_deepspeed_sized(cfg.extensions, source):
        return cfg
    mb, why = ddp_bucket_cap_mb(cfg.ddp, cfg.extensions, grad_bytes=grad_bytes(cfg), source=source)
    if rank == 0:
        log.info("DDP gradient buckets of %.1f MiB: %s", mb, why)
    return cfg.model_copy(update={"ddp": cfg.ddp.model_copy(update={"bucket_cap_mb": mb})})


def grad_bytes(cfg: TorshConfig) -> int:
    """Bytes per gradient element in DDP's buckets: the parameters' dtype (the master dtype under autocast,
    which leaves the parameters uncast)."""
    p = cfg.precision
    dtype = p.master_dtype if p.autocast else p.param_dtype
    return _DTYPE_BYTES.get(dtype, 4) if isinstance(dtype, str) else 4


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
        lines += [f"unit {i}: {_span(u.modules)} ({_count(u.numel)} parameters): {u.reason}"
                  for i, u in enumerate(self.units)]  # fmt: skip
        lines.append(f"root: the remaining {_count(self.root_numel)} parameters")
        return lines


def resolve_policy(sharding: ShardingConfig, *, source: str | None = None,
                   extensions: Mapping[str, Any] | None = None, requested: str | None = None) -> str:  # fmt: skip
    """Which unit policy applies: ``requested`` when given; an explicit ``sharding.wrap`` is kept as written
    (``"wrap"``); a DeepSpeed config gets units sized from its buckets (``"buckets"``); otherwise each direct
    child holding parameters (``"children"``, the engine's default)."""
    if requested is not None:
        if requested not in POLICIES:
            raise ConfigError([Problem("sharding.units", requested, f"unknown unit policy; use one of "
                                       f"{', '.join(POLICIES)}")])  # fmt: skip
        return requested
    if sharding.wrap.module_classes or sharding.wrap.min_num_params:
        return "wrap"
    if is_deepspeed_sized(extensions or {}, source):
        return "buckets"
    return "children"


def plan_units(model: nn.Module, sharding: ShardingConfig, extensions: Mapping[str, Any] | None = None, *,
               source: str | None = None, policy: str | None = None, hidden_size: int | None = None) -> UnitPlan:
    """The FSDP2 units of ``model`` for ``sharding.stage`` (2 or 3) and why each was chosen.

    ``"buckets"``: consecutive blocks of the model's repeated-block container grouped up to
    :func:`unit_target` parameters, bounded by :func:`unit_cap`; ``"per_layer"``: each block its own unit
    (the fewest parameters gathered: memory first); ``"wrap"``: ``sharding.wrap`` as written; ``"children"``:
    each direct child holding parameters. ``policy`` None: :func:`resolve_policy`.
    """
    extensions = extensions or {}
    policy = resolve_policy(sharding, source=source, extensions=extensions, requested=policy)
    if policy in ("wrap", "children"):
        return _plan_from_wrap(model, sharding, policy)
    found = find_blocks(model)
    if found is None:
        plan = _plan_from_wrap(model, sharding, "children")
        return UnitPlan(policy, plan.units, plan.root_numel,
                        f"units ({policy}): no repeated-block container (a ModuleList or Sequential of two or more "
                        "modules of one class) in the model, so each direct child holding parameters is a unit")
    container, blocks = found
    total = _numel(model.parameters())
    if policy == "per_layer":
        units = tuple(Unit((name,), size, "per layer: the fewest parameters gathered at once (memory first)")
                      for name, size in blocks)  # fmt: skip
        summary = f"units (per_layer): each of the {len(blocks)} blocks of {container} is its own unit"
    else:
        units, summary = _bucket_units(container, blocks, total, sharding,
                                       bucket_settings(extensions, hidden_size=hidden_size))  # fmt: skip
    return UnitPlan(policy, units, total - sum(u.numel for u in units), summary)


def _bucket_units(container: str, blocks: list[tuple[str, int]], total: int, sharding: ShardingConfig,
                  settings: BucketSettings) -> tuple[tuple[Unit, ...], str]:  # fmt: skip
    """The ``"buckets"`` policy: the blocks grouped by :func:`group_blocks` and, at stage 3 without an explicit
    ``reshard_after_forward``, those DeepSpeed reuses kept gathered (:func:`reuse_within`); and the summary."""
    target, target_why = unit_target(settings, sharding.stage)
    cap, cap_why = unit_cap(settings, sharding.stage)
    units = group_blocks(blocks, target, cap)
    summary = (f"units (buckets): consecutive blocks of {container} grouped up to {_count(target)} parameters, "
               f"the smaller of DeepSpeed's reduce and gather buckets: {target_why}"
               + (f"; at most {_count(cap)} per unit, {cap_why}" if cap else ""))  # fmt: skip
    if sharding.stage == 3 and sharding.reshard_after_forward is None:
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
                                  f"{_count(distance)} parameters, below {settings.describe('max_reuse_distance')}")
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
        return f"one block of {_count(numel)} is already above {over}; a block is never split"
    if following is None:
        return f"{len(group)} block(s), {_count(numel)} <= {_count(target)}: the last blocks"
    bound = "the per-unit bound" if cap and cap < target and numel + following[1] > cap else "the target"
    return (f"{len(group)} block(s), {_count(numel)} <= {_count(target)}; adding {following[0]} "
            f"({_count(following[1])}) would exceed {bound}")


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


def _plan_from_wrap(model: nn.Module, sharding: ShardingConfig, policy: str) -> UnitPlan:
    from .leaves import keep_leaves_whole
    from .wrap import keep_ties_in_one_unit, wrap_targets  # the engine's own policies (imports torch)

    from torsh.config import WrapPolicy

    wrap = sharding.wrap if policy == "wrap" else WrapPolicy()
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


def _count(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _span(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} modules)"


# ------------------------------------------------------------------------------------------------
# explain (no model, no torch)


def describe_policy(cfg: TorshConfig, *, source: str | None = None, requested: str | None = None) -> list[str]:
    """What ``explain`` can say about units and buckets without the model: the policy and the sizes."""
    s = cfg.sharding
    if s.stage <= 1:
        return _describe_ddp(cfg, source)
    if s.stage == 2 and not s.hybrid_shard_size and cfg.parallelism.tp == 1:  # ZeRO-2 (.zero_partition): no FSDP2 units
        return _describe_zero2(cfg, source)
    policy = resolve_policy(s, source=source, extensions=cfg.extensions, requested=requested)
    if policy == "buckets":
        return _describe_buckets(cfg)
    return [{"per_layer": "FSDP2 units: one per block (memory first)",
             "wrap": "FSDP2 units: as sharding.wrap says",
             "children": "FSDP2 units: each direct child holding parameters"}[policy]]


def _describe_ddp(cfg: TorshConfig, source: str | None) -> list[str]:
    if isinstance(cfg.ddp.bucket_cap_mb, (int, float)):
        mb, why = ddp_bucket_cap_mb(cfg.ddp, cfg.extensions, grad_bytes=grad_bytes(cfg), source=source)
        return [f"DDP gradient buckets of {mb:.1f} MiB: {why}"]
    return ["DDP gradient buckets: ddp.bucket_cap_mb=auto (hidden_size**2 elements, from the model)"]


def _describe_zero2(cfg: TorshConfig, source: str | None) -> list[str]:
    if is_deepspeed_sized(cfg.extensions, source):
        settings = bucket_settings(cfg.extensions)
        return [f"ZeRO-2 gradient buckets of {settings.describe('reduce_bucket_size')}, parameters all-gathered "
                f"in buckets of {settings.describe('allgather_bucket_size')}"]
    return [f"ZeRO-2 gradient and all-gather buckets of ddp.bucket_cap_mb={cfg.ddp.bucket_cap_mb} MiB"]


def _describe_buckets(cfg: TorshConfig) -> list[str]:
    s = cfg.sharding
    settings = bucket_settings(cfg.extensions)
    target, target_why = unit_target(settings, s.stage)
    cap, cap_why = unit_cap(settings, s.stage)
    line = (f"FSDP2 units: consecutive blocks grouped up to {_count(target)} parameters ({target_why})"
            + (f", at most {_count(cap)} per unit ({cap_why})" if cap else ""))  # fmt: skip
    if s.stage == 3 and s.reshard_after_forward is None:
        return [line, "FSDP2 units whose parameters are used again within "
                f"{settings.describe('max_reuse_distance')} stay gathered from forward to backward, as DeepSpeed "
                "keeps them (a model smaller than half of it is never resharded after forward)"]
    return [line]
