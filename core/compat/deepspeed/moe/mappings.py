"""``deepspeed.moe.mappings``: the token split and gather an MoE layer does when the dense part of the model is
tensor-parallel (the ranks of a tensor-parallel group then hold the same tokens; each sends only its share of
the expert slots through the all-to-all, and the shares are gathered again afterwards).

The tensor-parallel group is the one of ``deepspeed.utils.groups.mpu`` (None under the torsh engine, which
takes no ``mpu``: both functions then return their input unchanged).
"""

from __future__ import annotations

import torch

from ..utils import groups


def _mpu_call(names: tuple[str, ...], default):
    mpu = groups.mpu
    if mpu is None:
        return default
    for name in names:
        if hasattr(mpu, name):
            return getattr(mpu, name)()
    return default


def tensor_parallel_world_size() -> int:
    """The tensor-parallel degree of ``groups.mpu`` (1 without one)."""
    return _mpu_call(("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"), 1)


def _tensor_parallel_rank() -> int:
    return _mpu_call(("get_tensor_model_parallel_rank", "get_model_parallel_rank"), 0)


def _tensor_parallel_group():
    return _mpu_call(("get_tensor_model_parallel_group", "get_model_parallel_group"), None)


def _gather_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Every tensor-parallel rank's ``input_``, concatenated along ``dim``."""
    import torch.distributed as dist

    input_ = input_.contiguous()
    world = tensor_parallel_world_size()
    if world == 1:
        return input_
    parts = [torch.empty_like(input_) for _ in range(world)]
    dist.all_gather(parts, input_, group=_tensor_parallel_group())
    return torch.cat(parts, dim=dim).contiguous()


def _drop_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """This tensor-parallel rank's equal share of ``input_`` along ``dim``."""
    world = tensor_parallel_world_size()
    if world == 1:
        return input_
    assert input_.shape[dim] % world == 0, (f"input dimension {dim} ({input_.shape[dim]}) is not divisible by "
                                            f"tensor parallel world size ({world})")  # fmt: skip
    chunk = input_.shape[dim] // world
    return torch.narrow(input_, dim, _tensor_parallel_rank() * chunk, chunk)


class _GatherTokens(torch.autograd.Function):
    """Gather in forward, keep this rank's share in backward."""

    @staticmethod
    def forward(ctx, input_, dim):
        ctx.dim = dim
        return _gather_tokens(input_, dim)

    @staticmethod
    def backward(ctx, grad_output):
        return _drop_tokens(grad_output, ctx.dim), None


class _DropTokens(torch.autograd.Function):
    """Keep this rank's share in forward, gather in backward."""

    @staticmethod
    def forward(ctx, input_, dim):
        ctx.dim = dim
        return _drop_tokens(input_, dim)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_tokens(grad_output, ctx.dim), None


def gather_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Concatenate the tensor-parallel ranks' shares along ``dim`` (unchanged without tensor parallelism)."""
    if tensor_parallel_world_size() == 1:
        return input_
    return _GatherTokens.apply(input_, dim)


def drop_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """This tensor-parallel rank's share along ``dim`` (unchanged without tensor parallelism)."""
    if tensor_parallel_world_size() == 1:
        return input_
    return _DropTokens.apply(input_, dim)
