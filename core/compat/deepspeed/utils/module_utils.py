"""``deepspeed.utils.module_utils``: reach a submodule by its dotted name (DeepSpeed-Chat's LoRA conversion)."""

from __future__ import annotations

from functools import reduce


def recursive_getattr(model, module_name: str):
    """``model.<a>.<b>...`` for ``module_name`` ``"a.b..."``."""
    return reduce(getattr, module_name.split("."), model)


def recursive_setattr(model, module_name: str, module) -> None:
    """Put ``module`` at the dotted name ``module_name`` inside ``model`` (replacing what is there)."""
    parent, _, name = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, name, module)
