"""``deepspeed.runtime.dataloader``: ``RepeatingLoader``, the engine's (:mod:`torsh.engine.data`)."""

from torsh.engine.data import RepeatingLoader  # noqa: F401
