"""The one error type for user mistakes, and the helpers that build its messages.

Every problem names the dotted path of the offending key, the value found there, the reason, and - for
unknown keys - the closest known spelling. Several problems are collected and raised together, so a user
fixes a file in one pass instead of one key per run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

#: How many problems a message lists before it says "... and N more".
MAX_LISTED = 20


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a user's input."""

    path: str
    """Dotted key path inside the input (``zero_optimization.stage``); empty for the document itself."""
    value: Any
    """The offending value as the user wrote it (``MISSING`` when a required key is absent)."""
    reason: str
    """What is wrong and what to do about it."""
    suggestion: str | None = None
    """For an unknown key: the closest valid spelling."""
    line: int | None = None
    """For a syntax error: the 1-based line of the input where the parser stopped (None: not a syntax error)."""
    column: int | None = None
    """For a syntax error: the 1-based column on ``line``."""

    def __str__(self) -> str:
        where = self.path or ("<document>" if self.line is None else f"line {self.line}, column {self.column}")
        text = f"{where}: {self.reason}"
        if self.value is not MISSING:
            text += f" (got {_short(self.value)})"
        if self.suggestion:
            text += f"; did you mean '{self.suggestion}'?"
        return text


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"

    def __reduce__(self) -> str:
        return "MISSING"  # pickled by name: the one sentinel after unpickling too (``value is MISSING`` holds)


MISSING: Any = _Missing()


class ConfigError(ValueError):
    """A user's configuration (or command line) is wrong; carries every problem found.

    Subclasses ValueError so code that guards with ``except ValueError`` keeps working.
    """

    def __init__(self, problems: Sequence[Problem], *, source: str | None = None):
        if not problems:
            raise ValueError("ConfigError needs at least one problem")
        self.problems = list(problems)
        self.source = source
        super().__init__(self._message())

    def __reduce__(self):
        # Rebuilt from its problems (the default would call ConfigError(message), one problem per character):
        # the error crosses process boundaries (multiprocessing pools, spawned ranks) unchanged.
        return (_rebuild_config_error, (type(self), self.problems, self.source), dict(self.__dict__))

    def _message(self) -> str:
        head = f"{self.source}: " if self.source else ""
        if len(self.problems) == 1:
            only = self.problems[0]
            if self.source and only.line is not None and not only.path:  # file:line:column, as compilers print it
                return f"{self.source}:{only.line}:{only.column}: {only.reason}"
            return head + str(only)
        lines = [f"{head}{len(self.problems)} problems:"]
        lines += [f"  - {p}" for p in self.problems[:MAX_LISTED]]
        if len(self.problems) > MAX_LISTED:
            lines.append(f"  ... and {len(self.problems) - MAX_LISTED} more")
        return "\n".join(lines)

    def with_source(self, source: str) -> ConfigError:
        """The same problems, attributed to a file or dialect (for messages in the user's terms)."""
        return ConfigError(self.problems, source=source)

    def with_prefix(self, prefix: str) -> ConfigError:
        """The same problems with ``prefix.`` put in front of every path."""
        return ConfigError(
            [replace(p, path=_join(prefix, p.path)) for p in self.problems],
            source=self.source,
        )


def _rebuild_config_error(cls: type, problems: list, source: str | None) -> ConfigError:
    return cls(problems, source=source)


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to a misspelt ``name``, or None when nothing is close."""
    candidates = [str(c) for c in candidates]  # keys of a YAML file may be numbers
    name = str(name)
    lowered = {c.lower(): c for c in candidates}
    if name.lower() in lowered:
        return lowered[name.lower()]
    import difflib  # here: only a misspelling needs it, and every torsh-migrate call imports this module

    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key(path: str, value: Any, known: Iterable[str], what: str = "key") -> Problem:
    """The problem for a key nobody reads, with a did-you-mean when one is close."""
    leaf = str(path).rsplit(".", 1)[-1]
    return Problem(
        path,
        value,
        f"unknown {what} '{leaf}': remove it or fix its spelling",
        did_you_mean(leaf, known),
    )


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
