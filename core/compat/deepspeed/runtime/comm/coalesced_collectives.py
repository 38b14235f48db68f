"""``deepspeed.runtime.comm.coalesced_collectives``: one reduce-scatter for several tensors at once.

:func:`reduce_scatter_coalesced` averages a list of tensors over a process group and gives each rank its part of
every one of them, as DeepSpeed's ZeRO-3 reduces gradients: tensor ``i`` is cut into ``world_size`` chunks of
``ceil(numel / world_size)`` elements (the last ones shorter, possibly empty) and rank ``r`` gets chunk ``r``. The
chunks of all tensors travel in one padded buffer and one ``reduce_scatter_tensor`` call. ZeRO++'s quantized
all-to-all (:func:`all_to_all_quant_reduce`, qgZ) is not run by torsh.
"""

from __future__ import annotations

import math

import torch

from ..._unsupported import unsupported_function

__all__ = ["reduce_scatter_coalesced", "all_to_all_quant_reduce"]

all_to_all_quant_reduce = unsupported_function(
    "runtime.comm.coalesced_collectives.all_to_all_quant_reduce",
    "ZeRO++'s quantized gradient all-to-all (zero_quantized_gradients) is not run; reduce_scatter_coalesced "
    "reduces the same tensors unquantized")  # fmt: skip


@torch.no_grad()
def reduce_scatter_coalesced(tensors: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """The mean over ``group`` of each tensor, this rank's chunk of each (1-D views of one buffer), in order.

    As DeepSpeed's, the division by the group size happens before the sum (so a half-precision sum does not
    overflow), and a single tensor that splits evenly is reduced in place: it holds its values divided by the group
    size afterwards."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    chunk_sizes = [math.ceil(t.numel() / world) for t in tensors]
    if len(tensors) == 1 and tensors[0].numel() % world == 0:
        flat = tensors[0].view(-1)
    else:  # rank r's chunks of every tensor, padded to their full chunk size, then rank r+1's ...
        pieces = []
        for r in range(world):
            for tensor, size in zip(tensors, chunk_sizes):
                chunk = tensor.reshape(-1)[r * size:(r + 1) * size]
                pieces += [chunk, chunk.new_zeros(size - chunk.numel())]
        flat = torch.cat(pieces)
    flat.div_(world)
    mine = flat.chunk(world)[rank]
    dist.reduce_scatter_tensor(mine, flat, group=group)
    out, offset = [], 0
    for tensor, size in zip(tensors, chunk_sizes):
        kept = max(0, min(size, tensor.numel() - rank * size))
        out.append(mine.narrow(0, offset, kept))
        offset += size
    return out
