"""What a user installs: clear errors without PyTorch, and the wheel's and sdist's contents."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

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


# ---- the built distributions ------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
#: Modules that only work in a source checkout (setup.py keeps them out of the wheel).
CHECKOUT_ONLY = {"torsh/demo.py", "torsh/schemas/__main__.py", "torsh/schemas/_generate_deepspeed.py",
                 "torsh/schemas/_generate_accelerate_keys.py", "torsh/schemas/_generate_torchtitan_keys.py",
                 "torsh/schemas/_generate_torchtune_keys.py"}
#: Not source: what building, testing and virtualenvs leave in a checkout.
LEFTOVERS = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                   ".hypothesis", "*.pyc", "out")  # fmt: skip


def _tracked_files() -> list[str] | None:
    """The checkout's files as git knows them (tracked and new, not ignored); None outside a git checkout."""
    try:
        result = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                                text=True, timeout=60, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return [f for f in result.stdout.splitlines() if (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """The wheel and the sdist, built from a copy of the source tree (the build writes into its tree)."""
    tmp = tmp_path_factory.mktemp("dists")
    src, out = tmp / "src", tmp / "dist"
    files = _tracked_files()
    if files is None:
        shutil.copytree(ROOT, src, ignore=LEFTOVERS)
    else:
        for name in files:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    for hook in ("build_sdist", "build_wheel"):  # one process each: setuptools keeps state between builds
        code = f"import sys; from setuptools import build_meta; build_meta.{hook}(sys.argv[1])"
        result = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True,
                                timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel, "tracked": files}


def _wheel_names(dists) -> list[str]:
    with zipfile.ZipFile(dists["wheel"]) as z:
        return z.namelist()


def test_wheel_has_the_package_types_schemas_and_license_and_no_tests(dists):
    names = set(_wheel_names(dists))
    assert "torsh/py.typed" in names
    assert "torsh/__main__.py" in names and "torsh/cli/__init__.py" in names
    schemas = {f"torsh/schemas/{p.name}" for p in (ROOT / "schemas").glob("*.schema.json")}
    assert len(schemas) >= 9 and schemas <= names
    assert "torsh_distributed-0.1.0.dist-info/licenses/LICENSE" in names
    tops = {n.split("/")[0] for n in names}
    assert tops == {"torsh", "torsh_distributed-0.1.0.dist-info"}, tops  # no tests, examples or benchmarks
    assert not any("/tests/" in n or n.startswith("tests/") for n in names)


def test_wheel_leaves_out_checkout_only_modules(dists):
    names = set(_wheel_names(dists))
    assert not CHECKOUT_ONLY & names
    for name in CHECKOUT_ONLY:  # they exist in the source; the build drops them
        package_dir = {"torsh/schemas/": "schemas/", "torsh/": "core/"}
        prefix = next(p for p in package_dir if name.startswith(p))
        assert (ROOT / (package_dir[prefix] + name[len(prefix):])).is_file(), name


def test_wheel_metadata_license_and_extras_as_ranges(dists):
    with zipfile.ZipFile(dists["wheel"]) as z:
        metadata = z.read("torsh_distributed-0.1.0.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    assert not any(line.startswith("Classifier: License ::") for line in metadata.splitlines())
    extras = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" in line]
    frameworks = [line for line in extras if re.search(r"Requires-Dist: (torch|deepspeed|fairscale)\b", line)]
    assert len(frameworks) >= 5
    for line in frameworks:  # a tested upper bound and no exact pin: an extra must not replace a user's install
        requirement = line.split(";")[0]
        assert "<" in requirement and "==" not in requirement, line
    assert 'torch<2.14,>=2.6; extra == "engine"' in metadata


def test_the_tested_versions_satisfy_every_extra(dists):
    # requirements-dev.txt pins what the suite runs with; each extra's range must admit it, so that installing an
    # extra next to the tested versions (a CPU torch installed first, say) replaces nothing.
    from importlib import metadata as md

    from packaging.requirements import Requirement  # a dependency of DeepSpeed and pip

    with zipfile.ZipFile(dists["wheel"]) as z:
        text = z.read("torsh_distributed-0.1.0.dist-info/METADATA").decode()
    checked = 0
    for line in text.splitlines():
        if not (line.startswith("Requires-Dist:") and "extra ==" in line):
            continue
        requirement = Requirement(line.removeprefix("Requires-Dist:").strip())
        try:
            installed = md.version(requirement.name)
        except md.PackageNotFoundError:
            continue
        assert requirement.specifier.contains(installed, prereleases=True), (line, installed)
        checked += 1
    assert checked >= 8


def test_sdist_is_the_whole_source_tree_so_its_tests_run(dists):
    with tarfile.open(dists["sdist"]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for needed in ("LICENSE", "pyproject.toml", "setup.py", "requirements-dev.txt", "Makefile", "tests/conftest.py",
                   "core/py.typed", "migration_examples", "benchmarks", "docs", "tests/fixtures/corpus"):
        assert needed in names, needed
    if dists["tracked"] is not None:
        missing = sorted(set(dists["tracked"]) - names)
        assert not missing, f"tracked files missing from the sdist (MANIFEST.in): {missing}"
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


def test_python_dash_m_torsh_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "torsh", "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torsh-migrate 0.1.0"


def test_every_package_of_the_source_tree_is_listed_for_the_wheel():
    """A subpackage missing from pyproject's list is left out of the wheel: its imports fail only when installed."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(("torsh", *p.parent.relative_to(root / "core").parts))
             for p in (root / "core").rglob("__init__.py")}
    assert found - listed == set()
