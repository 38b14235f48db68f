import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Keep multi-process tests on CPU and quiet.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def examples() -> Path:
    return ROOT / "migration_examples"
