"""``deepspeed.module_inject.tp_shard``: how many rows of a dimension each rank of a tensor-parallel (or Ulysses
sequence-parallel) group holds, as DeepSpeed 0.19.8's AutoTP shares them out, and the model sizes it records.

A dimension of ``total_size`` over ``mp_size`` ranks is shared out

- by key/value head when a head count is known (``num_kv_heads``: the argument, else the one set with
  :func:`set_num_kv_heads`) and divides the dimension, except for MLP layers (a name containing ``mlp`` or one of
  ``gate_proj``, ``up_proj``, ``down_proj``, ``w1``, ``w2``, ``w3``) and the output head (``lm_head``,
  ``embed_out``): rank r gets ``K // P`` heads, one more when ``r < K % P``, of ``total_size / K`` rows each;
- otherwise in grains of ``tp_grain_size`` rows (default 1) as evenly as they go, the first ranks one grain more,
  and the rows that make no whole grain to the last rank.

The setters and getters keep module-level values, as DeepSpeed's do. torsh's own Ulysses layer
(:mod:`torsh.compat.deepspeed.sequence.layer`) shares heads out the same way without reading them.
"""

from __future__ import annotations

from typing import Any

num_kv_heads: int | None = None
num_attention_heads: int | None = None
n_embd: int | None = None
tp_grain_size: int = 1

_OUTPUT_HEADS = ("lm_head", "embed_out")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def set_num_kv_heads(num: int | None) -> None:
    global num_kv_heads
    num_kv_heads = num


def set_num_attention_heads(num: int | None) -> None:
    global num_attention_heads
    num_attention_heads = num


def set_n_embd(num: int | None) -> None:
    global n_embd
    n_embd = num


def set_tp_grain_size(num: int) -> None:
    global tp_grain_size
    tp_grain_size = num


def get_num_kv_heads() -> int | None:
    return num_kv_heads


def get_num_attention_heads() -> int | None:
    return num_attention_heads


def get_n_embd() -> int | None:
    return n_embd


def share_out(count: int, parts: int, index: int) -> int:
    """Part ``index`` of ``count`` shared out over ``parts`` as evenly as it goes, the first parts one more."""
    return count // parts + (1 if index < count % parts else 0)


def _by_heads(total_size: int, heads: int | None, name: Any) -> bool:
    label = "" if name is None else str(name)
    return (heads is not None and total_size % heads == 0 and "mlp" not in label and label not in _OUTPUT_HEADS
            and not any(part in label for part in _MLP_NAMES))  # fmt: skip


def _group_rank(mp_size: int, mp_group: Any) -> int:
    """This process's rank in ``mp_group``; without a group, its global rank when the group is the whole world."""
    import torch.distributed as dist

    if mp_group is not None:
        return dist.get_rank(group=mp_group)
    world = dist.get_world_size()
    if world != mp_size:
        raise ValueError(f"get_shard_size: pass rank (the rank within the group) or mp_group: the group size "
                         f"{mp_size} is not the world size {world}")  # fmt: skip
    return dist.get_rank()


def get_shard_size(total_size: int, mp_size: int, name: Any = None, rank: int | None = None, mp_group: Any = None,
                   num_kv_heads: int | None = None) -> int:  # fmt: skip
    """The rows of a ``total_size`` dimension that rank ``rank`` of the group holds (the module docstring's rule).
    ``rank`` is the index within the group; None: this process's, from ``mp_group`` or the world."""
    heads = globals()["num_kv_heads"] if num_kv_heads is None else num_kv_heads
    if rank is None:
        rank = _group_rank(mp_size, mp_group)
    if _by_heads(total_size, heads, name):
        return total_size * share_out(heads, mp_size, rank) // heads
    if total_size < tp_grain_size:
        return share_out(total_size, mp_size, rank)
    grains, leftover = divmod(total_size, tp_grain_size)
    rows = share_out(grains, mp_size, rank) * tp_grain_size
    return rows + leftover if rank == mp_size - 1 else rows


def get_shard_size_list(total_size: int, mp_size: int, name: Any = None, num_kv_heads: int | None = None
                        ) -> list[int]:  # fmt: skip
    """Every rank's :func:`get_shard_size`, in rank order; they must add up to ``total_size``."""
    heads = globals()["num_kv_heads"] if num_kv_heads is None else num_kv_heads
    sizes = [get_shard_size(total_size, mp_size, name, rank, num_kv_heads=heads) for rank in range(mp_size)]
    if sum(sizes) != total_size:
        raise AssertionError(f"the shards {sizes} of {name!r} add up to {sum(sizes)}, not its size {total_size} "
                             f"(group size {mp_size}, tp_grain_size {tp_grain_size}, num_kv_heads {heads})")
    return sizes
