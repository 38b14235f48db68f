"""The code stays readable in small pieces: few functions are complex (radon's cyclomatic complexity grade C or
worse, i.e. over 10). What differs between dialects belongs in tables that small generic code walks, as sqlglot's
dialects do, and the engine's steps stay short; a block over the line is named here so it can be split along the
concept it mixes, not cut into arbitrary pieces."""

from __future__ import annotations

from pathlib import Path

import pytest

cc = pytest.importorskip("radon.complexity", reason="radon is not installed (requirements-dev.txt pins it)")

ROOT = Path(__file__).resolve().parent.parent

#: Source tree -> the largest share of its blocks (functions, methods, classes) graded C or worse.
LIMITS = {"adapters": 0.06, "core/engine": 0.03}


def _blocks(tree: str) -> list[tuple[str, object]]:
    """Every block radon grades in the tree, recursively (functions, classes and their methods, as ``radon cc``
    lists them), with the file it is in."""
    found = []
    for path in sorted((ROOT / tree).glob("**/*.py")):
        found += [(str(path.relative_to(ROOT)), block) for block in cc.cc_visit(path.read_text(encoding="utf-8"))]
    return found


@pytest.mark.parametrize("tree", sorted(LIMITS))
def test_few_blocks_are_complex(tree):
    blocks = _blocks(tree)
    assert blocks, f"no Python blocks found under {tree}"
    complex_ = sorted(((block.complexity, file, block.fullname) for file, block in blocks
                       if cc.cc_rank(block.complexity) >= "C"), reverse=True)  # fmt: skip
    share = len(complex_) / len(blocks)
    offenders = "\n".join(f"  {grade:3d} {cc.cc_rank(grade)}  {file}: {name}" for grade, file, name in complex_)
    assert share <= LIMITS[tree], (
        f"{tree}: {len(complex_)} of {len(blocks)} blocks ({share:.1%}) are complexity C or worse; the limit is "
        f"{LIMITS[tree]:.0%}. Put what differs in a table a small function walks, or split along a concept:\n"
        f"{offenders}")


#: Lines a module of adapters/ may hold: a dialect is a difference from the core model, mostly tables; a module past
#: this holds a concept the core model or a shared reader step is missing.
ADAPTER_MODULE_LINES = 750


def test_adapter_modules_stay_short():
    lengths = {path.name: len(path.read_text(encoding="utf-8").splitlines())
               for path in sorted((ROOT / "adapters").glob("*.py"))}  # fmt: skip
    assert lengths, "no adapter modules found"
    long = {name: n for name, n in lengths.items() if n > ADAPTER_MODULE_LINES}
    assert not long, f"adapter modules over {ADAPTER_MODULE_LINES} lines: {long}"


def test_no_adapter_block_is_graded_e_or_worse():
    """A block over complexity 30 is several concepts in one place, whatever the share of C blocks."""
    worst = [(block.complexity, file, block.fullname) for file, block in _blocks("adapters")
             if cc.cc_rank(block.complexity) >= "E"]  # fmt: skip
    assert not worst, worst
