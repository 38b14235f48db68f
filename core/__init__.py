"""torsh-distributed: one typed model for distributed-training configs, and an engine that runs them.

Importing ``torsh`` (and ``torsh.config``, ``torsh.adapters``) never imports torch; the engine and
``torsh.initialize`` load it on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

#: Public names that need torch, loaded on first access so that ``import torsh`` stays torch-free.
_LAZY = {
    "initialize": "torsh.engine.initialize",
    "add_config_arguments": "torsh.engine.initialize",
    "init_distributed": "torsh.engine.initialize",
    "Engine": "torsh.engine.engine",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torsh' has no attribute {name!r}")
