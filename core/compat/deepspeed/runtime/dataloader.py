"""``deepspeed.runtime.dataloader``: ``RepeatingLoader``."""

from __future__ import annotations


class RepeatingLoader:
    """Iterate a loader forever: restart it when it is exhausted (DeepSpeed's ``RepeatingLoader``)."""

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
