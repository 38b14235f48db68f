"""A ``loss.backward()`` the script runs itself on the output of ``engine(...)``, as DeepSpeed treats it.

DeepSpeed's ZeRO optimizers (stages 1-3) count the gradients a backward produces and finish the reduction
themselves, so there a script may call ``loss.backward()`` (or ``engine.scale(loss).backward()``) on the output
of ``engine(...)``: the torsh engine then completes that backward as ``engine.backward`` would have (its
epilogue: the reduction DDP left to it, ZeRO-1's partition of the reduced gradients), queued to run when autograd
finishes. Without a ZeRO optimizer (ZeRO stage 0, whose optimizer is the torch optimizer or DeepSpeed's
fp16/bf16 wrapper, or an engine without an optimizer) DeepSpeed's engine raises a RuntimeError when a backward that
is not ``engine.backward(loss)`` reaches the forward's outputs, instead of leaving the gradients unreduced; the
torsh engine raises the same error in the same case. Both through a hook on the forward's outputs; a backward
under a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``) is left alone, as in DeepSpeed.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import torch

from .parallel.context import direct_backward_started

MESSAGE = ("Direct calls to tensor.backward() are not supported in this configuration (ZeRO stage 0, or an engine "
           "without an optimizer: nothing would reduce the gradients). Please use engine.backward(loss) instead, "
           "as DeepSpeed requires here.")  # fmt: skip


SCALE_MESSAGE = ("Loss scaling is required for this configuration (fp16 with a loss scaler), but backward() was "
                 "called directly on a loss that was not scaled. Use engine.backward(loss), or "
                 "engine.scale(loss).backward(), as DeepSpeed requires here.")  # fmt: skip


DOUBLE_BACKWARD_MESSAGE = (
    "torch.autograd.grad(..., create_graph=True) through the output of engine(...) (a gradient penalty) is not run "
    "by the torsh engine at ZeRO stage 3: FSDP2 frees the gathered parameters after this pass, which the backward "
    "through the penalty needs again. Use ZeRO stage 1 or 2 for this model, or a penalty that does not "
    "differentiate through the input gradient")  # fmt: skip


ZERO_MARK = "_torsh_deepspeed_zero_optimizer"
"""The attribute marking the engine's optimizer at ZeRO 1-3 as standing for DeepSpeed's ``ZeROOptimizer``."""


def adopt(engine: Any, optimizer: Any) -> None:
    """At ZeRO stages 1-3, mark ``optimizer`` (the engine's) as DeepSpeed's ZeRO optimizer, the one that completes
    a direct backward (``deepspeed.runtime.base_optimizer.ZeROOptimizer`` recognises the mark), with its
    ``needs_scaler()``: whether a direct backward needs ``engine.scale(loss)``."""
    if engine.zero_optimization_stage() == 0:
        return
    setattr(optimizer, ZERO_MARK, True)
    owner = weakref.ref(engine)
    optimizer.needs_scaler = lambda: bool(getattr(owner(), "_scaling", False))


class ScaleError(AssertionError, ValueError):
    """``engine.scale`` given what is not a scalar loss (DeepSpeed asserts it; a ValueError for torsh's own API)."""


def refuses(engine: Any) -> bool:
    """Whether DeepSpeed refuses a direct backward for this engine (it has no ZeRO optimizer)."""
    return engine.optimizer is None or engine.zero_optimization_stage() == 0


def guard(engine: Any, outputs: Any) -> None:
    """Hook the tensors of ``outputs`` that backward can reach. A backward not run by ``engine.backward`` raises
    when it gets there where DeepSpeed refuses it (:func:`refuses`); elsewhere it is run as DeepSpeed's ZeRO
    optimizers run it: the engine's prologue once per backward, each output gradient divided by the accumulation
    steps (unless the last ``engine.backward`` said ``scale_wrt_gas=False``), the epilogue when autograd
    finishes. Under fp16 loss scaling the loss must come from ``engine.scale(loss)``, else it raises before any
    gradient is made. ``torch.autograd.grad`` through the outputs is not a backward of the engine's and is left
    alone (DeepSpeed would divide its output gradients by the accumulation steps; torsh does not), except that with
    ``create_graph=True`` at ZeRO-3 it is refused (:data:`DOUBLE_BACKWARD_MESSAGE`)."""
    if not torch.is_grad_enabled():
        return
    # outputs computed in this forward only: a hook on a leaf (a parameter the model returns) would stay on it
    tensors = [t for t in _tensors(outputs) if t.requires_grad and t.grad_fn is not None]
    if not tensors:
        return
    owner = weakref.ref(engine)
    refused = refuses(engine)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        engine = owner()
        if engine is None or engine.__dict__.get("_running_backward") or _functorch_transforming():
            return grad
        if refused:
            raise RuntimeError(MESSAGE)
        # decided once per backward (an autograd graph task), however many outputs of however many forwards
        # it reaches; torch.autograd.grad (a gradient penalty, an input saliency) is left alone
        task = torch._C._current_graph_task_id()
        seen = engine.__dict__.get("_direct_backward_task")
        if seen is None or seen[0] != task:
            seen = (task, _accumulates(torch._C._current_autograd_node()))
            engine.__dict__["_direct_backward_task"] = seen
            if seen[1]:
                _begin(engine)
            elif torch.is_grad_enabled() and engine._shard.kind == "fsdp":  # autograd.grad(create_graph=True)
                raise NotImplementedError(DOUBLE_BACKWARD_MESSAGE)
        gas = engine.gradient_accumulation_steps()
        return grad / gas if seen[1] and gas > 1 and engine.__dict__.get("_scale_wrt_gas", True) else grad

    # the hook holds nothing of the graph (the node it runs for is asked of autograd): a closure over the
    # tensor's grad_fn, on which torch keeps the hook, would be a cycle keeping the forward's activations alive
    for t in tensors:
        t.register_hook(hook)


def _accumulates(grad_fn: Any) -> bool:
    """Whether the running backward accumulates into the leaves of the graph (``loss.backward()``), and is not
    ``torch.autograd.grad``, which leaves ``.grad`` alone: asked of the leaf nearest the output (breadth first).
    True when no leaf is found within a bound (a graph that reaches its parameters through a reentrant
    checkpoint only)."""
    queue, seen = collections.deque([grad_fn]), set()
    while queue and len(seen) < 10_000:
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # an AccumulateGrad: a leaf of the graph
            try:
                return bool(torch._C._will_engine_execute_node(node))
            except RuntimeError:  # torch refuses the question for a leaf while torch.autograd.grad runs
                return False
        queue.extend(child for child, _ in node.next_functions)
    return True


def _begin(engine: Any) -> None:
    """The start of a direct backward: DeepSpeed's loss-scaling check, the engine's prologue, and its epilogue
    queued to run last."""
    if engine._scaling and not engine.__dict__.get("_manual_backward_expected"):
        raise RuntimeError(SCALE_MESSAGE)
    engine._check_alive("backward")
    engine._backward_prologue()
    split_attention_done = direct_backward_started(engine)  # context parallelism: recomputations attend whole

    def finish() -> None:
        split_attention_done()
        engine.__dict__["_manual_backward_expected"] = False
        engine._backward_epilogue()

    # queued from a queued callback, so that it runs after the callbacks backward queues meanwhile (DDP's
    # finalisation of its reduction is one: the epilogue checks that it finished)
    run_last = torch.autograd.Variable._execution_engine.queue_callback
    run_last(lambda: run_last(finish))


def scale(engine: Any, loss: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's loss scaling for a backward the script runs itself, ``engine.scale(loss).backward()``: fp16
    with a loss scaler needs it (:data:`SCALE_MESSAGE`); otherwise the loss is returned as it is."""
    if engine.optimizer is None:
        raise RuntimeError("engine.scale needs an optimizer: pass one to initialize or configure one")
    if not torch.is_tensor(loss) or loss.numel() != 1 or loss.grad_fn is None:  # DeepSpeed's rule: one element
        raise ScaleError("engine.scale expects a loss that is a scalar tensor with a grad_fn; for a non-scalar "
                         "tensor call tensor.backward(gradient) on the output of engine(...)")  # fmt: skip
    engine.__dict__["_manual_backward_expected"] = True
    return engine.loss_scaler.scale(loss) if engine._scaling else loss


def _tensors(outputs: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors in ``outputs`` (a tensor, or tuples, lists and dicts of them; a model's output object too)."""
    if torch.is_tensor(outputs):
        return [outputs]
    if depth > 4:
        return []
    if isinstance(outputs, dict):
        values = outputs.values()
    elif isinstance(outputs, (tuple, list)):
        values = outputs
    else:
        return []
    return [t for v in values for t in _tensors(v, depth + 1)]


def _functorch_transforming() -> bool:
    """True under ``torch.func.grad`` / ``vmap`` / ``jacrev`` (a functorch interpreter is on the stack)."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None
