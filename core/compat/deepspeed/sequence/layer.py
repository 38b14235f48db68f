"""``deepspeed.sequence.layer``: DeepSpeed-Ulysses sequence parallelism on ``torch.distributed.all_to_all_single``.

Each rank of a sequence-parallel group holds a contiguous block of the sequence (rank r the r-th block) with every
attention head. ``DistributedAttention`` exchanges query, key and value so that each rank holds the whole sequence
for its share of the heads, runs the local attention on that, and exchanges the result back to sequence blocks
with every head: the output of attention over the whole sequence on one rank. Tensors are ``[batch, seq, heads,
head_dim]`` (``batch_dim_idx=0``) or ``[seq, batch, heads, head_dim]`` (``batch_dim_idx=1``); as in DeepSpeed,
``scatter_idx >= 2`` means "scatter the heads, gather the sequence" and ``scatter_idx < 2`` the reverse, the
sequence dimension following from ``batch_dim_idx``.

Heads are shared out by key/value group, as DeepSpeed does: with ``K`` key/value heads over ``P`` ranks, rank r
gets ``K // P`` groups, one more when ``r < K % P``; a tensor with ``H`` heads (``H`` a multiple of ``K``, e.g. the
query heads under grouped-query attention) gives it ``H / K`` heads per group; other head counts are shared out as
evenly as they go. Gradients flow back through the reverse exchange. DeepSpeed's overlap of the exchanges with
computation on a side CUDA stream (``sp_stream``) is not done: the exchanges run in order on the current stream,
with the same results.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

import torsh.engine.distributed  # noqa: F401 - its exit handler tears the layer's group down safely at exit

from ..module_inject.tp_shard import share_out

__all__ = ["DistributedAttention", "single_all_to_all", "apply_rotary_pos_emb", "head_counts"]


def head_counts(num_heads: int, world_size: int, num_kv_heads: int | None = None) -> list[int]:
    """How many of ``num_heads`` heads each of ``world_size`` ranks holds (see the module docstring)."""
    if num_kv_heads is not None and num_heads % num_kv_heads == 0:
        return [num_heads * share_out(num_kv_heads, world_size, r) // num_kv_heads for r in range(world_size)]
    return [share_out(num_heads, world_size, r) for r in range(world_size)]


def _seq_dim(batch_dim_idx: int) -> int:
    if batch_dim_idx not in (0, 1):
        raise ValueError(f"batch_dim_idx must be 0 ([batch, seq, heads, dim]) or 1 ([seq, batch, heads, dim]), "
                         f"got {batch_dim_idx}")  # fmt: skip
    return 1 - batch_dim_idx


def _check(x: Tensor, world: int, num_kv_heads: int | None) -> None:
    if x.dim() != 4:
        raise ValueError(f"Ulysses sequence parallelism exchanges 4-D tensors ([batch, seq, heads, dim] or [seq, "
                         f"batch, heads, dim]), got shape {tuple(x.shape)}")  # fmt: skip
    if num_kv_heads is not None and num_kv_heads < world:
        raise ValueError(f"Ulysses sequence parallelism: {num_kv_heads} key/value heads over {world} ranks would "
                         "leave a rank with no head; use at most as many ranks as key/value heads")  # fmt: skip


def _exchange(chunks: list[Tensor], receive_shapes: list[list[int]], group) -> list[Tensor]:
    """Send ``chunks[r]`` to rank r of ``group``; the tensors received, one per rank, in rank order."""
    send = torch.cat([c.reshape(-1) for c in chunks])
    sizes = [int(torch.Size(shape).numel()) for shape in receive_shapes]
    received = torch.empty(sum(sizes), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(received, send, output_split_sizes=sizes, input_split_sizes=[c.numel() for c in chunks],
                           group=group)  # fmt: skip
    return [part.view(shape) for part, shape in zip(received.split(sizes), receive_shapes)]


def _to_heads(x: Tensor, seq_dim: int, group, counts: list[int]) -> Tensor:
    """Sequence block with every head -> the whole sequence with this rank's ``counts[rank]`` heads."""
    if x.shape[2] != sum(counts):
        raise ValueError(f"Ulysses sequence parallelism: the tensor has {x.shape[2]} heads, the split {counts} "
                         f"sums to {sum(counts)}")  # fmt: skip
    mine = counts[dist.get_rank(group)]
    shape = [*x.shape[:2], mine, x.shape[3]]
    received = _exchange(list(x.split(counts, dim=2)), [shape] * len(counts), group)
    return torch.cat(received, dim=seq_dim)


def _to_sequence(x: Tensor, seq_dim: int, group, counts: list[int]) -> Tensor:
    """The whole sequence with this rank's heads -> this rank's sequence block with every rank's heads (rank r
    holding ``counts[r]``)."""
    world = len(counts)
    if x.shape[seq_dim] % world:
        raise ValueError(f"Ulysses sequence parallelism: a sequence of {x.shape[seq_dim]} does not split into "
                         f"{world} equal blocks; pad the sequence to a multiple of the sequence-parallel size")
    blocks = list(x.split(x.shape[seq_dim] // world, dim=seq_dim))
    received = _exchange(blocks, [[*blocks[0].shape[:2], heads, x.shape[3]] for heads in counts], group)
    return torch.cat(received, dim=2)


def _gathered_counts(x: Tensor, group) -> list[int]:
    """Every rank's head count (one small all-gather): what a rank receives when the heads come back together."""
    world = dist.get_world_size(group)
    mine = torch.tensor([x.shape[2]], dtype=torch.int64, device=x.device)
    every = torch.empty(world, dtype=torch.int64, device=x.device)
    dist.all_gather_into_tensor(every, mine, group=group)
    return every.tolist()


def _resolve_counts(x: Tensor, to_heads: bool, group, num_kv_heads: int | None, counts: list[int] | None):
    world = dist.get_world_size(group)
    _check(x, world, num_kv_heads)
    if counts is not None:
        return list(counts)
    if to_heads:
        return head_counts(x.shape[2], world, num_kv_heads)
    return _gathered_counts(x, group)


def single_all_to_all(input, scatter_idx, gather_idx, batch_dim_idx, group, async_op=False, handle=None, type=None,
                      num_kv_heads=None):  # fmt: skip
    """One Ulysses exchange without autograd (``scatter_idx >= 2``: to the whole sequence with this rank's heads;
    else back to this rank's sequence block). ``async_op`` is not taken: the exchange completes before return."""
    if async_op:
        raise ValueError("single_all_to_all(async_op=True) is not run by torsh (no overlap on a side stream); the "
                         "exchange completes in order with async_op=False")  # fmt: skip
    to_heads = scatter_idx >= 2
    counts = _resolve_counts(input, to_heads, group, num_kv_heads, None)
    move = _to_heads if to_heads else _to_sequence
    return move(input, _seq_dim(batch_dim_idx), group, counts)


class _SeqAllToAll(torch.autograd.Function):
    """The exchange with autograd: backward runs the reverse exchange with the same head split. DeepSpeed's
    arguments; ``stream``, ``handle``, ``type`` and ``is_fwd`` (its CUDA-stream overlap) are accepted and do not
    change the result. ``head_split`` (torsh's): every rank's head count, when the caller knows it."""

    @staticmethod
    def forward(ctx: Any, group, input: Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int, stream=None,
                handle=None, type=None, is_fwd=True, num_kv_heads=None, head_split=None) -> Tensor:  # fmt: skip
        to_heads = scatter_idx >= 2
        seq_dim = _seq_dim(batch_dim_idx)
        counts = _resolve_counts(input, to_heads, group, num_kv_heads, head_split)
        ctx.group, ctx.to_heads, ctx.seq_dim, ctx.counts = group, to_heads, seq_dim, counts
        return (_to_heads if to_heads else _to_sequence)(input, seq_dim, group, counts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        reverse = _to_sequence if ctx.to_heads else _to_heads
        return (None, reverse(grad.contiguous(), ctx.seq_dim, ctx.group, ctx.counts), *([None] * 9))


def _rotate_half(x: Tensor) -> Tensor:
    """``[a, b]`` (the two halves of the last dimension) -> ``[-b, a]``."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Rotary position embedding on the first ``freqs_cos.shape[-1]`` features of ``t`` (the rest pass through):
    ``t * cos + rotate_half(t) * sin``."""
    rot_dim = freqs_cos.shape[-1]
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    rotated = rotated * freqs_cos + _rotate_half(rotated) * freqs_sin
    return rotated if passed.shape[-1] == 0 else torch.cat((rotated, passed), dim=-1)


class DistributedAttention(Module):
    """Ulysses attention over ``sequence_process_group``: ``forward(query, key, value, batch_dim_idx,
    rotary_pos_emb=None, *args, **kwargs)`` takes this rank's sequence block and returns its block of the output
    of ``local_attention(q, k, v, *args, **kwargs)`` computed over the whole sequence (see the module docstring).
    ``num_kv_heads`` (the key/value head count before sharing out) defaults to the key tensor's head count."""

    def __init__(self, local_attention: Module, sequence_process_group, scatter_idx: int = 2, gather_idx: int = 0,
                 sp_stream=None, num_kv_heads: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.num_kv_heads = num_kv_heads
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.sp_overlap_comm = False  # the exchanges run in order on the current stream
        self.overlap_handles = None

    def layer_sync(self, layer) -> None:
        """DeepSpeed waits here for a side-stream event; the exchanges here are already in order."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int, rotary_pos_emb=None, *args: Any,
                **kwargs: Any) -> Tensor:  # fmt: skip
        kv_heads = self.num_kv_heads if self.num_kv_heads is not None else key.shape[2]
        world = dist.get_world_size(self.spg)
        split = {}

        def exchange(x: Tensor, scatter: int, gather: int, counts=None) -> Tensor:
            return _SeqAllToAll.apply(self.spg, x, scatter, gather, batch_dim_idx, None, None, None, True, kv_heads,
                                      counts)  # fmt: skip

        layers = []
        for x in (query, key, value):
            split[x.shape[2]] = head_counts(x.shape[2], world, kv_heads)
            layers.append(exchange(x, self.scatter_idx, self.gather_idx, split[x.shape[2]]))
        query_layer, key_layer, value_layer = layers
        if rotary_pos_emb is not None:  # [seq, batch, 1, dim] after DeepSpeed's permute of the [batch, seq, ...] pair
            cos, sin = rotary_pos_emb[0].permute(1, 0, 2, 3), rotary_pos_emb[1].permute(1, 0, 2, 3)
            query_layer = apply_rotary_pos_emb(query_layer, cos, sin)
            key_layer = apply_rotary_pos_emb(key_layer, cos, sin)
        context = self.local_attn(query_layer, key_layer, value_layer, *args, **kwargs)
        # the way back always gathers every rank's head count of the output (one small all-gather): whether the
        # local attention kept the query's split is only known per rank, and a collective taken on some ranks
        # only would hang the others
        return exchange(context, self.gather_idx, self.scatter_idx, None)
