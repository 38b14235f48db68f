"""The readers and the config model keep a shape one can read: no module of the package (core/, its engine
included) or of the adapters is over 1,000 lines, and the split modules keep their public import paths."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_module_in_core_or_adapters_is_over_1000_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for folder in ("core", "adapters") for p in (ROOT / folder).rglob("*.py")}  # fmt: skip
    assert len(sizes) > 50
    assert {name: n for name, n in sizes.items() if n > 1000} == {}


def test_split_modules_keep_their_import_paths():
    """torsh.config re-exports every section model and shared type of the modules it was split into; the launch
    dialect and the tests take the plan and the command types from _launch_writers; the Accelerate adapter keeps its
    maps (fsdp_plugin reads FSDP_MAP from it)."""
    import torsh.config
    from torsh import config_base, config_job, config_training
    from torsh.adapters import _launch_writers, accelerate

    for module in (config_base, config_job, config_training):
        public = [n for n, v in vars(module).items() if not n.startswith("_") and getattr(v, "__module__", "") ==
                  module.__name__]  # fmt: skip
        assert public and all(getattr(torsh.config, n) is getattr(module, n) for n in public), module.__name__
    for name in ("plan", "LaunchCommand", "NodeCommand", "Plan", "WRITERS", "SCHEDULERS", "worker_environments"):
        assert hasattr(_launch_writers, name), name
    for name in ("TOP_MAP", "FSDP_MAP", "DS_MAP", "FIELD_MAP", "ALIASES", "DIALECT", "read", "write"):
        assert hasattr(accelerate, name), name
