"""The engine plan: everything ``torsh.initialize`` decides, from the config and the world size alone.

:func:`plan` decides the data-parallel kind and mesh, the unit policy, the dtypes (with a low-precision
"compression" folded into the reduce dtype under FSDP2), where master weights live, offload, compression, the
optimizer wrapper, the loss scaler and the engine's step policy, and collects every refusal. ``initialize`` raises
the refusals (:meth:`EnginePlan.check`) once the process group exists and before it casts, wraps or shards the
model, so a refused config leaves the user's model as it was and every reason is reported at once; then it runs
the plan's ``apply_*`` steps. ``torsh-migrate explain`` prints :attr:`EnginePlan.steps`, the same decisions in
words. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from .compression_rules import fsdp_compression_problems
from .config import DataConfig, DdpConfig, GradientsConfig, TorshConfig
from .deferred import Deferred, is_deferred
from .errors import ConfigError, Problem
from .sharding_plan import ShardingPlan, sharding_plan
from .sharding_plan import describe as describe_layout

DataParallel = Literal["ddp", "zero1", "zero2", "fsdp2", "hsdp"]


@dataclass(frozen=True)
class StepPolicy:
    """What the engine reads from the config (its forward, backward and step, and ``deepspeed_io``); the Engine
    holds nothing else of it."""

    stage: int
    """The ZeRO stage (``engine.zero_optimization_stage()``)."""
    param_dtype: str
    """The compute dtype's name (``fp16_enabled()``, ``bfloat16_enabled()``)."""
    clip_max_norm: float
    """Clip the global gradient norm to this (0: no clipping)."""
    loss_scaling: bool
    """Scale the loss and unscale the gradients (``precision.loss_scaling.mode`` is not "none")."""
    skip_step_on_nonfinite: bool
    """Skip the optimizer step when a gradient is not finite (also without loss scaling)."""
    steps_per_print: int | None
    """Log one line every this many optimizer steps."""
    activations_on_cpu: bool
    """Keep saved activations on the CPU during forward (activation checkpointing's CPU offload)."""
    ddp: DdpConfig
    """DDP's settings (stages 0/1: unused-parameter handling, bucket view)."""
    gradients: GradientsConfig
    """The gradient reduction (operation, pre/post scaling) outside DDP."""
    compressed: bool
    """A compression hook reduces DDP's gradients (so the engine's own reduce hook is not registered)."""
    data: DataConfig
    """The dataloader settings ``engine.deepspeed_io`` builds with."""
    save_full_weights: bool
    """ZeRO-3 16-bit weights are gathered on save (``zero_gather_16bit_weights_on_model_save()``)."""
    optimizer_offload: str
    """Where the optimizer state lives: none, cpu or nvme (``zero_cpu_offload()``)."""

    @property
    def probe_unused(self) -> bool:
        """Stages 0/1: reduce the first step outside DDP to find parameters the forward does not use."""
        return not self.ddp.find_unused_parameters and not self.ddp.static_graph and not self.compressed

    @property
    def finds_unused(self) -> bool:
        """DDP already looks for unused parameters."""
        return self.ddp.find_unused_parameters or self.ddp.static_graph


@dataclass(frozen=True)
class EnginePlan:
    """What ``torsh.initialize`` builds for a config on ``world_size`` ranks, in build order."""

    world_size: int
    data_parallel: DataParallel
    """``ddp`` (stage 0), ``zero1`` (DeepSpeed's stage 1: whole parameters, DDP all-reduces the whole gradients,
    optimizer partitioned), ``zero2`` (DeepSpeed's stage 2: whole parameters, gradients and optimizer partitioned;
    both :mod:`torsh.engine.zero.partition`), ``fsdp2`` (stage 3),
    ``hsdp`` (FSDP2 on a 2-D mesh: shard within groups, replicate across them; stages 2/3)."""
    mesh: tuple[int, ...] | None
    """FSDP2's mesh shape: ``(world,)`` or ``(replicate, shard)``; None under DDP or while it is "auto"."""
    reshard_after_forward: bool | None
    """FSDP2: free the gathered parameters after forward (per unit, the reuse rule may keep them)."""
    param_dtype: str | Deferred
    master_dtype: str | Deferred
    reduce_dtype: str | Deferred
    """The gradient reduction's dtype; under FSDP2 a fp16/bf16 "compression" is this dtype."""
    autocast: bool
    """Forward under ``torch.autocast``; the parameters stay in the master dtype."""
    fsdp_mixed_precision: bool
    """FSDP2 gets a ``MixedPrecisionPolicy`` (compute or reduce dtype differs from the fp32 shards)."""
    masters_on_cpu: bool
    """Stages 0-2 under optimizer offload: the fp32 master weights (and so the optimizer step) on the CPU."""
    fsdp_cpu_offload: bool
    """FSDP2's ``CPUOffloadPolicy``: sharded parameters, gradients and the optimizer step on the CPU."""
    compression: Literal["none", "comm_hook", "reduce_dtype"]
    """How gradient compression runs: a DDP communication hook, or FSDP2's reduce dtype."""
    optimizer_on_cpu: bool
    """The configured optimizer is built for CPU tensors (offload)."""
    step: StepPolicy
    refused: tuple[Problem, ...]
    """Every reason the engine cannot run the config (empty: it can)."""
    steps: tuple[str, ...]
    """The plan in words, in build order (``explain`` prints these)."""
    degrees: "Degrees | None" = None
    """The parallel degrees on ``world_size`` ranks (None when they do not divide it, which is refused)."""
    pipeline: bool = False
    """The model is a DeepSpeed ``PipelineModule`` and ``world_size`` the data-parallel degree of each stage: the
    pipeline engine reduces the gradients over a stage's replicas itself after its micro-batches (no DDP), and
    ``zero1`` is its stage 1 (the partition over those replicas)."""
    sharding: ShardingPlan | None = None
    """The layout's sizes: DDP's bucket, ZeRO-1/2's buckets, the FSDP2 unit policy and DeepSpeed's collective
    sizes (:mod:`torsh.sharding_plan`)."""

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (1: none)."""
        return self.degrees.tp if self.degrees is not None else 1

    @property
    def loss_scaler(self) -> bool:
        """A loss scaler scales the loss (``precision.loss_scaling.mode`` is not "none")."""
        return self.step.loss_scaling

    @property
    def fsdp(self) -> bool:
        """FSDP2 wraps the model (stages 2/3, also on a hybrid mesh); otherwise DDP."""
        return self.data_parallel in ("fsdp2", "hsdp")

    def check(self) -> None:
        """Raise one ConfigError listing every refusal; return when the engine can run the config."""
        if self.refused:
            raise ConfigError(list(self.refused))


#: The mesh's dimensions, outermost first (torchtitan's order: pipeline stages outermost, tensor parallelism
#: innermost, so that the ranks of one TP group are neighbours, on one node).
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Degrees:
    """The parallel degrees of a job on ``world_size`` ranks (:func:`degrees`)."""

    world_size: int
    tp: int
    pp: int
    cp: int
    dp_replicate: int
    """Replicas of the data-parallel shard groups (1: no HSDP)."""
    dp_shard: int
    """Ranks of one data-parallel shard group (1 under DDP)."""
    sp: int = 1
    """Sequence-parallel degree (DeepSpeed-Ulysses): consecutive data-parallel ranks that share one sequence. The
    gradient reduction and the shards span them (DeepSpeed's sequence-data-parallel group); the batch does not."""

    @property
    def dp(self) -> int:
        """The data-parallel degree: the ranks the batch is split over (the sequence-parallel peers share one)."""
        return self.dp_replicate * self.dp_shard // self.sp

    @property
    def dims(self) -> tuple[tuple[str, int], ...]:
        """The device mesh, outermost first: each degree above 1, and the data-parallel dimension(s) always."""
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                 "tp": self.tp}  # fmt: skip
        keep = [n for n in MESH_ORDER if sizes[n] > 1]
        if self.dp_replicate == 1 and "dp_shard" not in keep:
            keep.append("dp_shard")  # the data-parallel dimension is always there, even of size 1
        return tuple((n, sizes[n]) for n in MESH_ORDER if n in keep)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where ``rank`` sits on each dimension of :attr:`dims` (row-major, as ``init_device_mesh`` lays out)."""
        out, rest = {}, rank
        for name, size in reversed(self.dims):
            out[name] = rest % size
            rest //= size
        return out

    def dp_rank(self, rank: int) -> int:
        """``rank``'s index among the data-parallel ranks (which batch shard it reads)."""
        at = self.coordinates(rank)
        return (at.get("dp_replicate", 0) * self.dp_shard + at.get("dp_shard", 0)) // self.sp


def pipeline_degree(cfg: TorshConfig) -> int:
    """The number of pipeline stages ``parallelism.pp`` asks for (1: no pipeline; "auto" counts as 1 here: the
    stages of the model the script builds)."""
    pp = cfg.parallelism.pp
    return 1 if is_deferred(pp) else int(pp)


def degrees(cfg: TorshConfig, world_size: int) -> Degrees | None:
    """The parallel degrees of ``cfg`` on ``world_size`` ranks; None when they do not divide it (or the shard group
    is still "auto"): :func:`degree_problems` says why."""
    par, s = cfg.parallelism, cfg.sharding
    tp, pp, cp = par.tp, pipeline_degree(cfg), par.cp
    model = tp * pp * cp
    if world_size < 1 or world_size % (model * par.sp):
        return None
    # Ulysses' sequence-parallel peers are data-parallel ranks of the reduction and the shards, not of the batch
    laid = _data_degrees(cfg, world_size, tp, pp, cp, world_size // model)
    return None if laid is None else replace(laid, sp=par.sp)


def _data_degrees(cfg: TorshConfig, world_size: int, tp: int, pp: int, cp: int, dp: int) -> Degrees | None:
    """The data-parallel split of ``dp`` ranks (replicas x shard group) at the config's stage."""
    par, s = cfg.parallelism, cfg.sharding
    if s.stage < 2:  # DDP replicates; with tensor parallelism FSDP2 shards over the data-parallel ranks (see plan)
        return Degrees(world_size, tp, pp, cp, dp_replicate=1 if tp > 1 else dp, dp_shard=dp if tp > 1 else 1)
    if par.dp_replicate is not None:
        replicate = par.dp_replicate
        if dp % replicate:
            return None
        return Degrees(world_size, tp, pp, cp, dp_replicate=replicate, dp_shard=dp // replicate)
    shard = s.hybrid_shard_size
    if shard is None:
        return Degrees(world_size, tp, pp, cp, dp_replicate=1, dp_shard=dp)
    if is_deferred(shard) or dp % shard:
        return None
    return Degrees(world_size, tp, pp, cp, dp_replicate=dp // shard, dp_shard=shard)


def degree_problems(cfg: TorshConfig, world_size: int) -> list[Problem]:
    """Why the degrees do not lay out on ``world_size`` ranks (each naming its key and what to do)."""
    par, s = cfg.parallelism, cfg.sharding
    named = {k: v for k, v in (("tp", par.tp), ("pp", pipeline_degree(cfg)), ("cp", par.cp)) if v > 1}
    model = par.tp * pipeline_degree(cfg) * par.cp
    if world_size % model:
        product = " x ".join(f"{k} {v}" for k, v in named.items())
        return [Problem("parallelism", dict(named), f"{product} = {model} does not divide the world size "
                        f"{world_size}: launch a multiple of {model} processes, or lower "
                        f"parallelism.{max(named, key=named.get)}")]  # fmt: skip
    dp = world_size // model
    problems = []
    if dp % par.sp:
        problems.append(Problem("parallelism.sp", par.sp, f"the sequence-parallel degree must divide the {dp} "
                                f"data-parallel rank(s) (world size {world_size}): launch a multiple of {par.sp} "
                                "processes, or lower it"))  # fmt: skip
    if s.stage >= 2 and par.dp_replicate is not None and dp % par.dp_replicate:
        problems.append(Problem("parallelism.dp_replicate", par.dp_replicate, f"must divide the {dp} data-parallel "
                                f"ranks (world size {world_size} / {model} for tp x pp x cp)"))  # fmt: skip
    shard = s.hybrid_shard_size
    if s.stage >= 2 and isinstance(shard, int) and dp % shard:
        where = (f"the world size {world_size}" if model == 1 else
                 f"the {dp} data-parallel ranks (world size {world_size} / {model} for tp x pp x cp)")
        problems.append(Problem("sharding.hybrid_shard_size", shard, f"must divide {where}"))
    return problems


def _model_parallel_refusals(cfg: TorshConfig, *, pipeline: bool = False) -> list[Problem]:
    """The degrees the engine does not run, each with its alternative (``pipeline``: the model is a DeepSpeed
    ``PipelineModule``, which the pipeline engine runs)."""
    par, problems = cfg.parallelism, []
    if par.cp > 1 and (pipeline_degree(cfg) > 1 or pipeline):
        problems.append(Problem("parallelism.cp", par.cp, "context parallelism is run beside data and tensor "
                                "parallelism, not with pipeline parallelism: set parallelism.cp or parallelism.pp "
                                "to 1"))  # fmt: skip
    if par.cp > 1 and cfg.gradients.reduce_op == "sum":
        problems.append(Problem("gradients.reduce_op", "sum", f"with context parallelism (parallelism.cp {par.cp}) "
                                "each rank's loss is the mean over its part of the sequence: summing the ranks' "
                                f"gradients gives {par.cp} x the whole sequence's; use 'mean'"))  # fmt: skip
    others = {k: v for k, v in (("tp", par.tp), ("pp", pipeline_degree(cfg)), ("cp", par.cp)) if v > 1}
    if par.sp > 1 and (others or pipeline):
        problems.append(Problem("parallelism.sp", par.sp, "sequence parallelism is run beside data parallelism "
                                "only, not with " + (", ".join(f"parallelism.{k} {v}" for k, v in others.items())
                                                     or "a PipelineModule") + ": set one of them to 1"))  # fmt: skip
    if par.sp > 1 and cfg.compression.method != "none" and cfg.sharding.stage < 2:
        problems.append(Problem("compression.method", cfg.compression.method, "gradient compression at sharding "
                                "stage 0/1 is a DDP communication hook that averages over every rank, and sequence "
                                f"parallelism (parallelism.sp {par.sp}) averages over the data-parallel replicas "
                                "only: set compression.method to 'none', or use sharding.stage 2 or 3 with "
                                "compression 'fp16'/'bf16' (the reduce dtype there)"))  # fmt: skip
    if pipeline_degree(cfg) > 1 and not pipeline:
        problems.append(Problem("parallelism.pp", par.pp, "pipeline parallelism runs only for a "
                                "deepspeed.pipe.PipelineModule (the pipeline engine): pass one to initialize, or set "
                                "it to 1 and use sharding.stage 3 (FSDP2) or parallelism.tp to fit the model"))
    if par.tp > 1:
        o = cfg.offload
        if o.params != "none" or o.optimizer != "none":
            problems.append(Problem("offload", f"{o.params}/{o.optimizer}", "offload with tensor parallelism "
                                    "(parallelism.tp > 1) is not run by the engine; set offload to 'none' or "
                                    "parallelism.tp to 1"))  # fmt: skip
    return problems


def plan(cfg: TorshConfig, world_size: int, *, optimizer_given: bool = True, pipeline: bool = False) -> EnginePlan:
    """Decide how the engine runs ``cfg`` on ``world_size`` ranks (``optimizer_given``: the caller passes an
    optimizer to ``initialize``). Refusals are collected, not raised: :meth:`EnginePlan.check` raises them."""
    s, o, p = cfg.sharding, cfg.offload, cfg.precision
    layout = sharding_plan(cfg)
    laid = degrees(cfg, world_size)
    # Tensor parallelism composes with FSDP2 on the data-parallel sub-mesh (as torchtitan does); stages 0-2 run
    # there as FSDP2 without resharding (ZeRO-2's layout, DDP's numerics).
    dp, mesh = _data_parallel(s.stage, laid, tp=cfg.parallelism.tp, pipeline=pipeline)
    fsdp = dp in ("fsdp2", "hsdp")
    # The parameters FSDP2 holds in compute: the compute dtype, or the fp32 masters themselves under autocast.
    held = p.master_dtype if p.autocast else p.param_dtype
    if (s.stage >= 2 or fsdp) and cfg.compression.method in ("fp16", "bf16"):
        reduce = cfg.compression.method  # no comm hook at stages 2/3: a low-precision "compression" is the reduce dtype
    else:
        reduce = p.reduce_dtype or held
    compressed = cfg.compression.method != "none"
    scaler = p.loss_scaling.mode != "none"  # the engine scales whenever it is set; DeepSpeed's reader sets it for fp16
    offloaded = o.params != "none" or o.optimizer != "none"  # nvme: the CPU offload, with the state in files
    decided = EnginePlan(
        world_size=world_size, data_parallel=dp, mesh=mesh,
        reshard_after_forward=(s.effective_reshard_after_forward if s.stage >= 2 else False) if fsdp else None,
        param_dtype=p.param_dtype, master_dtype=p.master_dtype, reduce_dtype=reduce, autocast=p.autocast,
        fsdp_mixed_precision=fsdp and (held != p.master_dtype or reduce != held),
        masters_on_cpu=not fsdp and o.optimizer != "none", fsdp_cpu_offload=fsdp and offloaded,
        compression="none" if not compressed else "reduce_dtype" if s.stage >= 2 or fsdp else "comm_hook",
        optimizer_on_cpu=offloaded,
        step=_step_policy(cfg, layout.ddp, scaling=scaler, compressed=compressed),
        refused=tuple(refusals(cfg, world_size=world_size, optimizer_given=optimizer_given, pipeline=pipeline)),
        steps=(), degrees=laid, pipeline=pipeline, sharding=layout,
    )  # fmt: skip
    return _with_steps(decided, cfg)


def _data_parallel(stage: int, laid: Degrees | None, *, tp: int = 1,
                   pipeline: bool = False) -> tuple[DataParallel, tuple[int, ...] | None]:  # fmt: skip
    """The data-parallel kind and FSDP2's mesh shape over the data-parallel ranks (None under DDP and ZeRO-1/2, or
    when the degrees do not lay out on the world, an "auto" shard group included, which is refused or resolved
    later). With tensor parallelism, stages 0-2 run as FSDP2 without resharding on the data-parallel sub-mesh. A
    pipeline's stages 0 and 1 are its own (replicated, or the ZeRO-1 partition) whatever else the config sets
    (what the pipeline engine does not run is refused)."""
    if (tp == 1 or pipeline) and stage < 2:
        return ("ddp" if stage == 0 else "zero1"), None
    if tp == 1 and stage == 2 and laid is not None and laid.dp_replicate == 1:
        return "zero2", None
    if laid is None:
        return "hsdp", None
    # the context-parallel peers hold the same model: FSDP2 shards over them too (Accelerate's dp_shard_cp)
    if laid.dp_replicate == 1:
        return "fsdp2", (laid.dp_shard * laid.cp,)
    return "hsdp", (laid.dp_replicate, laid.dp_shard * laid.cp)


def _step_policy(cfg: TorshConfig, ddp: DdpConfig, *, scaling: bool, compressed: bool) -> StepPolicy:
    clip, ac = cfg.gradients.clip_max_norm, cfg.activation_checkpointing
    return StepPolicy(stage=cfg.sharding.stage, param_dtype=cfg.precision.param_dtype, loss_scaling=scaling,
                      compressed=compressed, clip_max_norm=0.0 if is_deferred(clip) else float(clip or 0.0),
                      skip_step_on_nonfinite=cfg.precision.skip_step_on_nonfinite,
                      steps_per_print=cfg.monitoring.steps_per_print, activations_on_cpu=ac.enabled and ac.cpu_offload,
                      ddp=ddp, gradients=cfg.gradients, data=cfg.data, optimizer_offload=cfg.offload.optimizer,
                      save_full_weights=cfg.checkpoint.save_full_weights is True)  # fmt: skip


def refusals(cfg: TorshConfig, *, world_size: int, optimizer_given: bool = True,
             pipeline: bool = False) -> list[Problem]:
    """Every reason the engine cannot run ``cfg`` on ``world_size`` ranks (empty: it can).

    ``optimizer_given`` says whether the caller passed an optimizer to ``initialize`` (ZeRO-1/2 need one).
    """
    problems: list[Problem] = []
    stage = cfg.sharding.stage
    problems += degree_problems(cfg, world_size)
    problems += _model_parallel_refusals(cfg, pipeline=pipeline)
    if cfg.gradients.reduce_op == "adasum":
        problems.append(Problem("gradients.reduce_op", "adasum", "Adasum is Horovod-only and has no native "
                                "PyTorch equivalent; use 'mean' or 'sum'"))  # fmt: skip
    if stage >= 2 or cfg.parallelism.tp > 1:  # tensor parallelism runs FSDP2 on the data-parallel sub-mesh
        problems += _fsdp_refusals(cfg)
    if stage in (1, 2) and not optimizer_given and not (cfg.optimizer is not None and cfg.optimizer.name):
        problems.append(Problem("sharding.stage", stage, f"zero stage {stage} requires an optimizer: pass one to "
                                "initialize or configure one"))  # fmt: skip
    return problems


def _fsdp_refusals(cfg: TorshConfig) -> list[Problem]:
    problems = []
    if cfg.compression.method != "none":
        problems += fsdp_compression_problems(cfg.compression, cfg.precision.reduce_dtype)
    return problems


def check(cfg: TorshConfig, *, world_size: int, optimizer_given: bool = True) -> None:
    """Raise one ConfigError listing every refusal of :func:`refusals`; return when the engine can run ``cfg``."""
    plan(cfg, world_size, optimizer_given=optimizer_given).check()


# ------------------------------------------------------------------------------------------------
# the plan in words


def _dtype(value: object) -> str:
    return "auto (chosen at start-up)" if isinstance(value, Deferred) else str(value)


def _with_steps(decided: EnginePlan, cfg: TorshConfig) -> EnginePlan:
    steps = _mesh_steps(decided, cfg)
    steps += sequence_steps(decided.degrees)
    steps += context_steps(decided.degrees)
    steps += _checkpointing_steps(cfg)
    if decided.tp > 1:
        steps.append(tp_plan_step(cfg))
    steps.append(_sharding_step(decided, cfg))
    s = cfg.sharding
    zero2 = s.stage == 2 and not s.hybrid_shard_size and cfg.parallelism.tp == 1  # ZeRO-2: no FSDP2 units
    steps += describe_layout(cfg, decided.sharding, ddp=s.stage <= 1, zero2=zero2)
    steps += _precision_steps(decided)
    steps += _offload_steps(decided, cfg)
    if decided.compression != "none":
        how = "communication hook" if decided.compression == "comm_hook" else "as FSDP2's reduce dtype"
        steps.append(f"gradient compression: {cfg.compression.method} {how}")
    if cfg.optimizer is not None and cfg.optimizer.name:
        steps.append(f"optimizer {cfg.optimizer.name} built after sharding")
    if cfg.scheduler is not None:
        steps.append(f"LR scheduler {cfg.scheduler.name}")
    ls = cfg.precision.loss_scaling
    if decided.loss_scaler:
        steps.append(f"loss scaler ({ls.mode}, {ls.semantics} rules)")
    clip = cfg.gradients.clip_max_norm
    steps.append(f"gradient clipping at global norm {clip}" if clip and not is_deferred(clip)
                 else "gradient clipping: " + ("auto" if is_deferred(clip) else "off"))
    return replace(decided, steps=tuple(steps))


def _checkpointing_steps(cfg: TorshConfig) -> list[str]:
    """The modules apply_activation_checkpointing wraps: its own list, else sharding.wrap's, else each child."""
    ac, wrap = cfg.activation_checkpointing, cfg.sharding.wrap
    if not ac.enabled:
        return []
    if ac.modules:
        which = ", ".join(ac.modules)
    elif wrap.module_classes:
        which = "each " + ", ".join(wrap.module_classes)
    elif wrap.min_num_params:
        which = f"each module of at least {wrap.min_num_params} parameters"
    else:
        which = "each direct child holding parameters (looking into ModuleLists)"
    return [f"activation checkpointing of {which}" + (" (saved activations on the CPU)" if ac.cpu_offload else "")]


#: How many ranks ``explain`` lists one by one (a larger world is summarised).
_RANKS_LISTED = 16


def _mesh_steps(decided: EnginePlan, cfg: TorshConfig) -> list[str]:
    """The device mesh and what runs where, when any degree other than data parallelism is above 1."""
    laid, par = decided.degrees, cfg.parallelism
    if laid is None:
        if par.tp * pipeline_degree(cfg) * par.cp == 1:
            return []
        return [f"device mesh: the degrees (tp {par.tp}, pp {par.pp}, cp {par.cp}) do not lay out on "
                f"{decided.world_size} rank(s) (refused below)"]  # fmt: skip
    if laid.tp * laid.pp * laid.cp == 1:
        return []
    dims = " x ".join(f"{n} {k}" for n, k in laid.dims)
    lines = [f"device mesh ({', '.join(n for n, _ in laid.dims)}) = ({dims}) on {decided.world_size} rank(s): "
             f"data parallel over {laid.dp} rank(s) (the batch is split over them), tensor parallel over {laid.tp}, "
             f"pipeline stages {laid.pp}, context parallel {laid.cp}"]  # fmt: skip
    placed = []
    for rank in range(min(decided.world_size, _RANKS_LISTED)):
        at = laid.coordinates(rank)
        placed.append(f"rank {rank}: " + ", ".join(f"{n} {at[n]}" for n, _ in laid.dims)
                      + f" (batch shard {laid.dp_rank(rank)})")
    more = f"; ... ({decided.world_size - _RANKS_LISTED} more)" if decided.world_size > _RANKS_LISTED else ""
    lines.append("what runs where: " + "; ".join(placed) + more)
    return lines


def sequence_groups(world_size: int, sp: int) -> tuple[list[list[int]], list[int]]:
    """DeepSpeed-Ulysses' groups on ``world_size`` ranks (``parallel_state_sp.initialize_sequence_parallel``): the
    sequence-parallel groups of ``sp`` consecutive ranks, and the sequence-data-parallel group of every rank."""
    return [list(range(first, first + sp)) for first in range(0, world_size, sp)], list(range(world_size))


def sequence_steps(laid: Degrees | None) -> list[str]:
    """The sequence-parallel degree and groups in words (nothing without sequence parallelism)."""
    if laid is None or laid.sp == 1:
        return []
    sp_groups, everyone = sequence_groups(laid.world_size, laid.sp)
    listed = "; ".join(str(g) for g in sp_groups[:_RANKS_LISTED]) + (" ..." if len(sp_groups) > _RANKS_LISTED else "")
    every = str(everyone) if laid.world_size <= _RANKS_LISTED else f"[0..{laid.world_size - 1}]"
    return [f"sequence parallelism (DeepSpeed-Ulysses) of degree {laid.sp}: sequence-parallel groups {listed} (each "
            f"sequence split over one group; the model's DistributedAttention all-to-alls heads for sequence in it), "
            f"sequence-data-parallel group {every} (gradient reduction and ZeRO partitions); gradients summed over "
            f"the sp ranks and averaged over the {laid.dp} data-parallel replica(s) (all-reduce over every rank / "
            f"{laid.dp}, as DeepSpeed); the sp ranks of a group read the same batch shard"]  # fmt: skip


def context_groups(laid: Degrees) -> tuple[list[list[int]], list[list[int]]]:
    """The context-parallel groups on the mesh of ``laid`` (the ranks that differ only in their ``cp``
    coordinate), and the data-parallel groups (the ranks that differ only in their data-parallel coordinates)."""
    by_rest: dict[tuple, list[int]] = {}
    by_slot: dict[tuple, list[int]] = {}
    for rank in range(laid.world_size):
        at = laid.coordinates(rank)
        by_rest.setdefault(tuple((n, i) for n, i in at.items() if n != "cp"), []).append(rank)
        by_slot.setdefault(tuple((n, i) for n, i in at.items() if not n.startswith("dp_")), []).append(rank)
    return list(by_rest.values()), list(by_slot.values())


def context_steps(laid: Degrees | None) -> list[str]:
    """The context-parallel degree and groups in words (nothing without context parallelism)."""
    if laid is None or laid.cp == 1:
        return []
    cp_groups, _ = context_groups(laid)
    listed = "; ".join(str(g) for g in cp_groups[:_RANKS_LISTED]) + (" ..." if len(cp_groups) > _RANKS_LISTED else "")
    return [f"context parallelism of degree {laid.cp}: context-parallel groups {listed} (the ranks of a group read "
            f"the same batch shard; inside engine.context_parallel(buffers=...) rank r of a group holds the r-th "
            f"of {laid.cp} contiguous parts of every sequence, and scaled_dot_product_attention all-gathers the keys and values of the "
            f"whole sequence over the group); gradients averaged over every data- and context-parallel rank "
            f"({laid.dp} x {laid.cp}: each rank's loss is the mean over its part of the sequence)"]  # fmt: skip


#: The default tensor-parallel plan: a linear layer's last name -> how it is split (Hugging Face-style names, as
#: DeepSpeed's AutoTP recognises them: the projections into a block are split by output columns, the projection out
#: of it by input rows, so each pair needs one all-reduce).
TP_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query", "key", "value", "wq", "wk", "wv", "fc1",
              "w1", "w3", "dense_h_to_4h", "c_fc")  # fmt: skip
TP_ROWWISE = ("o_proj", "out_proj", "output_proj", "down_proj", "dense", "wo", "fc2", "w2", "dense_4h_to_h",
              "c_proj")  # fmt: skip


def tp_plan_step(cfg: TorshConfig) -> str:
    """The tensor-parallel plan in words (the engine's :mod:`torsh.engine.parallel.tensor_parallel` applies it)."""
    plan_ = cfg.parallelism.tp_plan
    head = f"tensor parallelism over {cfg.parallelism.tp} ranks: DTensor parallelize_module on the tp sub-mesh, "
    if plan_:
        return head + "the configured plan (parallelism.tp_plan): " + ", ".join(
            f"{pattern} -> {style}" for pattern, style in plan_.items())
    return (head + "the default plan for Hugging Face-style names: ColwiseParallel on "
            + "/".join(TP_COLWISE) + ", RowwiseParallel on " + "/".join(TP_ROWWISE)
            + " (a block's linear layers are split only when all of them are named so and it has a rowwise one; "
            "every other parameter is replicated over the tp ranks)")


def _sharding_step(decided: EnginePlan, cfg: TorshConfig) -> str:
    if cfg.parallelism.tp > 1 and cfg.sharding.stage < 2:
        laid = decided.degrees
        over = f"the data-parallel sub-mesh ({laid.dp} rank(s))" if laid else "the data-parallel sub-mesh"
        return (f"FSDP2 fully_shard(reshard_after_forward=False) on {over}, after tensor parallelism (as "
                f"torchtitan composes them): sharding.stage {cfg.sharding.stage} runs as ZeRO-2's layout, DDP's "
                "numerics (the engine's DDP reduces over every rank, not a sub-mesh)")  # fmt: skip
    if decided.pipeline and decided.data_parallel in ("ddp", "zero1"):
        return _pipeline_step(decided)
    if decided.data_parallel == "ddp":
        return "DDP (DistributedDataParallel): parameters, gradients and optimizer state replicated"
    if decided.data_parallel == "zero1":
        return ("ZeRO-1 as DeepSpeed runs it: whole parameters on every rank; DDP all-reduces the whole gradients "
                "at the accumulation boundary; each rank steps its partition of the flat fp32 masters and "
                "optimizer state; updated partitions all-gathered after the step")
    if decided.data_parallel == "zero2":
        return ("ZeRO-2 as DeepSpeed runs it: whole parameters on every rank; gradients reduced in buckets during "
                "backward into each rank's partition; fp32 masters and optimizer state partitioned; updated "
                "partitions all-gathered after the step")
    laid = decided.degrees
    cp = laid.cp if laid is not None else 1
    group = laid.dp_shard * cp if laid is not None else cfg.sharding.hybrid_shard_size
    mesh = (f"HSDP on a 2-D mesh (shard within groups of {group}, replicate across groups)"
            if decided.data_parallel == "hsdp" else "sharded over all data-parallel ranks")  # fmt: skip
    if cp > 1:
        mesh += f" and their context-parallel peers (dp_shard x cp flattened: {laid.dp_shard} x {cp})"
    if cfg.parallelism.tp > 1:
        mesh += ", on the data-parallel sub-mesh after tensor parallelism"
    return (f"FSDP2 fully_shard(reshard_after_forward={decided.reshard_after_forward}) - "
            f"ZeRO-{cfg.sharding.stage}-like, {mesh}")


def _pipeline_step(decided: EnginePlan) -> str:
    reduce = ("the pipeline engine all-reduces the whole gradients over each stage's data-parallel replicas after "
              "its micro-batches (as DeepSpeed's pipeline engine; no DDP)")  # fmt: skip
    if decided.data_parallel == "ddp":
        return f"pipeline stages, data parallel: parameters, gradients and optimizer state replicated; {reduce}"
    return (f"pipeline stages, ZeRO-1 over each stage's replicas: whole parameters; {reduce}; each replica steps "
            "its partition of the flat fp32 masters and optimizer state; updated partitions all-gathered after "
            "the step")


def _offload_steps(decided: EnginePlan, cfg: TorshConfig) -> list[str]:
    o = cfg.offload
    if o.params == "none" and o.optimizer == "none":
        return []
    parts = ", ".join(x for x in (f"parameters -> {o.params}" if o.params != "none" else "",
                                  f"optimizer -> {o.optimizer}" if o.optimizer != "none" else "") if x)  # fmt: skip
    if decided.fsdp_cpu_offload:
        how = f"CPUOffloadPolicy(pin_memory={o.pin_memory})" + (
            "; it keeps the sharded parameters and gradients on the CPU too" if o.params == "none" else "")
    else:
        how = "the fp32 master weights, their gradients and the optimizer step on the CPU"
    return [f"offload ({parts}): {how}"] + _nvme_steps(o)


def _nvme_steps(o) -> list[str]:
    """NVMe offload in words: the optimizer state in files, the parameters (approximate) in CPU memory."""
    steps = []
    if o.optimizer == "nvme":
        steps.append(f"NVMe offload: the per-element optimizer state (exp_avg, exp_avg_sq, ...) in files under "
                     f"{o.nvme_path}/zero_stage_<stage>/optimizer/rank<r>/<n>, read in and written back piece by piece "
                     "around each rank's optimizer step; the fp32 master weights stay in CPU memory")  # fmt: skip
    if o.params == "nvme":
        steps.append("offload.params=nvme (approximate): the parameters are kept in CPU memory "
                     "(CPUOffloadPolicy), not swapped to files - NVMe parameter swapping is done as CPU offload")
    return steps


def _precision_steps(decided: EnginePlan) -> list[str]:
    if decided.autocast:
        return [f"torch.autocast({_dtype(decided.param_dtype)}) around forward"] + (
            [f"MixedPrecisionPolicy(reduce_dtype={_dtype(decided.reduce_dtype)}) with fp32 sharded parameters"]
            if decided.fsdp_mixed_precision else [])  # fmt: skip
    if decided.fsdp_mixed_precision:
        return [f"MixedPrecisionPolicy(param_dtype={_dtype(decided.param_dtype)}, "
                f"reduce_dtype={_dtype(decided.reduce_dtype)}) with fp32 sharded parameters"]
    if not decided.fsdp and decided.param_dtype != "fp32":
        return [f"parameters cast to {_dtype(decided.param_dtype)} for compute, "
                f"{_dtype(decided.master_dtype)} master weights in the optimizer"]
    return []
