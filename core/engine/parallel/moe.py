"""Expert parallelism for DeepSpeed's mixture-of-experts layers: the process groups, and what the engine does
differently for expert parameters.

The layout is DeepSpeed's (E + D): each data-parallel rank list is cut into expert-parallel groups of ``ep_size``
consecutive ranks (an MoE layer spreads its experts over one such group and exchanges tokens within it); the
ranks holding the same experts, one from each expert-parallel group, form an expert-data-parallel group. A
layer with ``ep_size`` 2 on 2 ranks: expert-parallel group [0, 1], expert-data-parallel groups [0] and [1].

Expert parameters carry DeepSpeed's marks (``allreduce = False``, ``group_name = "ep_size_<n>"``). Where the
expert-data-parallel group is the whole data-parallel world (``ep_size`` 1) they are ordinary data-parallel
parameters. Otherwise (*local* experts) each rank holds other experts, and DeepSpeed's rules apply:

- start-up: rank 0's values are not broadcast into them; each expert-data-parallel group takes its first rank's;
- gradients: summed over the expert-data-parallel group only and divided by the data-parallel world size (an
  expert already saw every expert-parallel rank's tokens through the all-to-all, so this is the mean over all
  samples, the same value whatever ``ep_size``);
- the gradient norm (stage 0): each rank's norm, averaged over the ranks (DeepSpeed's ``clip_grad_norm_``).

:func:`prepare_experts` returns the :class:`ExpertPlan` the engine consults at those points (None for a model
without MoE layers). The groups live here (the engine never imports the DeepSpeed compatibility layer);
``deepspeed.utils.groups`` reads them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import own_group

log = logging.getLogger("torsh.engine")

EXPERT_PARALLEL: dict[str, Any] = {}
"""This rank's expert-parallel group by name (``ep_size_<n>``)."""
EXPERT_PARALLEL_RANKS: dict[str, list[int]] = {}
EXPERT_DATA_PARALLEL: dict[str, Any] = {}
"""This rank's expert-data-parallel group by name."""
EXPERT_DATA_PARALLEL_RANKS: dict[str, list[int]] = {}


class ExpertParallelNotSupported(NotImplementedError):
    """An MoE layout the torsh engine cannot train correctly yet (raised instead of training it wrongly)."""


def expert_parallel_ranks(world_size: int, tensor_parallel_size: int, expert_parallel_size: int,
                          pipeline_parallel_size: int = 1,
                          use_data_before_expert_parallel: bool = False) -> tuple[list, list]:  # fmt: skip
    """(expert-parallel rank lists, expert-data-parallel rank lists) for DeepSpeed's E + M + D layout: ranks of
    one tensor-parallel group are consecutive; each pipeline stage's data-parallel groups take every
    ``tensor_parallel_size``-th rank; each data-parallel list is cut into expert-parallel groups of
    ``expert_parallel_size`` consecutive members, and the i-th members of those groups form an
    expert-data-parallel group. ``use_data_before_expert_parallel`` (D + E) orders each data-parallel list so
    that the expert-parallel groups are strided instead."""
    tp, pp, ep = tensor_parallel_size, pipeline_parallel_size, expert_parallel_size
    _check_divides(world_size, tp * pp)
    dp_world_size = world_size // (tp * pp)
    _check_divides(dp_world_size, ep)
    stage_size = world_size // pp
    data_parallel: list[list[int]] = []
    for stage_start in range(0, world_size, stage_size):
        for offset in range(tp):
            members = list(range(stage_start + offset, stage_start + stage_size, tp))
            if use_data_before_expert_parallel:
                stride = dp_world_size // ep
                members = [members[j] for first in range(stride) for j in range(first, dp_world_size, stride)]
            data_parallel.append(members)
    expert_parallel: list[list[int]] = []
    expert_data_parallel: list[list[int]] = []
    for members in data_parallel:
        chunks = [members[i:i + ep] for i in range(0, dp_world_size, ep)]
        expert_parallel.extend(chunks)
        expert_data_parallel.extend([list(column) for column in zip(*chunks)])
    return expert_parallel, expert_data_parallel


def _check_divides(numerator: int, denominator: int) -> None:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"


def create_expert_groups(expert_parallel_size: int, use_data_before_expert_parallel: bool = False) -> str:
    """Make the expert-parallel and expert-data-parallel groups of ``expert_parallel_size`` (which must divide the
    world size, as DeepSpeed asserts) over every rank; collective (every rank calls it; every rank creates every
    group, as torch requires); done once per size. Returns the groups' name, ``ep_size_<n>``."""
    world = dist.get_world_size()
    ep = expert_parallel_size
    _check_divides(world, ep)
    name = f"ep_size_{ep}"
    if name in EXPERT_PARALLEL:
        return name
    expert_parallel, expert_data_parallel = expert_parallel_ranks(world, 1, ep, 1, use_data_before_expert_parallel)
    group, ranks = own_group(expert_parallel)
    EXPERT_PARALLEL[name], EXPERT_PARALLEL_RANKS[name] = group, list(ranks)
    group, ranks = own_group(expert_data_parallel)
    EXPERT_DATA_PARALLEL[name], EXPERT_DATA_PARALLEL_RANKS[name] = group, list(ranks)
    return name


def is_expert_param(p: torch.Tensor) -> bool:
    """DeepSpeed's mark of an expert parameter (``allreduce`` False)."""
    return getattr(p, "allreduce", True) is False


# --------------------------------------------------------------------------------------------------
# optimizer parameter groups


def split_expert_groups(param_groups: Any, max_group_size: int | float | None = 178956971) -> list:
    """DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``: the optimizer's parameter groups
    with the expert parameters moved out. Each group keeps its shared parameters, and for each expert group name
    any group holds parameters of, a copy of the group's options follows (``name`` the expert group's, ``moe:
    True``) holding those expert parameters, cut into groups of at most ``max_group_size`` elements (None: not
    cut). The list is changed in place and returned. The expert groups follow in the order their names first
    appear (DeepSpeed iterates a set of the names, whose order can differ between processes; the partitions
    need the same order on every rank)."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"split_params_into_different_moe_groups_for_optimizer takes a parameter group (a dict) or "
                         f"a list or tuple of them, not {type(param_groups).__name__}")  # fmt: skip
    expert_names: list[str] = []
    for group in param_groups:
        for p in group["params"]:
            if is_expert_param(p) and p.group_name not in expert_names:
                expert_names.append(p.group_name)
    # one expert group per (source group name, expert group name); source groups sharing a name share them
    expert_groups: dict[Any, dict[str, dict]] = {}
    for group in param_groups:
        for name in expert_names:
            expert_groups.setdefault(group["name"], {})[name] = {**group, "name": name, "moe": True, "params": []}
    for group in param_groups:
        shared = []
        for p in group["params"]:
            if is_expert_param(p):
                expert_groups[group["name"]][p.group_name]["params"].append(p)
            else:
                shared.append(p)
        group["params"] = shared
    for by_name in expert_groups.values():
        for group in by_name.values():
            if max_group_size is None:
                param_groups.append(group)
                continue
            for run in _runs(group["params"], max_group_size):
                param_groups.append({**group, "params": run})
    return param_groups


def _runs(params: list, max_size: int | float) -> list[list]:
    """``params`` in order, in runs of at most ``max_size`` elements (a larger parameter alone)."""
    runs: list[list] = []
    current: list = []
    size = 0
    for p in params:
        numel = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
        if size + numel <= max_size:
            current.append(p)
            size += numel
        else:
            runs.append(current)
            current, size = [p], numel
    if current:
        runs.append(current)
    return runs


def expert_param_groups(model_parameters: list) -> list:
    """DeepSpeed's ``configure_moe_param_groups`` (what its engine does to ``model_parameters`` of a model with
    MoE layers when it builds the optimizer): a list of parameters becomes one group ``dense-params`` and is
    split; a list of groups is split unless it already holds ``moe`` groups."""
    assert isinstance(model_parameters, list), (
        f"with MoE layers, model_parameters is a list of parameters or of parameter groups, not "
        f"{type(model_parameters).__name__}")
    wrong = [type(p).__name__ for p in model_parameters if not isinstance(p, (torch.Tensor, dict))]
    if wrong:
        raise TypeError(f"model_parameters holds a {wrong[0]}: the optimizer takes tensors or parameter groups "
                        "(dicts)")
    first = model_parameters[0]
    if isinstance(first, torch.nn.Parameter):
        return split_expert_groups({"params": model_parameters, "name": "dense-params"})
    if isinstance(first, dict) and not any("moe" in group for group in model_parameters):
        return split_expert_groups(model_parameters)
    return model_parameters


# --------------------------------------------------------------------------------------------------
# what the engine does for local experts


@dataclass
class ExpertPlan:
    """The local expert parameters of a model (those whose expert-data-parallel group is smaller than the
    data-parallel world), by expert group name, and the engine's steps for them."""

    local: dict[str, list[nn.Parameter]]
    dp_world_size: int
    layers: list = field(default_factory=list)
    """The model's MoE layers (modules with ``set_deepspeed_parallelism``)."""
    model_params: list = field(default_factory=list)
    partitioned_in_backward: bool = False
    """ZeRO-2: the expert partitions reduce the gradients in backward (:mod:`.moe_zero`); nothing is left to
    :meth:`reduce_gradients`."""
    _ids: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._ids = {id(p) for params in self.local.values() for p in params}

    @property
    def active(self) -> bool:
        """Whether any parameter needs the expert rules (False: every expert is data-parallel over the world)."""
        return bool(self._ids)

    def is_local(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is a local expert parameter."""
        return id(p) in self._ids

    def shared(self, holders) -> list:
        """``holders`` (parameters, or their fp32 master copies) without the local experts and their masters:
        what the data-parallel reduction may touch."""
        from ..precision import MASTER

        skip = self._ids | {id(getattr(p, MASTER)) for ps in self.local.values() for p in ps if hasattr(p, MASTER)}
        return [h for h in holders if id(h) not in skip]

    @torch.no_grad()
    def broadcast(self) -> None:
        """Each expert-data-parallel group's first rank's values into the group's local experts (start-up)."""
        for name, params in self.local.items():
            group, src = EXPERT_DATA_PARALLEL[name], EXPERT_DATA_PARALLEL_RANKS[name][0]
            if dist.get_world_size(group) == 1:
                continue
            for p in params:
                dist.broadcast(p.data, src=src, group=group)

    @torch.no_grad()
    def reduce_gradients(self, gradients: Any = None, reduce_dtype: torch.dtype | None = None, *,
                         masters: bool = False) -> None:  # fmt: skip
        """The local experts' gradients summed over their expert-data-parallel group and divided by the
        data-parallel world size, with the configured reduction (``gradients``: the engine's GradientsConfig;
        post-scale, ``gradient_predivide_factor``, sum or mean, in ``reduce_dtype``), one flat collective per group
        and dtype. A parameter without a gradient counts as zeros (it gets a zero gradient, as DeepSpeed gives
        it). ``masters``: the gradients sit on the fp32 master copies (stage 0 accumulating in them)."""
        from ..precision import MASTER

        if self.partitioned_in_backward:
            return
        from ..zero.sharding import _after_reduce, _before_reduce, _ReduceState

        for name, params in self.local.items():
            holders = [getattr(p, MASTER, p) if masters else p for p in params]
            holders = [h for h in holders if h.requires_grad or masters]
            for h in holders:
                if h.grad is None:
                    h.grad = torch.zeros_like(h)
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for h in holders:
                by_dtype.setdefault(h.grad.dtype, []).append(h.grad)
            group = EXPERT_DATA_PARALLEL[name]
            for dtype, grads in by_dtype.items():
                state = _ReduceState(getattr(gradients, "reduce_op", "mean"), getattr(gradients, "prescale", False),
                                     getattr(gradients, "predivide_factor", 1.0), reduce_dtype or dtype,
                                     self.dp_world_size)  # fmt: skip
                flat = torch.cat([g.reshape(-1) for g in grads])
                work = _before_reduce(state, flat)
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(work, group=group)
                _after_reduce(state, work, flat)
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(part.view_as(g))

    def param_groups(self, model_parameters: Any) -> list:
        """The optimizer's parameter groups as DeepSpeed's engine makes them for a model with MoE layers when it
        builds the optimizer itself: ``model_parameters`` (None: the model's parameters) split into shared and
        ``moe`` groups (:func:`expert_param_groups`)."""
        return expert_param_groups(list(model_parameters if model_parameters is not None else self.model_params))

    def engine_members(self) -> dict:
        """DeepSpeed's engine attributes of an MoE model (``has_moe_layers``, ``num_experts``, ``moe_layers``,
        ``gate_modules``, ``expert_parallel_group``, ``expert_data_parallel_group``), to set on the engine."""
        return {"has_moe_layers": bool(self.layers), "num_experts": [m.num_experts for m in self.layers],
                "moe_layers": [m.deepspeed_moe for m in self.layers if hasattr(m, "deepspeed_moe")],
                "gate_modules": [m.deepspeed_moe.gate for m in self.layers if hasattr(m, "deepspeed_moe")],
                "expert_parallel_group": EXPERT_PARALLEL, "expert_data_parallel_group": EXPERT_DATA_PARALLEL}

    def warn_16bit_save(self) -> None:
        """``save_16bit_model`` writes what DeepSpeed writes below stage 3: rank 0's module state, which holds
        rank 0's experts only (under their local ids) when the ranks hold different experts; said in the log
        (``save_checkpoint`` writes every expert, in DeepSpeed's expert files)."""
        if self.active and dist.is_initialized() and dist.get_rank() == 0:
            log.warning("save_16bit_model with MoE expert parallelism (%s): the file holds rank 0's experts only, "
                        "as DeepSpeed writes it; save_checkpoint writes every expert", ", ".join(sorted(self.local)))

    def global_norm(self, grads: list[torch.Tensor]) -> float:
        """DeepSpeed's stage-0 gradient norm of a model with local experts: this rank's 2-norm of ``grads``,
        averaged over the data-parallel ranks (the ranks hold different experts, so their norms differ; a
        non-finite norm on any rank makes every rank's result non-finite, so all skip the step together)."""
        if grads:
            local = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        else:  # on the device the process group reduces on (NCCL: the current accelerator)
            from torsh.engine.zero.construction import comm_device

            local = torch.zeros((), device=comm_device(None))
        local = local.double().reshape(1) / self.dp_world_size
        dist.all_reduce(local)
        return float(local)


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE layers (the modules with ``set_deepspeed_parallelism``, as DeepSpeed's engine finds them:
    its ``has_moe_layers``), in ``modules()`` order."""
    return [m for m in model.modules() if hasattr(m, "set_deepspeed_parallelism")]


def prepare_experts(model: nn.Module, *, stage: int, dp_world_size: int, kind: str = "ddp",
                    use_data_before_expert_parallel: bool = False) -> ExpertPlan | None:  # fmt: skip
    """Give the model's MoE layers their process groups (``set_deepspeed_parallelism`` on every module that has
    it, as DeepSpeed's engine calls it; collective) and return the plan of its local experts (None: the model has
    no expert parameters). Call it before the start-up broadcast and before DDP wraps the model: DDP is told to
    leave the local experts alone (their gradients are reduced by :meth:`ExpertPlan.reduce_gradients`).

    At ZeRO-1/2 the engine builds its partitions with :func:`.moe_zero.build_expert_zero` instead of ``build_zero``.
    Refused (:class:`ExpertParallelNotSupported`) where the engine cannot yet train local experts correctly:
    ZeRO-3 / FSDP2 (its shards span the whole world). ``kind``: the engine's layout, ``"ddp"`` (stages 0-2),
    ``"fsdp"`` (stage 3), or a parallelism beside data parallelism (``"tp"``: refused with MoE layers)."""
    layers = moe_layers(model)
    if layers and kind not in ("ddp", "fsdp"):
        raise ExpertParallelNotSupported(
            f"MoE layers beside {kind} parallelism are not run by the torsh engine: the expert groups are cut from "
            "a data-parallel world of every rank; drop the tensor/pipeline degree or the MoE layers")  # fmt: skip
    for module in layers:
        module.set_deepspeed_parallelism(use_data_before_expert_parallel)
    experts = [p for p in model.parameters() if is_expert_param(p)]
    if not experts:
        return None
    local: dict[str, list[nn.Parameter]] = {}
    for p in experts:
        name = getattr(p, "group_name", None)
        if name not in EXPERT_DATA_PARALLEL:
            raise ValueError(f"an expert parameter (allreduce=False) names the expert group {name!r}, which no MoE "
                             f"layer created (made: {sorted(EXPERT_DATA_PARALLEL) or 'none'}): mark expert "
                             "parameters through deepspeed.moe.layer.MoE")  # fmt: skip
        if len(EXPERT_DATA_PARALLEL_RANKS[name]) < dp_world_size:
            local.setdefault(name, []).append(p)
    plan = ExpertPlan(local, dp_world_size, layers, list(model.parameters()))
    if not plan.active:
        return plan
    if stage > 2 or kind != "ddp":
        names = ", ".join(sorted(local))
        raise ExpertParallelNotSupported(
            f"MoE expert parallelism ({names}) at ZeRO stage {stage} is not run by the torsh engine yet: the "
            "experts of each rank differ, and FSDP2's shards span every rank. Use zero_optimization.stage 0, 1 or "
            "2, or ep_size=1 (every rank holds every expert; all stages work)")  # fmt: skip
    _ignore_in_ddp(model, plan)
    return plan


def _ignore_in_ddp(model: nn.Module, plan: ExpertPlan) -> None:
    """Tell DDP (built later) not to reduce or broadcast the local experts."""
    from torch.nn.parallel import DistributedDataParallel

    names = [n for n, p in model.named_parameters() if plan.is_local(p)]
    names += list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(set(names)))
