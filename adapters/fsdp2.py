"""``fsdp2``: the ``fsdp`` dialect written as FSDP2 ``fully_shard`` kwargs (``--to fsdp2``)."""

from __future__ import annotations

from typing import Any

from torsh.config import TorshConfig
from torsh.translate import Translation

from . import fsdp
from .fsdp import ALIASES, FIELD_MAP, VALUE_MAPS  # noqa: F401 - the dialect shape

NAME = "fsdp2"
ALIAS_OF = "fsdp"
"""A name for one generation of the fsdp dialect: its schema, tests and examples are the fsdp dialect's."""
DEFAULT_FORMAT = "json"


def sniff(raw: Any) -> float:
    """Never detected by content: the input is the ``fsdp`` dialect; this name selects what is written."""
    return 0.0


def read(raw: Any, *, version: str | None = None) -> Translation[TorshConfig]:
    """Read FSDP2 kwargs (FSDP1 ones are an error)."""
    return fsdp.read(raw, version=version or "fsdp2")


def write(cfg: TorshConfig, *, version: str | None = None) -> Translation[dict]:
    """Write FSDP2 kwargs."""
    return fsdp.write(cfg, version=version or "fsdp2")
