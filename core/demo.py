"""The main job (``make run``): convert every config in ``migration_examples/`` and print its report.

Run from a checkout: ``python -m torsh.demo [DIR]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torsh import adapters
from torsh.errors import ConfigError
from torsh.formats import format_for

EXAMPLES = Path(__file__).resolve().parent.parent / "migration_examples"


def convert_examples(root: Path = EXAMPLES) -> int:
    """Read every example config (sniffing its dialect) and print its translation report; returns failures."""
    from torsh.cli._common import print_report

    failures = 0
    files = sorted(p for p in root.rglob("*") if format_for(p) and ".expected" not in p.name)
    for path in files:
        try:
            translation = adapters.load(path)
        except ConfigError as exc:
            print(f"FAILED {path.relative_to(root)}: {exc}")
            failures += 1
            continue
        print_report(translation, "table", sys.stdout, title=f"{path.relative_to(root)} ({translation.source})")
    print(f"\n{len(files) - failures}/{len(files)} example configs converted")
    return failures


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else EXAMPLES
    return 1 if convert_examples(root) else 0


if __name__ == "__main__":
    sys.exit(main())
