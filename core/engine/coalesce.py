"""``engine.coalesce_grad_reduction()``: several ``engine.backward`` calls, one gradient reduction.

DeepSpeed's context manager (ZeRO stages 1-3): every backward inside the block leaves its gradients on this rank,
unreduced, added to those of the backwards before it; leaving the block reduces them once, as one backward at the
boundary would have, so the next ``engine.step()`` steps the mean over the ranks of the summed gradients. What the
block promises, as DeepSpeed's: ``step()`` inside it raises, it does not nest with ``no_sync`` either way, it is
refused at ZeRO stage 0 and under pipeline parallelism (and, as DeepSpeed refuses its BF16_Optimizer wrapper
there, at ZeRO-1 with bf16 weights accumulated in fp32 without optimizer offload), and the engine's boundary flag
(``set_gradient_accumulation_boundary``) is the one set before the block when the block ends.

Where the local gradients wait, and how the one reduction runs, by how the engine shards:

- ZeRO-1 (DDP and this rank's partition): DDP does not reduce in the block (the engine's ``no_sync`` state); the
  gradients add up in ``.grad`` (in the accumulation dtype when ``grad_accum_dtype`` is wider than the weights:
  they are moved out of ``.grad`` after each backward). The flush all-reduces them with the engine's reduction
  and keeps this rank's elements in its partition, as a reduced boundary backward does.
- ZeRO-2 (the partition reduces in gradient hooks): the hooks do nothing in the block; ``.grad`` adds up in the
  compute dtype, as in DeepSpeed's. The flush replays those gradients through one backward whose roots are the
  parameters themselves (``torch.autograd.backward(params, grads)``): their accumulation hooks fire once each, so
  the partition reduces them in its buckets and order exactly as after an ordinary backward.
- ZeRO-3 (FSDP2): ``set_requires_gradient_sync(False)``, so FSDP2 keeps the unsharded gradients (in the reduce
  dtype) instead of reduce-scattering them. The flush turns the sync back on and runs FSDP2's end-of-backward
  step on the root once, which reduce-scatters what each unit holds into the sharded gradients. FSDP2 has no
  public call for that step; it is the one its own last backward runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from . import zero3_members


class CoalesceError(AssertionError, RuntimeError):
    """``coalesce_grad_reduction()`` misused (nested): DeepSpeed raises ``AssertionError``."""


def check_allowed(engine: Any) -> None:
    """DeepSpeed's refusals, in its order, before anything changes."""
    stage = engine.zero_optimization_stage()
    if stage not in (1, 2, 3):
        raise NotImplementedError(f"coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage {stage}: "
                                  "at stage 0 use engine.no_sync() and engine.allreduce_gradients()")  # fmt: skip
    if engine.pipeline_parallelism:
        raise NotImplementedError("coalesce_grad_reduction is not supported under pipeline parallelism")
    precision = engine._precision
    if (stage == 1 and precision.param_dtype == torch.bfloat16 and precision.grad_accum_dtype == torch.float32
            and not engine.zero_cpu_offload()):  # fmt: skip
        raise NotImplementedError("coalesce_grad_reduction does not yet support optimizer wrapper BF16_Optimizer "
                                  "(DeepSpeed's optimizer for ZeRO-1 with bf16 weights and fp32 gradient "
                                  "accumulation): use ZeRO-2, optimizer offload, or leave "
                                  "data_types.grad_accum_dtype unset")  # fmt: skip
    if engine.optimizer is None:
        raise NotImplementedError("coalesce_grad_reduction needs an optimizer (the reduced gradients are stepped): "
                                  "pass one to initialize or configure one")  # fmt: skip
    if engine._in_no_sync:
        raise CoalesceError("coalesce_grad_reduction cannot be nested inside another no_sync context")
    if engine.__dict__.get("_experts") is not None:  # local experts reduce over their own groups, not in one flush
        raise NotImplementedError("coalesce_grad_reduction with MoE expert parallelism (ep_size above 1) is not "
                                  "run by the torsh engine: call engine.backward once per micro-batch, or use "
                                  "ep_size=1")  # fmt: skip


@contextlib.contextmanager
def coalesced(engine: Any) -> Iterator[None]:
    """The block of :meth:`Engine.coalesce_grad_reduction` (see the module docstring)."""
    check_allowed(engine)
    saved_boundary = engine._boundary_override
    engine._in_no_sync = True
    engine.__dict__["_coalescing"] = {}  # ZeRO-1 with a wider accumulation dtype: parameter -> local gradient
    widened = engine.__dict__["_coalesce_widened"] = []  # FSDP2 settings changed for the block
    engine.__dict__["_coalesced_backwards"] = 0
    try:
        yield
    except BaseException:
        # the block failed (on this rank, maybe half-way through a backward): no flush, whose collectives the
        # other ranks may never join; the settings go back and the error is the block's
        engine._in_no_sync = False
        _restore(widened)
        engine.__dict__["_coalescing"] = None
        engine._boundary_override = saved_boundary
        raise
    else:
        engine._in_no_sync = False
        engine._boundary_override = True  # the flush is a boundary reduction
        try:
            if engine._shard.kind == "fsdp":
                engine._flush_coalesced_reduction_zero3(engine.optimizer)
            else:
                engine._flush_coalesced_reduction_zero12(engine.optimizer)
        finally:
            _restore(widened)
            engine.__dict__["_coalescing"] = None
            engine._boundary_override = saved_boundary


def after_backward(engine: Any, sync: bool) -> None:
    """After each ``engine.backward``: in a block at ZeRO-1 with a wider accumulation dtype, move the local
    gradients out of ``.grad`` into that dtype; count the reduced micro-steps (``optimizer.micro_step_id``, the
    reduced backwards since the last step, a member of DeepSpeed's ZeRO-3 optimizer)."""
    held = engine.__dict__.get("_coalescing")
    if held is not None:
        engine.__dict__["_coalesced_backwards"] += 1
    if held is not None and engine._shard.kind == "fsdp" and not engine.__dict__["_coalesce_widened"]:
        engine.__dict__["_coalesce_widened"] += _widen_fsdp_accumulation(engine.wrapped)
    if held is not None and _accumulates_wider(engine):
        with torch.no_grad():
            for p in engine.module.parameters():
                if p.grad is not None:
                    g = p.grad.to(engine._precision.grad_accum_dtype)
                    held[p] = g if p not in held else held[p].add_(g)
                    p.grad = None
    if sync:
        zero3_members.count_micro_step(engine)


def _accumulates_wider(engine: Any) -> bool:
    precision = engine._precision
    return (engine._shard.kind == "ddp" and engine._shard.partition is not None
            and precision.grad_accum_dtype is not None and precision.grad_accum_dtype != precision.param_dtype)


def flush_zero12(engine: Any) -> None:
    """The one reduction of a block at ZeRO-1/2 (or of stage 1 under DDP)."""
    part = engine._shard.partition
    if engine._shard.kind == "zero":  # ZeRO-2: replay the local gradients through the partition's hooks
        params = [p for p in engine.module.parameters() if p.requires_grad and p.grad is not None]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        part.before_backward(True)
        if params:
            torch.autograd.backward(params, grads)
        engine._after_backward(True)  # the buckets without a gradient on this rank join the collectives as zeros
        return
    if _accumulates_wider(engine):  # ZeRO-1: reduce the gradients held in the wider dtype, keep this rank's elements
        held = engine.__dict__.get("_coalescing") or {}
        from .parallel.mpu import reduction_group
        from .zero.sharding import allreduce_gradients

        allreduce_gradients(list(held.values()), engine._policy.gradients, engine._precision,
                            *reduction_group(engine))  # fmt: skip
        engine.__dict__["_unreduced"] = False
        part.absorb_grads({id(p): g for p, g in held.items()})
        held.clear()
        return
    engine.allreduce_gradients()  # the gradients the block left in .grad (the engine marked them unreduced)


def _widen_fsdp_accumulation(model: torch.nn.Module) -> list[tuple[Any, str, Any]]:
    """Under FSDP2 with low-precision compute, make each unit add the block's unsharded gradients up in the dtype
    of its sharded (fp32) parameters, as its sharded gradients add up outside a block, rather than in the compute
    dtype (a sum of bf16 gradients rounded at every addition); the one reduction still communicates in the compute
    dtype. FSDP2 does this itself when its reduce dtype differs from the compute dtype; here that dtype is set on
    each parameter for the block only, after the block's first backward (FSDP2 sets its dtypes up in the first
    forward), whose gradients are moved to that dtype at once. Returns what to put back (:func:`_restore`)."""
    from torch.distributed.fsdp import FSDPModule

    changed: list[tuple[Any, str, Any]] = []
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in getattr(module._get_fsdp_state(), "_fsdp_param_groups", []):
            if id(group) in seen or getattr(group, "_reduce_dtype", False) is not None:
                continue
            seen.add(id(group))
            params = [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad and fp.reduce_dtype is None
                      and fp.param_dtype is not None and fp.param_dtype != fp.orig_dtype]  # fmt: skip
            if not params:
                continue
            changed.append((group, "_reduce_dtype", None))
            group._reduce_dtype = params[0].param_dtype  # the reduction keeps communicating in the compute dtype
            for fp in params:
                changed.append((fp, "reduce_dtype", None))
                fp.reduce_dtype = fp.orig_dtype
                fp.to_accumulated_grad_if_needed()
    return changed


def _restore(changed: list[tuple[Any, str, Any]]) -> None:
    for holder, name, value in changed:
        setattr(holder, name, value)


def flush_zero3(engine: Any) -> None:
    """The one reduction of a block under FSDP2: sync on again, then FSDP2's end-of-backward step on the root
    (each unit reduce-scatters the unsharded gradients it accumulated and resharded)."""
    model = engine.wrapped
    model.set_requires_gradient_sync(True)
    if not engine.__dict__.get("_coalesced_backwards"):
        return  # no backward in the block: nothing was accumulated (and FSDP2 may not be set up yet)
    state = model._get_fsdp_state()
    state._root_post_backward_final_callback()
    zero3_members.count_micro_step(engine)

