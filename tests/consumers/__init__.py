"""Helpers that hand a file torsh wrote to its real consumer (Accelerate, DeepSpeed, torch FSDP, launchers)."""

from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "corpus"


def converted_sources(deepspeed: int = 30, accelerate: int = 20, fsdp: int = 0) -> list[Path]:
    """Real configs of other dialects that a consumer test converts to its own (the first N of each folder)."""
    return (sorted((CORPUS / "deepspeed").glob("*.json"))[:deepspeed]
            + sorted((CORPUS / "accelerate").glob("*.yaml"))[:accelerate]
            + sorted((CORPUS / "fsdp").glob("*.json"))[:fsdp])  # fmt: skip


def load_or_skip(path: Path):
    """The core config of a corpus file, or a skip for one torsh refuses (the property test covers those)."""
    from torsh import adapters
    from torsh.errors import ConfigError

    try:
        return adapters.load(path).result
    except ConfigError:
        pytest.skip("not a config torsh reads (a ConfigError, covered by the property test)")


def without_package_init(name: str, version: str) -> None:
    """Make ``name``'s submodules importable without running its package ``__init__`` (torchtitan's imports its
    models and their GPU kernels, torchtune's requires torchao); skip when the framework is not installed."""
    import importlib.util
    import sys
    import types

    spec = importlib.util.find_spec(name)
    if spec is None:
        pytest.skip(f"{name} {version} is not installed (pip install --no-deps -r requirements-nodeps.txt)")
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec  # find_spec(name) still finds the installed package (the key-table generators)
        sys.modules[name] = package
