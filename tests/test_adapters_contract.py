"""Every registered dialect has the same shape and all its parts (sqlglot's registry sync test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torsh import adapters, schemas
from torsh.config import TorshConfig
from torsh.errors import ConfigError
from torsh.translate import FieldMap, Translation

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", adapters.names())
def test_dialect_has_every_part(name):
    module = adapters.get(name)
    missing = [a for a in adapters.REQUIRED_ATTRIBUTES if not hasattr(module, a)]
    assert not missing, f"adapters/{name}.py lacks {missing}"
    assert module.NAME == name
    owner = getattr(module, "ALIAS_OF", name)  # fsdp1/fsdp2 select a generation of the fsdp dialect
    assert owner in adapters.names()
    assert owner in schemas.available(), f"schemas/{owner}.schema.json is missing"
    assert list((ROOT / "tests").glob(f"test_{owner}*.py")), f"tests/test_{owner}*.py is missing"
    assert (ROOT / "migration_examples" / owner).is_dir(), f"migration_examples/{owner}/ is missing"


@pytest.mark.parametrize("name", adapters.names())
def test_reverse_map_is_one_to_one(name):
    """Writing derives the reverse of FIELD_MAP: one source key per core field (per sub-dialect, for dialects
    such as ``launch`` whose map is sectioned by tool)."""
    module = adapters.get(name)
    namespaces = getattr(module, "WRITE_TARGETS", ())
    fmap = module.FIELD_MAP
    groups = [{k: v for k, v in fmap.items() if k.split(".")[0] == ns} for ns in namespaces] or [fmap]
    for group in groups:
        FieldMap(group).reverse()  # raises on two writable entries for one core field


@pytest.mark.parametrize("name", adapters.names())
def test_write_default_config(name):
    """Writing the default config gives a result, or a clear error when the dialect needs more (a script)."""
    try:
        written = adapters.get(name).write(TorshConfig())
    except ConfigError as exc:
        assert exc.problems[0].reason
    else:
        assert isinstance(written, Translation)


def test_sniff_rejects_unknown_content():
    with pytest.raises(ConfigError, match="cannot tell which dialect"):
        adapters.sniff({"nothing": "known"})


def test_unknown_dialect_suggests():
    with pytest.raises(ConfigError) as exc:
        adapters.get("torch")
    assert exc.value.problems[0].suggestion == "torsh"


def test_reading_reports_compression_the_engine_cannot_run_at_fsdp_stages():
    """Every dialect's read carries the engine's compression rules (the same rules initialize enforces)."""
    for stage, expected in ((1, None), (3, "unsupported")):
        read = adapters.read({"sharding": {"stage": stage}, "compression": {"method": "topk", "ratio": 0.01}},
                             "torsh")  # fmt: skip
        found = [n for n in read.notes if n.source_path == "compression.method" and n.lossy]
        assert (found[0].fidelity.value if found else None) == expected
