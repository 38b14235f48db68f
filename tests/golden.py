"""Golden files: one way to compare and to regenerate them (``make goldens``)."""

from __future__ import annotations

import os
from pathlib import Path

UPDATE = os.environ.get("TORSH_UPDATE_GOLDENS") == "1"
HOW = "if the change is intended, regenerate with `make goldens` and review the diff"


def check_golden(path: Path, text: str) -> None:
    """``text`` must equal the golden file at ``path`` (rewritten instead under TORSH_UPDATE_GOLDENS=1)."""
    if UPDATE:
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"{path.name} is missing; {HOW}"
    assert text == path.read_text(encoding="utf-8"), f"{path.name} differs from the generated output; {HOW}"
