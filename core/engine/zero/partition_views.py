"""DeepSpeed's ZeRO-1/2 optimizer members, shown over torsh's flat partition.

DeepSpeed's ZeRO-1/2 optimizer keeps each parameter group as one flat low-precision buffer (the parameters are
views of it), cut into W equal partitions, and this rank's partition as a flat fp32 master; scripts and DeepSpeed's
own tests read these members from ``engine.optimizer``. :func:`attach_zero_members` gives the optimizer that steps
a :class:`~torsh.engine.zero.partition.ZeroPartition` the same members, each showing torsh's own tensors (a
write through them reaches the model, never a copy):

- ``bit16_groups``: each optimizer group's parameters the partition holds (trainable, floating point), in order;
- ``bit16_groups_flat``: each group's parameters as one flat tensor in the compute dtype, on their device: their
  storage. torsh lays it out bucket after bucket (``reduce_bucket_size``), each padded to a multiple of 2W
  elements, where DeepSpeed pads the whole group;
- ``parallel_partitioned_bit16_groups``: per group, the W ranks' partitions of that flat tensor (views). A group
  cut into several buckets gives each rank one chunk of every bucket, not one contiguous run: reading it then
  raises, naming ``reduce_bucket_size``;
- ``nccl_start_alignment_factor``: 2, as DeepSpeed's: every partition starts 4-byte aligned in a 2-byte dtype;
- ``single_partition_of_fp32_groups``: this rank's flat fp32 masters, the tensors the torch optimizer steps;
- ``partition_count``: per group, the number of ranks it is cut over;
- ``accumulated_grads_in_cpu`` (only under optimizer offload, as DeepSpeed's): by DeepSpeed's parameter id (the
  index of the parameter in ``bit16_groups``, group after group), this rank's elements of the gradient accumulated
  since the last step, for each parameter it holds elements of that has one. At stage 2 and after stage 1's
  reduction these are slices of the partition gradient (on the CPU under offload), which the next backward adds
  to; before stage 1's boundary, slices of the local unreduced ``.grad``. Empty after a step. (DeepSpeed's entries
  hold the whole parameter, fill only when a step accumulates over several backwards, and stay after the step.)

Building the members logs DeepSpeed's line ``Flattening param group <i> on <device> (sufficient memory)`` for
each flat group, on every rank, on DeepSpeed's logger ("DeepSpeed"): torsh always flattens on the parameters'
own device, the path DeepSpeed takes when there is room.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .slots import ALIGNMENT, ZERO_SLOT

ds_log = logging.getLogger("DeepSpeed")  # DeepSpeed's logger (deepspeed.utils.logger): its lines go there


def attach_zero_members(optimizer: Any, partition: Any, *, offload: bool, stage: int) -> None:
    """Give ``optimizer`` (the one stepping ``partition``'s masters) DeepSpeed's ZeRO-1/2 members (see the module
    docstring) as instance attributes, which survive the drop-in's change of its class (``FusedAdam``)."""
    flats = _group_flats(partition, stage)
    members: dict[str, Any] = {
        "bit16_groups": [list(ps) for ps in partition.group_params],
        "bit16_groups_flat": flats,
        "parallel_partitioned_bit16_groups": _partitions(partition, flats),
        "nccl_start_alignment_factor": ALIGNMENT,
        "single_partition_of_fp32_groups": partition.masters,
        "partition_count": [partition.world] * len(partition.group_params),
    }
    if offload:
        members["accumulated_grads_in_cpu"] = AccumulatedGrads(partition)
    optimizer.__dict__.update(members)
    if not isinstance(flats, Refused):
        for gi, flat in enumerate(flats):
            ds_log.info(f"Flattening param group {gi} on {flat.device.type} (sufficient memory)")


def _group_flats(partition: Any, stage: int) -> list[torch.Tensor] | Refused:
    out = []
    for gi, flat in enumerate(partition.flats):
        if flat is None and partition.group_params[gi]:
            return Refused(f"engine.optimizer.bit16_groups_flat: the parameters of optimizer group {gi} differ in "
                           f"dtype or device (or are not contiguous), so torsh's ZeRO-{stage} keeps them as separate "
                           "tensors, not one flat buffer; give the group's parameters one dtype and device (or put "
                           "the others in a group of their own)")  # fmt: skip
        out.append(flat if flat is not None else torch.empty(0, dtype=partition.compute_dtype,
                                                             device=partition.device))  # fmt: skip
    return out


def _partitions(partition: Any, flats: list[torch.Tensor] | Refused) -> list[list[torch.Tensor]] | Refused:
    if isinstance(flats, Refused):
        return Refused(flats.message.replace("bit16_groups_flat", "parallel_partitioned_bit16_groups"))
    out = []
    for gi, flat in enumerate(flats):
        buckets = [b for b in partition.buckets if b.group == gi]
        if len(buckets) > 1:
            return Refused(f"engine.optimizer.parallel_partitioned_bit16_groups: optimizer group {gi} is reduced in "
                           f"{len(buckets)} buckets of about zero_optimization.reduce_bucket_size elements, and each "
                           "rank owns one chunk of every bucket, so no rank's partition is one contiguous run of "
                           "bit16_groups_flat; set reduce_bucket_size to at least the group's number of elements "
                           f"({sum(b.numel for b in buckets)}) for one bucket per group")  # fmt: skip
        chunk = buckets[0].chunk if buckets else 0
        out.append([flat[r * chunk:(r + 1) * chunk] for r in range(partition.world)])
    return out


class Refused(Sequence):
    """A member torsh cannot show in DeepSpeed's form here: any use raises, saying why and what to do."""

    def __init__(self, message: str) -> None:
        self.message = message

    def _refuse(self, *_: Any) -> Any:
        raise NotImplementedError(self.message)

    __getitem__ = __len__ = __iter__ = _refuse

    def __repr__(self) -> str:
        return f"<not available: {self.message}>"


class AccumulatedGrads(Mapping):
    """DeepSpeed's ``accumulated_grads_in_cpu`` over a partition: read live (see the module docstring)."""

    def __init__(self, partition: Any) -> None:
        self._partition = partition
        self._params: list[nn.Parameter] = [p for ps in partition.group_params for p in ps]

    def _entry(self, pid: Any) -> torch.Tensor | None:
        if not isinstance(pid, int) or not 0 <= pid < len(self._params):
            return None
        part, p = self._partition, self._params[pid]
        start, end = part.local_range(p)
        if start == end:
            return None
        _, b, _ = getattr(p, ZERO_SLOT)
        if b.index in part._written:  # reduced into the partition gradient since the last step
            return part.local_view(p, part.grads[b.group])
        if not part.reduces and p.grad is not None:  # stage 1 before the boundary: the local accumulation
            return p.grad.detach().reshape(-1)[start:end]
        return None

    def __getitem__(self, pid: Any) -> torch.Tensor:
        entry = self._entry(pid)
        if entry is None:
            raise KeyError(pid)
        return entry

    def __iter__(self) -> Iterator[int]:
        return (pid for pid in range(len(self._params)) if self._entry(pid) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"AccumulatedGrads({ {pid: tuple(t.shape) for pid, t in self.items()} })"
