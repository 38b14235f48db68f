"""ZeRO stages 1 and 2 for a model with local experts (:mod:`.moe`): one flat partition per process group.

DeepSpeed partitions an MoE parameter group over its expert-data-parallel group, not over the data-parallel
world: the ranks of an expert-parallel group hold different experts, so a partition spanning them would mix
different tensors under one name. Here the shared parameters form one
:class:`~torsh.engine.zero.partition.ZeroPartition` over the world, and the local experts of each expert group
name another over that name's expert-data-parallel group. :class:`ExpertZero` drives them together behind the
one-partition interface the engine uses.

The expert partitions reduce their gradients as DeepSpeed does: summed over the expert-data-parallel group and
divided by the data-parallel world size (stage 2: the division on each gradient as it arrives, before the
partition's sum; stage 1: :meth:`.moe.ExpertPlan.reduce_gradients` before the partition takes its elements).
The gradient norm is the norm of every rank's partitions together (one all-reduce over the world), DeepSpeed's
ZeRO norm with MoE groups; the optimizer has the script's parameter groups, each over the matching flat masters
of every partition.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..zero.partition_checkpoint import CheckpointViews
from .moe import EXPERT_DATA_PARALLEL

log = logging.getLogger("torsh.engine")


class ExpertZero:
    """Several :class:`ZeroPartition` objects (the shared one first) with the interface of one."""

    def __init__(self, parts: list, hooks: list) -> None:
        self.parts = parts
        self._hooks = hooks
        self.reduces = parts[0].reduces

    # the engine's calls, applied to every partition (the shared one first, in the same order on every rank)

    def before_backward(self, sync: bool) -> None:
        for part in self.parts:
            part.before_backward(sync)

    def finish_backward(self) -> None:
        for part in self.parts:
            part.finish_backward()

    def absorb_grads(self, grads: dict | None = None) -> None:
        for part in self.parts:
            part.absorb_grads(grads)

    def step_tensors(self) -> list[nn.Parameter]:
        return [m for part in self.parts for m in part.step_tensors()]

    def global_norm(self, grads: list[torch.Tensor], *, skip: list = (), over: tuple = ()) -> float:
        """The 2-norm of all partitions' gradients of every rank: each rank's squared norms summed over the
        world (the expert partitions of an expert-data-parallel group are disjoint pieces of its experts, and
        the groups hold different experts, so every element counts once)."""
        if skip:
            raise NotImplementedError("a tied-weight skip list in the gradient norm of expert-parallel ZeRO: "
                                      "pipeline parallelism with MoE experts is not run by the torsh engine")
        return self.parts[0].global_norm(grads, over=over)

    def gather_params(self) -> None:
        for part in self.parts:
            part.gather_params()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def params_to_master(self) -> None:
        for part in self.parts:
            part.params_to_master()

    def remove(self) -> None:
        for part in self.parts:
            part.remove()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @property
    def masters(self) -> list[nn.Parameter]:
        return [m for part in self.parts for m in part.masters]

    @property
    def buckets(self) -> list:
        return [b for part in self.parts for b in part.buckets]

    @property
    def collectives(self) -> int:
        return sum(part.collectives for part in self.parts)

    @property
    def group_params(self) -> list[list[nn.Parameter]]:
        """The parameters of each optimizer group: the shared partition's, then each expert partition's."""
        return [[p for part in self.parts for p in part.group_params[gi]]
                for gi in range(len(self.parts[0].group_params))]  # fmt: skip

    full_view = CheckpointViews.full_view
    """:meth:`ZeroPartition.full_view`'s one implementation, over every partition through the three views below:
    one module of whole fp32 parameters (each gathered within its partition's group; a rank's experts are its
    own) and one optimizer view over them with the whole state. Collective. With ``load``, each partition takes
    its slices back."""

    def _load_view(self, module: nn.Module, optimizer: Any, view_opt: Any, view_of: dict[int, nn.Parameter]) -> None:
        for part in self.parts:
            part._load_view(module, optimizer, view_opt, view_of)

    def _module_view(self, module: nn.Module) -> tuple[nn.Module, dict[int, nn.Parameter]]:
        """The shared partition's module view, with the expert partitions' whole values in their parameters."""
        root, view_of = self.parts[0]._module_view(module)
        for part in self.parts[1:]:
            wholes: dict[int, torch.Tensor] = {}
            for gi, m in enumerate(part.masters):
                wholes.update(part._split(part._gather_flat(m.data), gi))
            for key, value in wholes.items():
                view_of[key].data.copy_(value)
        return root, view_of

    def _optimizer_view(self, optimizer: Any, view_of: dict[int, nn.Parameter]) -> Any:
        """One optimizer view: group i holds every partition's parameters of group i, and their state."""
        views = [part._optimizer_view(optimizer, view_of) for part in self.parts]
        for other in views[1:]:
            for group, extra in zip(views[0].param_groups, other.param_groups):
                group["params"].extend(extra["params"])
            views[0].state.update(other.state)
        return views[0]

    def load_legacy_state(self, *args, **kwargs) -> None:
        raise NotImplementedError("a ZeRO-1 optimizer state_dict of the torsh releases before the flat partition "
                                  "with MoE expert parallelism: there was none (checkpoints were refused)")

    def __getattr__(self, name: str) -> Any:
        # a member of the one-partition interface not mapped above: refused by name rather than answered for
        # the shared partition alone
        raise NotImplementedError(f"ZeRO partition member {name!r} with MoE expert parallelism (ep_size > 1 at "
                                  "ZeRO-1/2) is not provided by the torsh engine yet")  # fmt: skip


def build_expert_zero(model: nn.Module, plan: Any, *, decided: Any, precision: Any, info: Any, gradients: Any,
                      optimizer: Any, client: Any, groups: list[dict], name_of: dict[int, str]) -> tuple[Any, Any]:
    """ZeRO-1/2's ShardPlan and optimizer for a model with local experts (``plan``: its :class:`.moe.ExpertPlan`);
    the arguments are those of :func:`torsh.engine.zero.partition.build_zero`, whose place it takes."""
    from ..zero.partition import ZeroPartition, _client_groups, _trainable
    from ..zero.sharding import ShardPlan, apply_ddp

    layout = decided.sharding
    by_name = dict(model.named_parameters())
    cls, defaults, named = _client_groups(client, optimizer, layout.stage, groups, name_of, by_name)
    trainable = _trainable(named, by_name)
    stage2 = decided.data_parallel != "zero1"
    hooks = []
    if stage2 and gradients.reduce_op == "mean":
        # DeepSpeed divides an expert gradient by the data-parallel world size before summing it over the expert
        # group; the partition would divide by its own group's size, so it sums and each gradient is divided as
        # it arrives (registered before the partition's hook, which copies it out)
        hooks = [p.register_post_accumulate_grad_hook(_divider(float(plan.dp_world_size)))
                 for ps in plan.local.values() for p in ps if p.requires_grad]  # fmt: skip
    common = dict(bucket_numel=max(1, layout.reduce_bucket_numel),
                  allgather_numel=max(1, layout.allgather_bucket_numel),
                  compute_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype,
                  accum_dtype=precision.grad_accum_dtype or precision.param_dtype,
                  master_device=torch.device("cpu") if decided.masters_on_cpu else None,
                  reduce_in_backward=stage2)  # fmt: skip
    shared = [[p for p in g if not plan.is_local(p)] for g in trainable]
    parts = [ZeroPartition(model, shared, mean=gradients.reduce_op == "mean", **common)]
    for name, params in plan.local.items():
        ids = {id(p) for p in params}
        own = [[p for p in g if id(p) in ids] for g in trainable]
        parts.append(ZeroPartition(model, own, mean=False, process_group=EXPERT_DATA_PARALLEL[name], **common))
    composite = ExpertZero(parts, hooks)
    plan.partitioned_in_backward = stage2
    built = _optimizer(client, cls, defaults, named, parts, optimizer, offload=decided.optimizer_on_cpu)
    if built is not None:
        built.optimizer = built
    if info.rank == 0:
        log.info("ZeRO-%d with MoE experts: the shared partition over every rank, %d expert partition(s) over the "
                 "expert-data-parallel groups (%s)", layout.stage, len(parts) - 1, ", ".join(plan.local))  # fmt: skip
    if stage2:
        return ShardPlan(model, model, "zero", partition=composite), built
    shard = apply_ddp(model, decided, gradients, precision, info)  # DDP leaves the local experts alone (prepare)
    shard.partition = composite
    return shard, built


def _divider(divisor: float):
    def divide(p: torch.Tensor) -> None:
        if p.grad is not None:
            with torch.no_grad():
                p.grad.div_(divisor)

    return divide


def _optimizer(client: Any, cls: type | None, defaults: dict | None, named: list[dict], parts: list,
               optimizer: Any, *, offload: bool) -> Any:  # fmt: skip
    """The optimizer over the flat masters: group i of the script's groups over every partition's master i (the
    partitions without elements of the group left out, the shared one always kept)."""
    from ..zero.partition import optimizer_over

    params = []
    for i, group in enumerate(named):
        masters = [parts[0].masters[i]] + [part.masters[i] for part in parts[1:] if part.masters[i].numel()]
        params.append({**group, "params": masters})
    return optimizer_over(params, client, cls, defaults, optimizer, offload=offload)
