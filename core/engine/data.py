"""The training dataloader DeepSpeed builds from ``training_data``, and the loader the pipeline engine repeats."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, DistributedSampler

from torsh.config import DataConfig


def build_dataloader(dataset, *, micro_batch_size: int, data: DataConfig, rank: int, world_size: int,
                     collate_fn: Callable | None = None, pin_memory: bool | None = None) -> DataLoader:  # fmt: skip
    """A DataLoader of ``micro_batch_size`` over a ``DistributedSampler``, as DeepSpeed's ``deepspeed_io``.

    Like DeepSpeed's, the sampler is never ``set_epoch``-ed: every epoch sees the same order.
    A DataLoader passed as ``training_data`` is used as it is.
    """
    if isinstance(dataset, DataLoader):
        return dataset
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=data.shuffle, seed=data.seed)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                      num_workers=data.num_workers, drop_last=data.drop_last,
                      pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory)  # fmt: skip


class RepeatingLoader:
    """Iterate a loader forever: restart it when it is exhausted (DeepSpeed's ``RepeatingLoader``, which the
    pipeline engine reads its micro-batches from)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
