"""``deepspeed.runtime.zero.linear``: DeepSpeed's ZeRO-3 linear layer, an autograd function computing ``F.linear``.

DeepSpeed installs :func:`zero3_linear_wrap` as ``torch.nn.functional.linear`` at ZeRO-3 (``zero.Init`` with
``memory_efficient_linear``, its default; see :mod:`.partition_parameters`). The function gives the same values
as ``F.linear``; what it changes is where the backward runs under autocast: it records whether the forward ran
under autocast (and in which dtype) and runs the backward in exactly that state, so an autocast region around
``loss.backward()`` changes nothing, and a weight that was partitioned again after the forward (a parameter
``zero.Init`` partitioned and not yet handed to ``initialize``) is gathered for the backward and partitioned again.
It is written with ``setup_context`` so that ``torch.func`` transforms (``vmap``, ``grad``) run over it.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn

from torsh.engine.zero.whole_params import ZeroParamStatus

from ...accelerator import get_accelerator
from ..utils import noop_decorator
from .utils import is_zero_param


def _autocast_decorators() -> tuple:
    """``torch.amp.custom_fwd``/``custom_bwd`` bound to the accelerator's device type (torch >= 2.4); before that
    the device's legacy ``torch.<device>.amp`` ones, else decorators that change nothing."""
    device_type = get_accelerator().device_name()
    amp = getattr(torch, "amp", None)
    fwd, bwd = getattr(amp, "custom_fwd", None), getattr(amp, "custom_bwd", None)
    if fwd is not None and bwd is not None:
        return functools.partial(fwd, device_type=device_type), functools.partial(bwd, device_type=device_type)
    legacy = getattr(getattr(torch, device_type, None), "amp", None)
    fwd, bwd = getattr(legacy, "custom_fwd", None), getattr(legacy, "custom_bwd", None)
    if fwd is not None and bwd is not None:
        return fwd, bwd
    return noop_decorator, noop_decorator


autocast_custom_fwd, autocast_custom_bwd = _autocast_decorators()


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    """Whether autocast is on for ``device_type`` and its dtype (torch before 2.4 has per-device getters)."""
    try:
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except TypeError:
        enabled = getattr(torch, f"is_autocast_{device_type}_enabled", torch.is_autocast_enabled)()
        dtype_of = getattr(torch, f"get_autocast_{device_type}_dtype", None)
        return enabled, dtype_of() if dtype_of is not None else None


def _gathered_for_backward(weight: Tensor) -> bool:
    """Whether ``weight`` is a partitioned parameter whose data was freed after the forward (then gathered here)."""
    if not (is_zero_param(weight) and hasattr(weight, "all_gather")):
        return False
    return getattr(weight, "ds_status", None) is ZeroParamStatus.NOT_AVAILABLE


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """``input @ weight.T + bias``, with the backward run in the forward's autocast state."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input, weight, bias=None):  # noqa: A002  (DeepSpeed's argument names)
        if bias is not None and input.dim() == 2:
            return torch.addmm(bias, input, weight.t())  # one fused kernel, as F.linear uses
        output = input.matmul(weight.t())
        if bias is not None:  # in place: the output keeps the matmul's dtype (autocast's), as DeepSpeed's does
            output += bias
        return output

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight = inputs[0], inputs[1]  # noqa: A001
        bias = inputs[2] if len(inputs) > 2 else None
        ctx._fwd_used_autocast, ctx._dtype = _autocast_state(get_accelerator().device_name())
        ctx.save_for_backward(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors  # noqa: A001
        device_type = get_accelerator().device_name()
        gathered = _gathered_for_backward(weight)
        if gathered:
            weight.all_gather()
        try:
            # autocast exactly as in the forward: also switched off when the forward ran without it
            with torch.autocast(device_type=device_type, enabled=ctx._fwd_used_autocast, dtype=ctx._dtype):
                return _linear_grads(ctx.needs_input_grad, grad_output, input, weight, bias)
        finally:
            if gathered:
                weight.partition()


def _linear_grads(needs: tuple, grad_output: Tensor, input: Tensor, weight: Tensor, bias: Tensor | None) -> tuple:  # noqa: A002
    """The gradients of ``input @ weight.T + bias`` for the inputs that need one (None for the others)."""
    grad_input = grad_weight = grad_bias = None
    dim = grad_output.dim()
    if needs[0]:
        grad_input = grad_output.matmul(weight)
    if needs[1]:
        if dim == 1:  # an unbatched input: the outer product
            grad_weight = grad_output.unsqueeze(-1) * input.unsqueeze(0)
        else:
            grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))
    if bias is not None and needs[2]:
        grad_bias = grad_output if dim == 1 else grad_output.sum(tuple(range(dim - 1)))
    return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input, weight, bias=None):  # noqa: A002
    """``F.linear``'s signature over :class:`LinearFunctionForZeroStage3` (what DeepSpeed installs as it)."""
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


class LinearModuleForZeroStage3(nn.Module):
    """``nn.Linear`` (same parameters, initialisation and ``extra_repr``) whose forward is
    :class:`LinearFunctionForZeroStage3`."""

    __constants__ = ["in_features", "out_features"]

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = nn.init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        return LinearFunctionForZeroStage3.apply(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
