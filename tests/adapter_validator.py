"""The one test helper every adapter test uses (sqlglot's validate_identity / validate_all).

* ``assert_accounted(raw, translation)``: every leaf of the input is the source of a note (or lies under one).
* ``validate_identity(dialect, raw)``: read then write gives back the input (after ``normalise``).
* ``validate_all(core, write={dialect: expected})``: one core config written to many dialects; ``expected`` is
  the payload (a subset that must match, with no lossy note) or ``Lossy({core_path: fidelity})`` - the lossy
  cells of the conversion matrix are asserted, not hoped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torsh import adapters
from torsh.config import TorshConfig, get_path, iter_leaves
from torsh.translate import Fidelity, Translation


def assert_accounted(raw: Mapping[str, Any], translation: Translation[Any]) -> None:
    """Every leaf of ``raw`` has a note on itself or on one of its ancestors."""
    sources = {n.source_path for n in translation.notes}
    missing = []
    for path, _ in iter_leaves(dict(raw)):
        parts = path.split(".")
        if not any(".".join(parts[:i]) in sources for i in range(1, len(parts) + 1)):
            missing.append(path)
    assert not missing, f"keys with no note: {missing}"


def assert_subset(expected: Any, actual: Any, path: str = "") -> None:
    """Every key of ``expected`` is in ``actual`` with an equal value (recursively for dicts)."""
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{path or '<root>'}: expected a mapping, got {actual!r}"
        for key, value in expected.items():
            assert key in actual, f"{path}.{key}: missing (have {sorted(actual)})"
            assert_subset(value, actual[key], f"{path}.{key}" if path else str(key))
    else:
        assert expected == actual, f"{path}: expected {expected!r}, got {actual!r}"


def validate_identity(dialect: str, raw: Mapping[str, Any], *, normalise: Callable[[Any], Any] = lambda x: x,
                      expect_lossless: bool = True) -> Translation[TorshConfig]:  # fmt: skip
    """Read ``raw`` in ``dialect``, write it back, and compare with the input."""
    read = adapters.read(dict(raw), dialect)
    assert_accounted(raw, read)
    written = adapters.write(read.result, dialect)
    if expect_lossless:
        assert not read.lossy, [str(n) for n in read.lossy]
    assert normalise(written.result) == normalise(dict(raw)), (
        f"round trip changed the config:\n  in:  {normalise(dict(raw))}\n  out: {normalise(written.result)}"
    )
    return read


@dataclass
class Lossy:
    """An expected lossy cell: core path -> the fidelity its note must have; optionally a payload subset."""

    fidelities: dict[str, Fidelity | str]
    payload: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def validate_all(core: TorshConfig | Mapping[str, Any], *, write: Mapping[str, Any],
                 read_back: bool = True) -> dict[str, Translation[Any]]:  # fmt: skip
    """Write one core config to each dialect and check the expected payload or lossy notes."""
    cfg = core if isinstance(core, TorshConfig) else TorshConfig.from_dict(dict(core))
    results = {}
    for dialect, expected in write.items():
        written = adapters.write(cfg, dialect)
        results[dialect] = written
        if isinstance(expected, Lossy):
            for core_path, fidelity in expected.fidelities.items():
                fidelity = Fidelity(fidelity)
                found = [n for n in written.notes if n.source_path == core_path]
                assert found, f"{dialect}: no note for {core_path}; notes: {[str(n) for n in written.notes]}"
                assert any(n.fidelity is fidelity for n in found), (
                    f"{dialect}: {core_path} is {[n.fidelity.value for n in found]}, expected {fidelity.value}")
            if expected.payload is not None:
                assert_subset(expected.payload, written.result)
        else:
            assert not written.lossy, f"{dialect}: unexpected lossy notes {[str(n) for n in written.lossy]}"
            assert_subset(expected, written.result)
            if read_back and isinstance(written.result, Mapping):
                back = adapters.read(dict(written.result), dialect).result
                for path, value in iter_leaves(cfg.model_dump(exclude={"extensions"})):
                    if path.startswith(("launch.", "monitoring.")):
                        continue
                    assert get_path(back.model_dump(), path) == value, (
                        f"{dialect}: {path} changed on the way back: {value!r} -> {get_path(back.model_dump(), path)!r}")
    return results
