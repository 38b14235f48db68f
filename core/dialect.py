"""A dialect's spec and the one read pipeline every entry point runs (the CLI, ``torsh.initialize``, parity).

A dialect is declared, not programmed: a :class:`Dialect` subclass names its key map (``FIELD_MAP``, ``VALUE_MAPS``,
``ALIASES``), the :class:`~torsh.translate.Group` rules for concepts that span several keys, its versions and its
JSON Schema. :meth:`Dialect.read` then runs the same stages for all of them::

    version -> shape -> schema -> normalise -> map -> groups -> finalize -> model validation -> finish

and :func:`read` adds what holds whatever the dialect (text keys only, ``$schema``, the cross-dialect checks).
A dialect overrides a stage only where its files need it: ``normalise`` for layouts the map cannot walk as they
are (legacy spellings, a wrapper section, script expressions), ``finalize`` for the rare rule that is not one
concept's, ``finish`` to restate notes. A family of dialects (FSDP and the trainer frameworks that carry FSDP
settings) shares one subclass and changes its map.

Writing is :meth:`Dialect.write`: the reverse of the same map, plus each group's writer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

from .config import TorshConfig
from .errors import ConfigError, Problem
from .translate import (
    Alias,
    Fidelity,
    FieldMap,
    Group,
    Note,
    ReadContext,
    Rule,
    Translation,
    WriteContext,
    check_version,
    read_mapping,
    write_mapping,
)

SCHEMA_KEY = "$schema"


@dataclass
class Prepared:
    """The input as the map walks it, and what the stages before the map found."""

    data: Mapping[str, Any]
    """What the key map walks."""
    field_map: FieldMap
    """The map for this input (a family dialect may pick one per layout)."""
    version: str | None = None
    base_dir: Path | None = None
    """The config file's folder, for dialects whose files name other files."""
    notes: list[Note] = field(default_factory=list)
    """Notes for keys handled before the map (legacy forms, script expressions); they come first in the report."""
    kept: dict[str, Any] = field(default_factory=dict)
    """Values kept in ``extensions[dialect]`` for a same-dialect round trip without passing the map."""
    state: dict[str, Any] = field(default_factory=dict)
    """Whatever ``normalise`` tells the later stages."""


class Dialect:
    """The spec of one dialect; subclasses set the class attributes and override stages only where needed."""

    NAME: ClassVar[str]
    VERSIONS: ClassVar[tuple[str, ...]] = ()
    """Supported versions, the default first; empty: the dialect is not versioned."""
    DEFAULT_FORMAT: ClassVar[str] = "json"
    FIELD_MAP: ClassVar[Mapping[str, Rule]] = {}
    VALUE_MAPS: ClassVar[Mapping[str, Mapping[Any, Any]]] = {}
    ALIASES: ClassVar[Mapping[str, str | Alias]] = {}
    GROUPS: ClassVar[tuple[Group, ...]] = ()
    DEFERRED_SOURCES: ClassVar[Mapping[str, str]] = {}
    """core path -> where an ``"auto"`` value will come from (the DEFERRED note's reason)."""
    SCHEMA: ClassVar[str | None] = None
    """Name of the JSON Schema in ``torsh.schemas`` checked before the map (None: the dialect's name)."""
    SCHEMA_NAMES_UNKNOWN_KEYS: ClassVar[bool] = True
    """False when unknown keys are the map's to report (with did-you-mean), not the schema's."""
    READS_RELATIVE_PATHS: ClassVar[bool] = False
    """True when its files name other files (resolved against ``base_dir``)."""
    SHAPE: ClassVar[str] = "a mapping of keys to values"

    @cached_property
    def field_map(self) -> FieldMap:
        return FieldMap(self.FIELD_MAP, self.ALIASES, self.GROUPS)

    # ---- the read pipeline ------------------------------------------------------------------------

    def read(self, raw: Any, *, version: str | None = None, base_dir: str | Path | None = None
             ) -> Translation[TorshConfig]:  # fmt: skip
        """Read parsed config data into the core model; every key ends in exactly one note."""
        version = self.check_version(version)
        raw = self.shape(raw)
        self.check_schema(raw)
        prepared = self.normalise(raw, Prepared(raw, self.field_map, version,
                                                Path(base_dir) if base_dir is not None else None))
        translation = read_mapping(prepared.data, dialect=self.NAME, field_map=prepared.field_map,
                                   value_maps=self.VALUE_MAPS, deferred_sources=self.DEFERRED_SOURCES,
                                   finalize=lambda ctx: self.finalize(ctx, prepared))  # fmt: skip
        if prepared.kept:
            extensions = {k: dict(v) for k, v in translation.result.extensions.items()}
            extensions.setdefault(self.NAME, {}).update(prepared.kept)
            translation.result = translation.result.model_copy(update={"extensions": extensions})
        # A key restated before the map (a legacy or no-effect spelling) keeps that note, not the map's plain one.
        restated = {(n.source_path, n.target_path) for n in prepared.notes if n.target_path}
        translation.notes[:] = [*prepared.notes, *(n for n in translation.notes
                                                   if (n.source_path, n.target_path) not in restated)]
        return self.finish(translation, prepared)

    def check_version(self, version: str | None) -> str | None:
        """The version to read for; None when the dialect is not versioned and none was asked for."""
        if not self.VERSIONS:
            return version
        return check_version(self.NAME, version, self.VERSIONS)

    def shape(self, raw: Any) -> Any:
        """The input as a mapping (a dialect whose input is text, such as a launch line, parses it here)."""
        if not isinstance(raw, Mapping):
            raise ConfigError([Problem("", raw, f"a {self.NAME} config must be {self.SHAPE}")], source=self.NAME)
        return raw

    def check_schema(self, raw: Mapping[str, Any]) -> None:
        """Types and ranges the dialect's JSON Schema states, all reported at once."""
        from torsh import schemas

        problems = schemas.check(raw, self.SCHEMA or self.NAME)
        if not self.SCHEMA_NAMES_UNKNOWN_KEYS:
            problems = [p for p in problems if "additional properties" not in p.reason.lower()]
        if problems:
            raise ConfigError(problems, source=self.NAME)

    def normalise(self, raw: Mapping[str, Any], prepared: Prepared) -> Prepared:
        """Bring the input into the shape the map walks (default: as it is)."""
        return prepared

    def finalize(self, ctx: ReadContext, prepared: Prepared) -> None:
        """Rules that are no single concept's, after the groups (default: none)."""

    def finish(self, translation: Translation[TorshConfig], prepared: Prepared) -> Translation[TorshConfig]:
        """Restate the result or its notes for the user (default: as they are)."""
        return translation

    # ---- writing ----------------------------------------------------------------------------------

    def write(self, cfg: TorshConfig, *, version: str | None = None) -> Translation[Any]:
        """Write the core model in this dialect: the reverse of the map, plus each group's writer."""
        version = self.check_version(version)
        return write_mapping(cfg, dialect=self.NAME, field_map=self.write_map(version), value_maps=self.VALUE_MAPS,
                             finalize=lambda ctx: self.finish_write(ctx, version), version=version)  # fmt: skip

    def write_map(self, version: str | None) -> FieldMap:
        """The map written from (a family dialect may pick one per version)."""
        return self.field_map

    def finish_write(self, ctx: WriteContext, version: str | None) -> None:
        """Settle what the reverse map cannot (default: nothing)."""

    def sniff(self, raw: Any) -> float:
        """How sure it is that ``raw`` is this dialect: 0 (not) to 1 (certainly)."""
        return 0.0

    # ---- the module shape the registry expects ------------------------------------------------------

    def exports(self) -> dict[str, Any]:
        """The module-level names of a dialect module (``NAME``, ``read``, ``write``, ``sniff``, the maps)."""
        return {"NAME": self.NAME, "VERSIONS": self.VERSIONS, "DEFAULT_FORMAT": self.DEFAULT_FORMAT,
                "FIELD_MAP": self.FIELD_MAP, "VALUE_MAPS": self.VALUE_MAPS, "ALIASES": self.ALIASES,
                "READS_RELATIVE_PATHS": self.READS_RELATIVE_PATHS, "DIALECT": self,
                "read": self.read, "write": self.write, "sniff": self.sniff}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# what holds whatever the dialect


def without_schema_key(raw: Any) -> tuple[Any, list[Note]]:
    """A top-level ``"$schema"`` (an editor's pointer to a JSON Schema) is allowed in every dialect: taken out before
    the dialect reads the file, with an ignored note."""
    if not isinstance(raw, dict) or SCHEMA_KEY not in raw:
        return raw, []
    rest = {k: v for k, v in raw.items() if k != SCHEMA_KEY}
    return rest, [Note(SCHEMA_KEY, None, raw[SCHEMA_KEY], Fidelity.IGNORED, "a JSON Schema reference for editors; "
                       "no effect on training")]  # fmt: skip


def check_text_keys(raw: Any) -> None:
    """Every mapping key is text, as in any JSON, YAML or TOML config file (a dict built in Python may hold others,
    which no dialect names); a ConfigError names the first offending path."""
    stack: list[tuple[str, Any]] = [("", raw)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if not isinstance(key, str):
                    raise ConfigError([Problem(path or "<document>", key, f"keys must be text, not "
                                               f"{type(key).__name__}; write the key as a string")])  # fmt: skip
                stack.append((f"{path}.{key}" if path else key, value))
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", value) for i, value in enumerate(node))


def read(module: Any, raw: Any, *, version: str | None = None, base_dir: str | Path | None = None,
         cross_checks: Callable[[Translation[TorshConfig]], list[Note]] | None = None
         ) -> Translation[TorshConfig]:  # fmt: skip
    """The one read pipeline: the dialect module's stages, wrapped in what holds for every dialect.

    ``module`` is a dialect module (or a plugin's) with ``read``; ``cross_checks`` adds the notes about what the
    engine cannot honour whatever the dialect.
    """
    check_text_keys(raw)
    raw, schema_notes = without_schema_key(raw)
    if getattr(module, "READS_RELATIVE_PATHS", False):
        translation = module.read(raw, version=version, base_dir=base_dir)
    else:
        translation = module.read(raw, version=version)
    translation.notes[:0] = schema_notes
    if cross_checks is not None:
        translation.notes.extend(cross_checks(translation))
    return translation
