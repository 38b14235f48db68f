"""The data-parallel layout's sizes, decided from the config alone: DDP's bucket, ZeRO-1/2's buckets, the FSDP2 unit
policy and DeepSpeed's collective sizes that group the units (:class:`ShardingPlan`, part of the engine plan).

DeepSpeed's config says how large its user wants the collectives (``sharding.buckets``, in elements): ZeRO reduces
gradients in buckets of ``reduce_bucket_size`` elements, gathers stage-1/2 parameters in buckets of
``allgather_bucket_size``, fetches stage-3 parameters ``prefetch_bucket_size`` elements ahead, keeps at most
``max_live_parameters`` gathered by prefetching, and does not free a parameter after forward when it is used again
within ``max_reuse_distance`` elements. A job whose config states no bucket section (``sharding.buckets`` None) keeps
DDP's ``ddp.bucket_cap_mb`` and one FSDP2 unit per direct child. The engine groups a model's blocks into units with
these sizes (``torsh.engine``'s units module, which needs the model); this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .config import BucketSizes, DdpConfig, LeafModules, ShardingConfig, TorshConfig, WrapPolicy
from .deferred import is_deferred
from .errors import ConfigError, Problem

Policy = Literal["buckets", "per_layer", "wrap", "children"]
POLICIES = ("buckets", "per_layer", "wrap", "children")

#: DeepSpeed 0.19.8's defaults (elements), used when its config leaves a size out.
DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "prefetch_bucket_size": 50_000_000,
    "max_live_parameters": 1_000_000_000,
    "max_reuse_distance": 1_000_000_000,
    "param_persistence_threshold": 100_000,
}
#: Bytes per element of the gradients DDP buckets (the compute dtype of the parameters).
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class BucketSettings:
    """DeepSpeed's collective sizes and parameter-reuse window in elements, and where each value came from."""

    reduce_bucket_size: int
    allgather_bucket_size: int
    prefetch_bucket_size: int
    max_live_parameters: int
    max_reuse_distance: int
    param_persistence_threshold: int
    sources: Mapping[str, str]
    """Per setting: ``"sharding.buckets.reduce_bucket_size=2e+07"``, ``"DeepSpeed's default 5e+08"``, ..."""

    def describe(self, key: str) -> str:
        """``key`` with its value and origin, for a reason text."""
        return f"{key} {getattr(self, key):.3g} ({self.sources[key]})"


def bucket_settings(buckets: BucketSizes | None) -> BucketSettings:
    """Every size of ``buckets``, DeepSpeed's default for those left out or "auto" (DeepSpeed reads "auto" as its
    default)."""
    values, sources = {}, {}
    for key, default in DEEPSPEED_DEFAULTS.items():
        value = getattr(buckets, key) if buckets is not None else None
        if value is None or is_deferred(value):
            values[key] = default
            sources[key] = ("sharding.buckets.%s=auto: " % key if value is not None else "") + \
                f"DeepSpeed's default {default:.3g}"
        else:
            values[key], sources[key] = int(value), f"sharding.buckets.{key}={value:.3g}"
    return BucketSettings(**values, sources=sources)


def unit_target(settings: BucketSettings, stage: int) -> tuple[int, str]:
    """The parameter count a unit should approach at ``stage`` (2 or 3), and which setting gave it.

    A unit's reduce-scatter carries its gradients (DeepSpeed: ``reduce_bucket_size``) and its all-gather its
    parameters: at stage 3 in forward, fetched ahead (``prefetch_bucket_size``), at stage 2 once per step
    (``allgather_bucket_size``). The smaller of the two keeps both collectives within DeepSpeed's sizes.
    """
    gather = "prefetch_bucket_size" if stage == 3 else "allgather_bucket_size"
    # a gather size of 0 (DeepSpeed: no prefetch / no bucketing) bounds nothing: the reduce bucket sizes the units
    keys = ("reduce_bucket_size", gather) if getattr(settings, gather) > 0 else ("reduce_bucket_size",)
    key = min(keys, key=lambda k: getattr(settings, k))
    return getattr(settings, key), settings.describe(key)


def unit_cap(settings: BucketSettings, stage: int) -> tuple[int | None, str]:
    """The most parameters one unit may hold at ``stage``, and why (None: no bound).

    At stage 3 FSDP2 keeps two units gathered at once (the one computing, the next one prefetched), so a unit
    holds at most half of ``max_live_parameters``. At stage 2 every parameter stays gathered from forward to
    backward whatever the units (DeepSpeed applies the bound at stage 3 only).
    """
    if stage != 3:
        return None, "stage 2 keeps all parameters gathered between forward and backward"
    cap = max(1, settings.max_live_parameters // 2)
    return cap, f"half of {settings.describe('max_live_parameters')}: two units are gathered at once"


def grad_bytes(cfg: TorshConfig) -> int:
    """Bytes per gradient element in DDP's buckets: the parameters' dtype (the master dtype under autocast,
    which leaves the parameters uncast)."""
    p = cfg.precision
    dtype = p.master_dtype if p.autocast else p.param_dtype
    return _DTYPE_BYTES.get(dtype, 4) if isinstance(dtype, str) else 4


def ddp_bucket_cap_mb(ddp: DdpConfig, buckets: BucketSizes | None, *, grad_bytes: int) -> tuple[float, str]:
    """DDP's ``bucket_cap_mb`` and why: ``reduce_bucket_size`` (elements) as MiB of gradients.

    ``grad_bytes`` is the size of one gradient element in DDP's buckets, which hold gradients in the parameters'
    (compute) dtype; a communication hook casts to the reduce dtype afterwards. An explicit ``ddp.bucket_cap_mb``
    (any value other than the core default) wins; without a bucket section ``ddp.bucket_cap_mb`` is kept.
    """
    default = DdpConfig.model_fields["bucket_cap_mb"].default
    if buckets is None:
        return float(ddp.bucket_cap_mb), f"ddp.bucket_cap_mb={ddp.bucket_cap_mb:g}"
    if ddp.bucket_cap_mb != default:
        return float(ddp.bucket_cap_mb), f"ddp.bucket_cap_mb={ddp.bucket_cap_mb:g}, set explicitly"
    settings = bucket_settings(buckets)
    mb = settings.reduce_bucket_size * grad_bytes / 2**20
    return mb, (f"{settings.describe('reduce_bucket_size')} x {grad_bytes} bytes per gradient element "
                f"= {mb:.1f} MiB")  # fmt: skip


def resolve_policy(sharding: ShardingConfig, requested: str | None = None) -> Policy:
    """Which unit policy applies: ``requested`` when given; an explicit ``sharding.wrap`` is kept as written
    (``"wrap"``); a job with DeepSpeed's bucket sizes gets units sized from them (``"buckets"``); otherwise each
    direct child holding parameters (``"children"``, the engine's default)."""
    if requested is not None:
        if requested not in POLICIES:
            raise ConfigError([Problem("sharding.units", requested, f"unknown unit policy; use one of "
                                       f"{', '.join(POLICIES)}")])  # fmt: skip
        return requested  # type: ignore[return-value]
    if sharding.wrap.module_classes or sharding.wrap.min_num_params:
        return "wrap"
    if sharding.buckets is not None:
        return "buckets"
    return "children"


# ------------------------------------------------------------------------------------------------
# the plan's sharding section


@dataclass(frozen=True)
class ShardingPlan:
    """What the engine's sharding and ZeRO builders read: the layout's sizes and units, decided from the config."""

    stage: int
    policy: Policy
    """How FSDP2 units are chosen (stages 2/3 under FSDP2)."""
    buckets: BucketSettings | None
    """DeepSpeed's sizes (its defaults for those left out); None when the job states no bucket section."""
    ddp: DdpConfig
    """DDP's settings with its bucket from ``reduce_bucket_size`` when the job states buckets."""
    ddp_bucket_why: str
    """Where DDP's bucket size came from."""
    reduce_bucket_numel: int
    """ZeRO-1/2: elements per gradient bucket."""
    allgather_bucket_numel: int
    """ZeRO-1/2: elements per all-gather after the step."""
    reshard_after_forward: bool | None
    wrap: WrapPolicy
    leaf_modules: LeafModules
    forward_prefetch: bool
    backward_prefetch: str | None
    ignore_unused_parameters: bool

    def describe_units(self) -> list[str]:
        """What ``explain`` can say about units and buckets without the model."""
        if self.policy == "buckets" and self.buckets is not None:
            return _describe_buckets(self)
        return [{"per_layer": "FSDP2 units: one per block (memory first)",
                 "wrap": "FSDP2 units: as sharding.wrap says",
                 "buckets": "FSDP2 units: each direct child holding parameters",
                 "children": "FSDP2 units: each direct child holding parameters"}[self.policy]]  # fmt: skip


def sharding_plan(cfg: TorshConfig, requested: str | None = None) -> ShardingPlan:
    """The layout's sizes for ``cfg`` (``requested``: a unit policy asked for by name, for ``explain``)."""
    s = cfg.sharding
    ddp = cfg.ddp
    why = f"ddp.bucket_cap_mb={ddp.bucket_cap_mb}"
    if isinstance(ddp.bucket_cap_mb, (int, float)):
        mb, why = ddp_bucket_cap_mb(ddp, s.buckets, grad_bytes=grad_bytes(cfg))
        if s.buckets is not None:
            ddp = ddp.model_copy(update={"bucket_cap_mb": mb})
    settings = bucket_settings(s.buckets) if s.buckets is not None else None
    if settings is not None:
        bucket = settings.reduce_bucket_size
        gather = settings.allgather_bucket_size or bucket
    else:
        mb = ddp.bucket_cap_mb if isinstance(ddp.bucket_cap_mb, (int, float)) else 0
        bucket = int(float(mb) * 2**20 / grad_bytes(cfg)) or DEEPSPEED_DEFAULTS["reduce_bucket_size"]
        gather = bucket
    return ShardingPlan(stage=s.stage, policy=resolve_policy(s, requested), buckets=settings, ddp=ddp,
                        ddp_bucket_why=why, reduce_bucket_numel=bucket, allgather_bucket_numel=gather,
                        reshard_after_forward=s.reshard_after_forward, wrap=s.wrap, leaf_modules=s.leaf_modules,
                        forward_prefetch=s.forward_prefetch, backward_prefetch=s.backward_prefetch,
                        ignore_unused_parameters=s.ignore_unused_parameters)  # fmt: skip


def describe(cfg: TorshConfig, decided: ShardingPlan, *, ddp: bool, zero2: bool) -> list[str]:
    """The plan's lines on buckets and units: DDP's bucket (``ddp``), ZeRO-2's buckets (``zero2``), else FSDP2's
    units."""
    if ddp:
        if isinstance(cfg.ddp.bucket_cap_mb, (int, float)):
            return [f"DDP gradient buckets of {decided.ddp.bucket_cap_mb:.1f} MiB: {decided.ddp_bucket_why}"]
        return ["DDP gradient buckets: ddp.bucket_cap_mb=auto (hidden_size**2 elements, from the model)"]
    if zero2:
        if decided.buckets is not None:
            return [f"ZeRO-2 gradient buckets of {decided.buckets.describe('reduce_bucket_size')}, parameters "
                    f"all-gathered in buckets of {decided.buckets.describe('allgather_bucket_size')}"]
        return [f"ZeRO-2 gradient and all-gather buckets of ddp.bucket_cap_mb={cfg.ddp.bucket_cap_mb} MiB"]
    return decided.describe_units()


def _describe_buckets(decided: ShardingPlan) -> list[str]:
    settings = decided.buckets
    target, target_why = unit_target(settings, decided.stage)
    cap, cap_why = unit_cap(settings, decided.stage)
    line = (f"FSDP2 units: consecutive blocks grouped up to {count(target)} parameters ({target_why})"
            + (f", at most {count(cap)} per unit ({cap_why})" if cap else ""))  # fmt: skip
    if decided.stage == 3 and decided.reshard_after_forward is None:
        return [line, "FSDP2 units whose parameters are used again within "
                f"{settings.describe('max_reuse_distance')} stay gathered from forward to backward, as DeepSpeed "
                "keeps them (a model smaller than half of it is never resharded after forward)"]
    return [line]


def count(n: int) -> str:
    """``n`` with a k/M/G suffix, three significant digits."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)
