"""The registry of dialects, detection by content, and loading any config into the core model.

A dialect is a module in this package (its file name is its name; files starting with ``_`` are shared
helpers) or an entry point in the ``torsh.adapters`` group. Every dialect module has the same shape:
``NAME``, ``FIELD_MAP``, ``VALUE_MAPS``, ``ALIASES``, ``read(raw, *, version=None)``,
``write(cfg, *, version=None)`` and ``sniff(raw) -> float`` (0: not this dialect, 1: certainly this one).
A dialect whose files name other files sets ``READS_RELATIVE_PATHS = True``; ``load`` then passes
``base_dir`` (the config's folder) to its ``read``, which resolves them as their consumer does (Accelerate: the
working directory) and reports when they are found only next to the config.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from torsh.config import TorshConfig
from torsh.dialect import check_text_keys
from torsh.errors import ConfigError, Problem, did_you_mean
from torsh.formats import load_file
from torsh.translate import Translation

REQUIRED_ATTRIBUTES = ("NAME", "FIELD_MAP", "VALUE_MAPS", "ALIASES", "read", "write", "sniff")


@cache
def _entry_points() -> dict[str, str]:
    from importlib.metadata import entry_points

    return {ep.name: ep.value for ep in entry_points(group="torsh.adapters")}


@cache
def _modules() -> frozenset[str]:
    """The modules of this package (listed once: sniffing asks for every dialect's module)."""
    return frozenset(m.name for m in pkgutil.iter_modules(__path__))


def names() -> list[str]:
    """Every registered dialect name, sorted."""
    local = [name for name in _modules() if not name.startswith("_")]
    return sorted(set(local) | set(_entry_points()))


def get(name: str) -> ModuleType:
    """The adapter module of a dialect; an unknown name is a ConfigError with a did-you-mean."""
    known = names()
    if name not in known:
        raise ConfigError([Problem("dialect", name, f"unknown dialect; known: {', '.join(known)}",
                                   did_you_mean(name, known))])  # fmt: skip
    if name in _entry_points() and name not in _modules():
        module_name = _entry_points()[name].split(":")[0]
    else:
        module_name = f"{__name__}.{name}"
    return importlib.import_module(module_name)


def sniff(raw: Any) -> str:
    """The dialect a parsed config is written in, decided by its content (never its file name)."""
    scores = sorted(((get(n).sniff(raw), n) for n in names()), reverse=True)
    if not scores or scores[0][0] <= 0:
        what = ("" if isinstance(raw, dict) else "the content is text with no launch command in it (torchrun, "
                "deepspeed, horovodrun, mpirun, accelerate launch, ...), not a mapping of keys; "
                if isinstance(raw, str) else f"the content is a {type(raw).__name__}, not a mapping of keys; ")
        keys = ", ".join(map(str, list(raw)[:8])) if isinstance(raw, dict) else raw
        raise ConfigError([Problem("", keys, f"{what}cannot tell which dialect this is; pass the dialect "
                                   f"explicitly (--from with one of: {', '.join(names())})")])  # fmt: skip
    if len(scores) > 1 and scores[0][0] == scores[1][0]:
        raise ConfigError([Problem("", None, f"looks equally like {scores[0][1]} and {scores[1][1]}; pass the "
                                   "dialect explicitly (--from)")])  # fmt: skip
    return scores[0][1]


def read(raw: Any, dialect: str | None = None, *, version: str | None = None,
         base_dir: str | os.PathLike[str] | None = None) -> Translation[TorshConfig]:  # fmt: skip
    """Read parsed config data of any dialect (sniffed when not given) into the core model.

    Every entry point reads through here (``load`` parses a file first), so a file and the same data as a dict get
    the same report. The report also says what the engine cannot honour whatever the dialect (gradient compression
    methods that need DDP's dense buckets at the FSDP2 stages), so a translation warns before ``initialize``
    refuses. ``base_dir`` is the config file's folder, for dialects whose files name other files.
    """
    from torsh import dialect as pipeline

    check_text_keys(raw)
    data, _ = pipeline.without_schema_key(raw)
    return pipeline.read(get(dialect or sniff(data)), raw, version=version, base_dir=base_dir,
                         cross_checks=_cross_checks)  # fmt: skip


def _cross_checks(translation: Translation[TorshConfig]) -> list:
    from torsh.compression_rules import compression_notes_for_stage

    cfg = translation.result
    return compression_notes_for_stage(cfg.compression, cfg.sharding.stage)


def write(cfg: TorshConfig, dialect: str, *, version: str | None = None) -> Translation[Any]:
    """Write the core model in a dialect."""
    return get(dialect).write(cfg, version=version)


def load(source: str | os.PathLike[str] | dict | TorshConfig, dialect: str | None = None, *,
         version: str | None = None) -> Translation[TorshConfig]:  # fmt: skip
    """Load a config from a path, parsed data, or a TorshConfig: parse the file, then :func:`read` it; errors are
    attributed to the file."""
    if isinstance(source, TorshConfig):
        return Translation(source, [], "torsh", "torsh")
    if isinstance(source, dict):
        return read(source, dialect, version=version)
    data, _ = load_file(source)
    try:
        # A config that names other files (Accelerate's deepspeed_config_file): the consumer opens them relative to
        # the working directory; the config's folder is where the dialect looks when they are not there.
        return read(data, dialect, version=version, base_dir=Path(source).parent)
    except ConfigError as exc:
        raise exc.with_source(str(Path(source))) from None
