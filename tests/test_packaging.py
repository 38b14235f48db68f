"""What a user installs: clear errors without PyTorch, and the wheel's and sdist's contents."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: Runs a snippet in a fresh interpreter that cannot import torch (as in an environment without the extra).
NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def _run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH + code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("code, what", [
    ("import torsh; torsh.initialize", "torsh.initialize"),
    ("from torsh import Engine", "torsh.Engine"),
    ("import torsh.horovod", "torsh.horovod"),
])  # fmt: skip
def test_missing_torch_names_the_extra(code, what):
    result = _run_without_torch(code)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"ModuleNotFoundError: {what} needs PyTorch: pip install 'torsh-distributed[engine]'", result.stderr


def test_missing_torch_error_is_still_an_import_error():
    result = _run_without_torch(
        "import torsh\n"
        "try:\n    torsh.initialize\nexcept ImportError as exc:\n    print(exc.name)\n"
        "import torsh.config, torsh.adapters\nprint('config ok')\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["torch", "config", "ok"]
