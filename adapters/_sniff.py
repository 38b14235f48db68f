"""Recognising a dialect's file by its shape: the sections and keys the dialect is known by, with a confidence.

Each dialect declares what its files look like as data, one :class:`Shape` per layout, and its ``sniff`` is the best
confidence among them (:func:`best`). A file must show the shape's anchors (a torchtitan job config: ``[job]`` or
``[parallelism]``, and ``[job]``, ``[model]`` or ``[training]``); each of its keys is then one the dialect knows or a
foreign one. A few foreign keys (a section a newer version added, a fork's own key) lower the confidence without
zeroing it, so the file is still read by its dialect, whose reader names each foreign key where it is; a file made
mostly of keys the dialect does not know is not that dialect's. The confidence of a file with no foreign key is the
shape's ``ceiling``: it orders the dialects that claim the same file (a torchtitan job config over the FSDP dialect's
transcription of its ``[parallelism]`` section).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

#: Foreign keys a file may hold and still be recognised, however few keys it shares with the dialect.
FEW = 3
#: A file with more than this many foreign keys per known one (and more than a few) is another framework's file
#: that happens to share a key or a section name with the dialect (a trainer's YAML with a [model] section).
MOSTLY = 2
#: How far the share of foreign keys lowers the confidence: a file of foreign keys only would be at half the ceiling.
WEIGHT = 0.5


def confidence(ceiling: float, known: int, foreign: int, lenient: bool = False) -> float:
    """How sure a shape is of a file holding ``known`` keys it knows and ``foreign`` ones it does not.

    ``ceiling`` when nothing is foreign, lowered by the share of foreign keys; 0 when the file is mostly foreign keys,
    unless ``lenient`` (the framework ignores keys it does not know, so its files carry other programs' keys).
    """
    if not lenient and foreign > max(FEW, MOSTLY * known):
        return 0.0
    return ceiling * (1 - WEIGHT * foreign / max(known + foreign, 1))


def _is_pattern(entry: str) -> bool:
    return any(c in entry for c in "*?[")


@dataclass(frozen=True)
class Shape:
    """One layout of a dialect's files, as data.

    Keys are dotted paths (``parallelism.tp``). A key names a section to look into when the vocabulary holds keys
    under it; any other mapping is one opaque value. Entries may be ``fnmatch`` patterns (``HOROVOD_*``,
    ``parallelism.*``).
    """

    ceiling: float
    """The confidence for a file with no foreign key."""
    anchors: tuple[Iterable[str], ...]
    """The distinctive shape: the file holds at least one key of each group."""
    vocabulary: Iterable[str] = ()
    """Every other key the dialect knows (the anchors are known too)."""
    tables: Iterable[str] = ()
    """Anchors that count only when they hold a mapping (DeepSpeed's ``fp16`` section; the Trainer's is a boolean)."""
    excludes: Iterable[str] = ()
    """Keys of another dialect's shape: a file holding one is not of this layout."""
    where: Callable[[Mapping[str, Any]], bool] | None = None
    """What keys cannot say (a torchtune recipe names a ``_component_``), for the few layouts that need it."""
    lenient: bool = False
    """The framework ignores the keys it does not know (DeepSpeed's top level: GPT-NeoX keeps its own keys beside
    DeepSpeed's in one file): any number of foreign keys lowers the confidence without zeroing it."""
    _names: frozenset[str] = field(init=False, repr=False, compare=False)
    _patterns: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _sections: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        groups = tuple(map(frozenset, self.anchors))
        entries = set(map(str, self.vocabulary)).union(*groups)
        patterns = set(filter(_is_pattern, entries))
        for name, value in (("anchors", groups), ("tables", frozenset(self.tables)),
                            ("excludes", frozenset(self.excludes)), ("_names", frozenset(entries - patterns)),
                            ("_patterns", tuple(sorted(patterns))), ("_sections", _sections_of(entries))):  # fmt: skip
            object.__setattr__(self, name, value)

    def knows(self, path: str) -> bool:
        """Whether ``path`` is a key of this layout (a section the vocabulary names keys under is one)."""
        return path in self._names or path in self._sections or any(fnmatchcase(path, p) for p in self._patterns)

    def keys(self, raw: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
        """Every key of ``raw`` with its value, dotted, looking into the sections the vocabulary names keys under."""
        for key, value in raw.items():
            path = f"{prefix}{key}"
            yield path, value
            if isinstance(value, Mapping) and path in self._sections:
                yield from self.keys(value, path + ".")

    def confidence(self, raw: Any) -> float:
        """0 when ``raw`` does not show the anchors, else how sure this layout is (see :func:`confidence`)."""
        if not isinstance(raw, Mapping) or not raw:
            return 0.0
        found = dict(self.keys(raw))
        if not self._fits(raw, found):
            return 0.0
        known = sum(map(self.knows, found))
        return confidence(self.ceiling, known, len(found) - known, self.lenient)

    def _fits(self, raw: Mapping[str, Any], found: dict[str, Any]) -> bool:
        """Each group of anchors shows, no excluded key does, and ``where`` holds."""
        present = [p for p, v in found.items() if p not in self.tables or isinstance(v, Mapping)]
        anchored = all(any(fnmatchcase(p, a) for p in present for a in group) for group in self.anchors)
        return anchored and not self.excludes & found.keys() and (self.where is None or self.where(raw))


def _sections_of(entries: Iterable[str]) -> frozenset[str]:
    """The sections dotted keys are in (``quantize.linear`` for ``quantize.linear.float8``)."""
    return frozenset(e.rsplit(".", 1)[0] for e in entries if "." in e)


def best(shapes: Iterable[Shape], raw: Any) -> float:
    """A dialect's ``sniff``: the confidence of the layout that fits ``raw`` best (0 when none does)."""
    return max((shape.confidence(raw) for shape in shapes), default=0.0)


def top_keys(paths: Iterable[str]) -> frozenset[str]:
    """The top-level keys of dotted paths (a key map's sources)."""
    return frozenset(str(p).split(".")[0] for p in paths)
