"""``convert --to torsh`` writes only what differs from the defaults; ``--full`` writes everything; both read back
to the same config."""

from __future__ import annotations

from pathlib import Path

import pytest

from torsh import adapters
from torsh.cli import main
from torsh.errors import ConfigError
from torsh.formats import _drop_none, dump_text, parse_text

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "migration_examples").rglob("*")
                  if p.suffix in (".json", ".yaml", ".toml") and ".expected" not in p.name)  # fmt: skip
SKIP = {"launch", "refused"}  # launch lines and hostfiles are not configs; refused files are refused on purpose
CORPUS = sorted(p for p in (ROOT / "tests" / "fixtures" / "corpus").rglob("*")
                if p.suffix in (".json", ".yaml", ".yml", ".toml") and p.parent.name not in SKIP)  # fmt: skip
SAMPLE = CORPUS[::5]  # every fifth file, across every dialect directory


def _through_toml(data: dict) -> object:
    return adapters.read(parse_text(dump_text(data, "toml"), "toml"), "torsh").result


@pytest.mark.parametrize("path", EXAMPLES + SAMPLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_minimal_and_full_native_files_read_back_to_the_same_config(path):
    try:
        original = adapters.load(path).result
    except ConfigError:
        pytest.skip("not a config torsh reads (covered by the reader's own tests)")
    writer = adapters.get("torsh")
    minimal = writer.write(original, full=False).result
    full = writer.write(original).result
    # TOML has no null: a null kept from another dialect's file (torchtune's `max_seq_len: null`) is left out of it.
    expected = original.model_copy(update={"extensions": _drop_none(original.extensions)})
    assert _through_toml(minimal) == _through_toml(full) == expected
    assert len(dump_text(minimal, "toml")) <= len(dump_text(full, "toml"))


def test_defaults_config_writes_an_empty_minimal_file():
    from torsh.config import TorshConfig

    assert adapters.get("torsh").write(TorshConfig(), full=False).result == {}


def test_convert_writes_the_differences_unless_full(tmp_path, capsys):
    source = ROOT / "migration_examples" / "deepspeed" / "train_config.json"
    small, big = tmp_path / "small.toml", tmp_path / "big.toml"
    assert main(["convert", str(source), "--to", "torsh", "-o", str(small)]) == 0
    assert main(["convert", str(source), "--to", "torsh", "--full", "-o", str(big)]) == 0
    capsys.readouterr()
    assert len(small.read_text().splitlines()) * 2 < len(big.read_text().splitlines())
    assert "[checkpoint]" not in small.read_text() and "[checkpoint]" in big.read_text()
    assert adapters.load(small).result == adapters.load(big).result == adapters.load(source).result


def test_full_with_another_dialect_is_a_clear_error(capsys):
    source = ROOT / "migration_examples" / "deepspeed" / "train_config.json"
    assert main(["convert", str(source), "--to", "deepspeed", "--full"]) == 2
    assert "--full: applies to --to torsh only" in capsys.readouterr().err
