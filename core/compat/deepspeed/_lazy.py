"""Submodules as attributes on first access (``deepspeed.runtime.utils.set_random_seed`` after ``import
deepspeed``), as DeepSpeed's eager imports make them available."""

from __future__ import annotations

import importlib


def submodule_getattr(package: str, names: set[str]):
    """A module ``__getattr__`` for ``package`` that imports the listed submodules when first read."""

    def __getattr__(name: str):
        if name in names:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package.replace('torsh.compat.', '')!r} (torsh's DeepSpeed compatibility "
                             f"package) has no attribute {name!r}")  # fmt: skip

    return __getattr__
