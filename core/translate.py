"""Translation machinery shared by every dialect adapter: notes, reports, error levels and the map driver.

An adapter is mostly data: ``FIELD_MAP`` (dotted source path -> core path or a status), ``VALUE_MAPS``
(per source path, source value -> core value) and ``ALIASES`` (legacy spelling -> current spelling). The
driver here walks the input, applies the map, and accounts for every key in a :class:`Note`; the reverse
direction is derived from the same map. Hooks cover what a map cannot say.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

from pydantic import ValidationError

from .config import NO_NUMERICAL_EFFECT, TorshConfig, get_path, iter_leaves, set_path, validation_to_config_error
from .deferred import AUTO, Deferred, is_deferred
from .errors import ConfigError, Problem, did_you_mean, unknown_key

T = TypeVar("T")


class Fidelity(str, Enum):
    """How faithfully one key was carried across."""

    EXACT = "exact"
    """Same meaning, same numerics."""
    APPROXIMATE = "approximate"
    """Same intent; numerics, memory or ordering differ (the reason says how)."""
    DEFAULTED = "defaulted"
    """Absent in the input; the dialect's own default was made explicit."""
    DEFERRED = "deferred"
    """``"auto"``: resolved later by ``torsh.initialize``."""
    UNSUPPORTED = "unsupported"
    """The target cannot express it; the behaviour changes."""
    DROPPED = "dropped"
    """Not carried over (removed upstream, or meaningless in the target)."""
    IGNORED = "ignored"
    """No effect on training (logging, performance knobs); kept in ``extensions`` where possible."""


LOSSY = frozenset({Fidelity.APPROXIMATE, Fidelity.UNSUPPORTED, Fidelity.DROPPED})


class ErrorLevel(str, Enum):
    """What happens to lossy notes (sqlglot's error levels)."""

    IGNORE = "ignore"
    """Return them in the report only."""
    WARN = "warn"
    """Also emit one warning listing them (the CLI default)."""
    RAISE = "raise"
    """Collect them all, then raise :class:`LossyTranslationError` (``--strict``)."""
    IMMEDIATE = "immediate"
    """Raise at the first lossy note."""


@dataclass(frozen=True)
class Note:
    """What happened to one key."""

    source_path: str
    """Dotted path in the source (a core path when writing)."""
    target_path: str | None
    """Dotted path in the target, or None when nothing was written."""
    value: Any
    """The source value."""
    fidelity: Fidelity
    """How faithfully it was carried across."""
    reason: str = ""
    """Why, in the user's terms."""
    refused: bool = False
    """The source's own framework refuses the input as written unless its caller fills this value in (a DeepSpeed
    config with no batch size): counted as lossy, so ``--strict`` fails on it, whatever the fidelity."""

    @property
    def lossy(self) -> bool:
        return self.fidelity in LOSSY or self.refused

    def to_dict(self) -> dict[str, Any]:
        return {
            "source_path": self.source_path,
            "target_path": self.target_path,
            "value": _jsonable(self.value),
            "fidelity": self.fidelity.value,
            "reason": self.reason,
            "refused": self.refused,
        }

    def __str__(self) -> str:
        arrow = f" -> {self.target_path}" if self.target_path else ""
        return f"{self.source_path}{arrow}: {self.fidelity.value}" + (f" ({self.reason})" if self.reason else "")


class LossyTranslationError(Exception):
    """Raised under ErrorLevel.RAISE / IMMEDIATE when a translation loses meaning."""

    def __init__(self, notes: list[Note], source: str, target: str):
        self.notes = notes
        listed = "\n".join(f"  - {n}" for n in notes[:20])
        more = f"\n  ... and {len(notes) - 20} more" if len(notes) > 20 else ""
        super().__init__(f"{source} -> {target}: {len(notes)} lossy key(s):\n{listed}{more}")


@dataclass
class Translation(Generic[T]):
    """The result of a read or write, and a note for every key."""

    result: T
    """The translated configuration (a TorshConfig when reading, a dialect payload when writing)."""
    notes: list[Note]
    """One note per source key."""
    source: str
    """Source dialect."""
    target: str
    """Target dialect."""

    @property
    def lossy(self) -> list[Note]:
        return [n for n in self.notes if n.lossy]

    def counts(self) -> dict[str, int]:
        """Number of notes per fidelity, in the enum's order."""
        return {f.value: sum(n.fidelity is f for n in self.notes) for f in Fidelity}

    def check(self, level: ErrorLevel | str = ErrorLevel.WARN) -> Translation[T]:
        """Apply an error level to the lossy notes; returns self when nothing is raised."""
        level = ErrorLevel(level)
        lossy = self.lossy
        if not lossy or level is ErrorLevel.IGNORE:
            return self
        if level is ErrorLevel.IMMEDIATE:
            raise LossyTranslationError(lossy[:1], self.source, self.target)
        if level is ErrorLevel.RAISE:
            raise LossyTranslationError(lossy, self.source, self.target)
        warnings.warn(str(LossyTranslationError(lossy, self.source, self.target)), stacklevel=2)
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "target": self.target,
            "counts": self.counts(),
            "notes": [n.to_dict() for n in self.notes],
        }


# --------------------------------------------------------------------------------------------------
# map rules

NOTHING: Any = type("Nothing", (), {"__repr__": lambda self: "NOTHING"})()


@dataclass(frozen=True)
class To:
    """Map a source key to a core path."""

    path: str
    """Dotted core path."""
    fidelity: Fidelity = Fidelity.EXACT
    """EXACT or APPROXIMATE."""
    reason: str = ""
    """Why it is approximate (or anything the user should know)."""
    default: Any = NOTHING
    """The dialect's own default, made explicit (DEFAULTED) when the key is absent and its parent present."""
    write: bool = True
    """Part of the derived reverse map (False for a second spelling of the same core field)."""


@dataclass(frozen=True)
class Status:
    """A key with no core field: ignored, dropped or unsupported, with the reason."""

    fidelity: Fidelity
    reason: str
    keep: bool = True
    """Keep the value in ``extensions[dialect]`` so writing back to the same dialect restores it."""


def Ignored(reason: str, keep: bool = True) -> Status:  # noqa: N802 - reads as a map value
    """No effect on training; kept for round trips."""
    return Status(Fidelity.IGNORED, reason, keep)


def Dropped(reason: str, keep: bool = False) -> Status:  # noqa: N802
    """Not carried over (e.g. removed upstream)."""
    return Status(Fidelity.DROPPED, reason, keep)


def Unsupported(reason: str, keep: bool = True) -> Status:  # noqa: N802
    """Has a meaning the core model / engine cannot reproduce."""
    return Status(Fidelity.UNSUPPORTED, reason, keep)


@dataclass(frozen=True)
class Hook:
    """Code for what a map cannot say. ``read(value, ctx, path)``; ``write(cfg, ctx)``."""

    read: Callable[[Any, ReadContext, str], None] | None = None
    write: Callable[[TorshConfig, WriteContext], None] | None = None
    claims: tuple[str, ...] = ()
    """Core paths (prefixes) the write hook handles, excluded from the derived reverse pass."""


@dataclass(frozen=True)
class Group:
    """One concept read and written in one place: the source keys it reads, the core paths it sets, both directions.

    A key listed in ``keys`` (canonical spelling; ``*`` matches one level) is not mapped alone: the walk records it,
    and once every key of the file has been seen ``read(seen)`` decides the group's core values from all of them
    together (:class:`Seen` notes each key once, and makes the dialect's defaults explicit). ``write(cfg, ctx)``
    writes the group's keys back; the core paths in ``targets`` are then left out of the derived reverse map.
    Groups run in the order the dialect lists them, so one may read what an earlier one set.
    """

    name: str
    """What the concept is (precision, offload, optimizer...): shown when a recorded key is left unhandled."""
    keys: tuple[str, ...]
    """Source keys, canonical dotted spelling."""
    targets: tuple[str, ...] = ()
    """Core paths (prefixes) the group sets and its writer writes."""
    read: Callable[[Seen], None] | None = None
    write: Callable[[TorshConfig, WriteContext], None] | None = None


Rule = str | To | Status | Hook | Group


def _as_rule(rule: Rule) -> To | Status | Hook | Group:
    return To(rule) if isinstance(rule, str) else rule


@dataclass(frozen=True)
class Alias:
    """A legacy spelling and the version of the dialect that changed it."""

    current: str
    """The current dotted spelling."""
    since: str = ""
    """Version that introduced the current spelling (or deprecated the old)."""


# --------------------------------------------------------------------------------------------------
# reading


@dataclass
class ReadContext:
    """State of one read: the core dict being built, notes, problems, and where each core value came from."""

    dialect: str
    raw: Mapping[str, Any]
    value_maps: Mapping[str, Mapping[Any, Any]] = field(default_factory=dict)
    deferred_sources: Mapping[str, str] = field(default_factory=dict)
    core: dict[str, Any] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    origin: dict[str, str] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    """The dialect's own scratch values for this read (what one key's hook tells a later rule)."""
    recorded: dict[str, tuple[str, Any]] = field(default_factory=dict)
    """Keys of a :class:`Group`: canonical spelling -> (spelling in the file, value), until the group reads them."""

    def set(self, core_path: str, value: Any, source_path: str, fidelity: Fidelity = Fidelity.EXACT,
            reason: str = "", *, note: bool = True) -> None:  # fmt: skip
        """Set a core value from a source key and note it; ``"auto"`` becomes AUTO with a DEFERRED note."""
        if is_deferred(value):
            value, fidelity = AUTO, Fidelity.DEFERRED
            reason = self.deferred_sources.get(core_path) or reason or "resolved by torsh.initialize"
        previous = get_path(self.core, core_path, NOTHING)
        if previous is not NOTHING and previous != value and self.origin.get(core_path) != source_path:
            self.problem(source_path, value, f"conflicts with {self.origin.get(core_path)}={previous!r} "
                         f"(both set {core_path}); keep one")  # fmt: skip
            return
        set_path(self.core, core_path, value)
        self.origin.setdefault(core_path, source_path)
        if note:
            self.note(source_path, fidelity, reason, value, core_path)

    def keep(self, source_path: str, value: Any) -> None:
        """Store a key with no core meaning in ``extensions[dialect]`` for round trips."""
        self.core.setdefault("extensions", {}).setdefault(self.dialect, {})[source_path] = value

    def note(self, source_path: str, fidelity: Fidelity, reason: str = "", value: Any = None,
             target_path: str | None = None) -> None:  # fmt: skip
        self.notes.append(Note(source_path, target_path, value, fidelity, reason))

    def problem(self, source_path: str, value: Any, reason: str, suggestion: str | None = None) -> None:
        self.problems.append(Problem(source_path, value, reason, suggestion))

    def map_value(self, key: str, value: Any, source_path: str | None = None) -> Any:
        """Apply ``VALUE_MAPS[key]``; an unmapped value becomes a problem (returns NOTHING)."""
        table = self.value_maps.get(key)
        if table is None or is_deferred(value):
            return value
        for candidate, mapped in table.items():
            if _same(candidate, value):
                return mapped
        allowed = ", ".join(repr(k) for k in table)
        self.problem(source_path or key, value, f"unknown value; expected one of {allowed}",
                     did_you_mean(str(value), [str(k) for k in table]))  # fmt: skip
        return NOTHING


class Seen:
    """The keys recorded for the groups of one read, with helpers that note each key exactly once.

    ``default_reason`` words a DEFAULTED note (the dialect's default made explicit); ``deferrable(core_path)`` says
    whether ``"auto"`` may stay deferred at a core path (else the dialect's default is used and the key kept).
    """

    def __init__(self, ctx: ReadContext, default_reason: str | None = None,
                 deferrable: Callable[[str], bool] = lambda core_path: True):  # fmt: skip
        self.ctx = ctx
        self.items = ctx.recorded
        self.default_reason = default_reason or f"not set; {ctx.dialect} default"
        self.deferrable = deferrable

    def section(self, prefix: str) -> dict[str, tuple[str, Any]]:
        """The recorded keys under ``prefix``, by their name below it."""
        return {k[len(prefix) + 1:]: v for k, v in self.items.items() if k.startswith(prefix + ".")}

    def has(self, key: str) -> bool:
        return key in self.items

    def value(self, key: str, default: Any = None) -> Any:
        """The value, or ``default`` when absent or ``"auto"``."""
        if key not in self.items:
            return default
        value = self.items[key][1]
        return default if is_deferred(value) else value

    def set(self, key: str, core: str, value: Any, fidelity: Fidelity = Fidelity.EXACT, reason: str = "",
            *, default: Any = None) -> None:  # fmt: skip
        """Set a core value from a recorded key, or from the dialect's default (DEFAULTED) when absent."""
        if key in self.items:
            path, raw = self.items.pop(key)
            if is_deferred(raw) and not self.deferrable(core):
                self.ctx.keep(key, raw)
                self.ctx.set(core, value, path, note=False)
                self.ctx.note(path, Fidelity.DEFERRED, f"filled by HF Trainer/Accelerate; {self.ctx.dialect} alone "
                              f"uses {value!r}", raw, core)  # fmt: skip
                return
            self.ctx.set(core, raw if is_deferred(raw) else value, path, fidelity, reason)
        else:
            self.ctx.set(core, value if default is None else default, key, Fidelity.DEFAULTED,
                         reason or self.default_reason)  # fmt: skip

    def take(self, key: str) -> tuple[str, Any] | None:
        """Remove a recorded key and return (spelling in the file, value); the caller notes it."""
        return self.items.pop(key, None)

    def inert(self, key: str, reason: str) -> None:
        """A recorded key with no effect in this configuration: kept for round trips, noted as ignored."""
        if key in self.items:
            path, raw = self.items.pop(key)
            self.ctx.keep(key, raw)
            self.ctx.note(path, Fidelity.IGNORED, reason, raw)

    def drop(self, key: str, reason: str, fidelity: Fidelity = Fidelity.DROPPED) -> None:
        """A recorded key that is not carried over."""
        if key in self.items:
            path, raw = self.items.pop(key)
            self.ctx.note(path, fidelity, reason, raw)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    return type(a) is type(b) and a == b


class FieldMap:
    """A compiled FIELD_MAP: exact and wildcard (``*``) lookups, children of a prefix, derived reverse map."""

    def __init__(self, field_map: Mapping[str, Rule], aliases: Mapping[str, str | Alias] | None = None,
                 groups: tuple[Group, ...] = ()):  # fmt: skip
        self.rules = {k: _as_rule(v) for k, v in field_map.items()}
        self.groups = tuple(groups)
        for group in self.groups:
            for key in group.keys:
                if key in self.rules:
                    raise ValueError(f"{key} is in the field map and in group {group.name}: give it one rule")
                self.rules[key] = group
        self.aliases = {k: v if isinstance(v, Alias) else Alias(v) for k, v in (aliases or {}).items()}
        self._patterns = [(tuple(k.split(".")), r) for k, r in self.rules.items() if "*" in k]

    def lookup(self, path: str) -> To | Status | Hook | None:
        if path in self.rules:
            return self.rules[path]
        parts = tuple(path.split("."))
        for pattern, rule in self._patterns:
            if len(pattern) == len(parts) and all(p in ("*", q) for p, q in zip(pattern, parts, strict=True)):
                return rule
        return None

    def has_children(self, path: str) -> bool:
        parts = path.split(".")
        n = len(parts)
        for key in list(self.rules) + list(self.aliases):
            kp = key.split(".")
            if len(kp) > n and all(a in ("*", b) for a, b in zip(kp[:n], parts, strict=True)):
                return True
        return False

    def children(self, prefix: str) -> list[str]:
        """Known key names directly under ``prefix`` (for did-you-mean)."""
        n = len(prefix.split(".")) if prefix else 0
        names = set()
        for key in list(self.rules) + list(self.aliases):
            kp = key.split(".")
            if len(kp) > n and (not prefix or ".".join(kp[:n]) == prefix) and kp[n] != "*":
                names.add(kp[n])
        return sorted(names)

    def reverse(self) -> dict[str, tuple[str, To]]:
        """core path -> (source path, rule) for every writable To rule."""
        out: dict[str, tuple[str, To]] = {}
        for source, rule in self.rules.items():
            if isinstance(rule, To) and rule.write and "*" not in source:
                if rule.path in out:
                    raise ValueError(f"two writable map entries for {rule.path}: {out[rule.path][0]} and {source}")
                out[rule.path] = (source, rule)
        return out


def read_mapping(raw: Mapping[str, Any], *, dialect: str, field_map: FieldMap,
                 value_maps: Mapping[str, Mapping[Any, Any]] | None = None,
                 deferred_sources: Mapping[str, str] | None = None,
                 finalize: Callable[[ReadContext], None] | None = None) -> Translation[TorshConfig]:  # fmt: skip
    """Translate a dialect mapping into a TorshConfig; every key ends in exactly one note.

    Raises ConfigError with every unknown key, bad value and core-model violation, in source-dialect paths.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError([Problem("", raw, f"a {dialect} config must be a mapping of keys to values")])
    ctx = ReadContext(dialect, raw, value_maps or {}, deferred_sources or {})
    _walk(raw, "", "", ctx, field_map)
    _apply_defaults(raw, ctx, field_map)
    if not ctx.problems:
        _read_groups(ctx, field_map.groups)
    if finalize is not None and not ctx.problems:
        finalize(ctx)
    if ctx.problems:
        raise ConfigError(ctx.problems, source=dialect)
    try:
        cfg = TorshConfig.model_validate(ctx.core)
    except ValidationError as exc:
        raise _in_source_terms(validation_to_config_error(exc, TorshConfig), ctx) from None
    return Translation(cfg, ctx.notes, dialect, "torsh")


def _walk(node: Mapping[str, Any], actual: str, canonical: str, ctx: ReadContext, fmap: FieldMap) -> None:
    for key, value in node.items():
        key = str(key)
        path = f"{actual}.{key}" if actual else key
        canon = f"{canonical}.{key}" if canonical else key
        alias = fmap.aliases.get(canon)
        if alias is not None:
            canon = alias.current
        rule = fmap.lookup(canon)
        if rule is None and isinstance(value, Mapping) and fmap.has_children(canon):
            _walk(value, path, canon, ctx, fmap)
        elif rule is None:
            ctx.problems.append(unknown_key(path, value, fmap.children(canonical)))
        else:
            _apply(rule, value, path, canon, ctx, alias)


def _read_groups(ctx: ReadContext, groups: tuple[Group, ...]) -> None:
    seen = Seen(ctx)
    for group in groups:
        if group.read is not None:
            group.read(seen)
    left = [] if ctx.problems else [key for key in ctx.recorded if any(key in g.keys or _matches(key, g.keys)
                                                                      for g in groups)]  # fmt: skip
    if left:  # a key a group listed but did not note: a defect in the dialect, not in the user's file
        raise AssertionError(f"{ctx.dialect}: recorded key(s) {', '.join(left)} were not handled by their group")


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    parts = key.split(".")
    return any(len(p.split(".")) == len(parts) and all(a in ("*", b) for a, b in zip(p.split("."), parts, strict=True))
               for p in patterns)  # fmt: skip


def _apply(rule: To | Status | Hook | Group, value: Any, path: str, canon: str, ctx: ReadContext,
           alias: Alias | None):  # fmt: skip
    legacy = f"legacy spelling of {alias.current}" + (f" (since {alias.since})" if alias.since else "") if alias else ""
    if isinstance(rule, Group):
        ctx.recorded[canon] = (path, value)
    elif isinstance(rule, Hook):
        if rule.read is None:
            raise AssertionError(f"hook for {canon} has no read function")
        rule.read(value, ctx, path)
    elif isinstance(rule, Status):
        if rule.keep:
            ctx.keep(path, value)
        ctx.note(path, rule.fidelity, _join_reason(rule.reason, legacy), value)
    else:
        mapped = ctx.map_value(canon, value, path)
        if mapped is not NOTHING:
            ctx.set(rule.path, mapped, path, rule.fidelity, _join_reason(rule.reason, legacy))


def _apply_defaults(raw: Mapping[str, Any], ctx: ReadContext, fmap: FieldMap) -> None:
    seen = {_canonical(p, fmap) for p, _ in iter_leaves(_plain(raw))} | set(_all_prefixes(raw, fmap))
    for source, rule in fmap.rules.items():
        if not isinstance(rule, To) or rule.default is NOTHING or source in seen:
            continue
        parent = source.rsplit(".", 1)[0] if "." in source else ""
        if parent and parent not in seen:
            continue
        ctx.set(rule.path, rule.default, source, Fidelity.DEFAULTED, f"not set; {ctx.dialect} default")


def _plain(raw: Any) -> Any:
    return {str(k): _plain(v) for k, v in raw.items()} if isinstance(raw, Mapping) else raw


def _all_prefixes(raw: Mapping[str, Any], fmap: FieldMap, prefix: str = "") -> list[str]:
    out = []
    for key, value in raw.items():
        path = _canonical(f"{prefix}.{key}" if prefix else str(key), fmap)
        out.append(path)
        if isinstance(value, Mapping):
            out += _all_prefixes(value, fmap, path)
    return out


def _canonical(path: str, fmap: FieldMap) -> str:
    parts = path.split(".")
    out = ""
    for part in parts:
        out = f"{out}.{part}" if out else part
        if out in fmap.aliases:
            out = fmap.aliases[out].current
    return out


def _in_source_terms(error: ConfigError, ctx: ReadContext) -> ConfigError:
    """Restate core-model violations at the source keys that produced them."""
    problems = []
    for p in error.problems:
        source = ctx.origin.get(p.path) or next(
            (src for core, src in ctx.origin.items() if core.startswith(p.path + ".") or p.path.startswith(core + ".")),
            None,
        )
        reason = p.reason if source is None else f"{p.reason} [core {p.path}]"
        problems.append(Problem(source or p.path, p.value, reason, p.suggestion))
    return ConfigError(problems, source=ctx.dialect)


def _join_reason(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


# --------------------------------------------------------------------------------------------------
# writing


@dataclass
class WriteContext:
    """State of one write: the dialect payload being built and notes."""

    dialect: str
    cfg: TorshConfig
    out: dict[str, Any] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
    version: str | None = None
    """The dialect version (or generation) being written."""

    def put(self, target_path: str, value: Any, core_path: str, fidelity: Fidelity = Fidelity.EXACT,
            reason: str = "") -> None:  # fmt: skip
        """Write a dialect value and note where it came from; AUTO is written as ``"auto"``."""
        if isinstance(value, Deferred):
            value, fidelity = "auto", Fidelity.DEFERRED
            reason = reason or "still \"auto\": the consumer must resolve it"
        set_path(self.out, target_path, value)
        self.notes.append(Note(core_path, target_path, value, fidelity, reason))

    def note(self, core_path: str, fidelity: Fidelity, reason: str, value: Any = None) -> None:
        self.notes.append(Note(core_path, None, value, fidelity, reason))


def holds_auto(value: Any) -> bool:
    """True when a written value is or contains ``"auto"`` (a mesh shape, a mapping of settings)."""
    if is_deferred(value):
        return True
    if isinstance(value, Mapping):
        return any(holds_auto(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_auto(v) for v in value)
    return False


def settle_auto(ctx: WriteContext, who: Mapping[str, str] | None = None, *, keep: tuple[str, ...] = ()) -> None:
    """Take ``"auto"`` out of a payload whose consumer does not accept it.

    Each written key holding ``"auto"`` (outside the ``keep`` prefixes, where the consumer fills it itself) is
    left out, so the consumer's own default applies until the script or launcher sets it; its note becomes a
    DEFERRED one without a target that says who must set the value (``who``: core path prefix -> text).
    """
    who = who or {}
    notes = []
    for note in ctx.notes:
        path = note.target_path
        if path and not path.startswith(keep) and holds_auto(get_path(ctx.out, path, None)):
            delete_path(ctx.out, path)
            hint = next((text for prefix, text in who.items() if note.source_path.startswith(prefix)),
                        "the script or the launcher must set it")  # fmt: skip
            note = Note(note.source_path, None, AUTO, Fidelity.DEFERRED, f"\"auto\" is not accepted by "
                        f"{ctx.dialect}: not written; {hint}")  # fmt: skip
        notes.append(note)
    ctx.notes[:] = notes


def delete_path(data: dict, path: str, *, keep_top_level: bool = False) -> None:
    """Delete a dotted key and the sections it leaves empty (but a top-level section with ``keep_top_level``:
    where its mere presence means "use this feature")."""
    parts = path.split(".")
    chain = [data]
    for part in parts[:-1]:
        chain.append(chain[-1][part])
    del chain[-1][parts[-1]]
    emptied = list(zip(reversed(chain[:-1]), reversed(parts[:-1]), strict=True))
    for node, part in emptied[:-1] if keep_top_level else emptied:
        if node[part] == {}:
            del node[part]


def write_mapping(cfg: TorshConfig, *, dialect: str, field_map: FieldMap,
                  value_maps: Mapping[str, Mapping[Any, Any]] | None = None,
                  finalize: Callable[[WriteContext], None] | None = None,
                  version: str | None = None) -> Translation[dict]:  # fmt: skip
    """Write a TorshConfig in a dialect using the reverse of its field map.

    Hooks write what the map cannot; every non-default core value with no dialect key becomes an
    UNSUPPORTED note; the dialect's own extensions are restored, other dialects' are DROPPED notes.
    """
    ctx = WriteContext(dialect, cfg, version=version)
    claimed: list[str] = []
    for group in field_map.groups:
        if group.write is not None:
            group.write(cfg, ctx)
        claimed += group.targets
    for rule in field_map.rules.values():
        if isinstance(rule, Hook) and rule.write is not None:
            rule.write(cfg, ctx)
            claimed += rule.claims
    reverse = field_map.reverse()
    defaults = _default_leaves()
    for core_path, value in iter_leaves(cfg.model_dump(exclude={"extensions"})):
        if any(core_path == c or core_path.startswith(c + ".") for c in claimed):
            continue
        default = defaults.get(core_path, NOTHING)
        if value is None and default is NOTHING:
            continue  # a field left unset inside a section the default model does not have
        if core_path in reverse:
            source, rule = reverse[core_path]
            if _equal(value, default) and (rule.default is NOTHING or _equal(rule.default, value)):
                continue
            ctx.put(source, _unmap(value_maps or {}, source, value), core_path, rule.fidelity, rule.reason)
        elif core_path.startswith(NO_NUMERICAL_EFFECT) and not _equal(value, default):
            ctx.note(core_path, Fidelity.IGNORED, f"{dialect} has no setting for this; it sizes collectives or "
                     "groups modules, no numerical effect", value)  # fmt: skip
        elif not _equal(value, default) and not (value in (None, {}, []) and default is NOTHING):
            ctx.note(core_path, Fidelity.UNSUPPORTED, f"{dialect} has no setting for this", value)
    _restore_extensions(cfg, ctx)
    if finalize is not None:
        finalize(ctx)
    return Translation(ctx.out, ctx.notes, "torsh", dialect)


def _restore_extensions(cfg: TorshConfig, ctx: WriteContext) -> None:
    for dialect, keys in cfg.extensions.items():
        for source_path, value in keys.items():
            if dialect == ctx.dialect:
                if get_path(ctx.out, source_path, NOTHING) is NOTHING:
                    ctx.put(source_path, value, f"extensions.{dialect}.{source_path}", Fidelity.EXACT,
                            "kept from the source file")  # fmt: skip
            else:
                ctx.note(f"extensions.{dialect}.{source_path}", Fidelity.DROPPED,
                         f"a {dialect} setting with no {ctx.dialect} meaning", value)  # fmt: skip


_DEFAULTS: dict[str, Any] | None = None


def _default_leaves() -> dict[str, Any]:
    global _DEFAULTS
    if _DEFAULTS is None:
        _DEFAULTS = dict(iter_leaves(TorshConfig().model_dump(exclude={"extensions"})))
    return _DEFAULTS


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                            and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def _unmap(value_maps: Mapping[str, Mapping[Any, Any]], source: str, value: Any) -> Any:
    table = value_maps.get(source)
    if not table or isinstance(value, Deferred):
        return value
    for src, core in table.items():
        if _equal(core, value):
            return src
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, Deferred):
        return "auto"
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def check_version(dialect: str, version: str | None, supported: tuple[str, ...]) -> str:
    """The version to translate for: ``version`` if supported, else a ConfigError naming the supported ones."""
    if version is None:
        return supported[0]
    if version not in supported:
        raise ConfigError([Problem("version", version, f"{dialect} version {version} is not supported; this "
                                   f"adapter follows {', '.join(supported)}")])  # fmt: skip
    return version
