"""DeepSpeed's refusal of ``loss.backward()`` where its engine cannot complete a backward it did not run.

DeepSpeed's ZeRO optimizers (stages 1-3) count the gradients a backward produces and finish the reduction
themselves, so there a script may call ``loss.backward()`` (or ``engine.scale(loss).backward()``) on the output
of ``engine(...)``. Without one (ZeRO stage 0, whose optimizer is the torch optimizer or DeepSpeed's fp16/bf16
wrapper, or an engine without an optimizer) DeepSpeed's engine raises a RuntimeError when a backward that is not
``engine.backward(loss)`` reaches the forward's outputs, instead of leaving the gradients unreduced. The torsh
engine raises the same error in the same case, with a hook on the forward's outputs; a backward under a
``torch.func`` transform (``grad``, ``vmap``, ``jacrev``) is not refused, as in DeepSpeed.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

MESSAGE = ("Direct calls to tensor.backward() are not supported in this configuration (ZeRO stage 0, or an engine "
           "without an optimizer: nothing would reduce the gradients). Please use engine.backward(loss) instead, "
           "as DeepSpeed requires here.")  # fmt: skip


def refuses(engine: Any) -> bool:
    """Whether DeepSpeed refuses a direct backward for this engine (it has no ZeRO optimizer)."""
    return engine.optimizer is None or engine.zero_optimization_stage() == 0


def guard(engine: Any, outputs: Any) -> None:
    """Where DeepSpeed refuses a direct backward (:func:`refuses`), hook the tensors of ``outputs`` that backward
    can reach: a backward not run by ``engine.backward`` raises when it gets there."""
    if not torch.is_grad_enabled() or not refuses(engine):
        return
    # outputs computed in this forward only: a hook on a leaf (a parameter the model returns) would stay on it
    tensors = [t for t in _tensors(outputs) if t.requires_grad and t.grad_fn is not None]
    if not tensors:
        return
    owner = weakref.ref(engine)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        engine = owner()
        if engine is not None and not engine.__dict__.get("_running_backward") and not _functorch_transforming():
            raise RuntimeError(MESSAGE)
        return grad

    for t in tensors:
        t.register_hook(hook)


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
