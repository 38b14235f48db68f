"""Editor and CI integration: the JSON Schemas agree with the CLI on the whole corpus, and the pre-commit hook
runs ``torsh-migrate validate --strict`` on the files it should."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from test_accelerate_corpus import REFUSED as ACCELERATE_REFUSED
from test_deepspeed_corpus import REFUSED as DEEPSPEED_REFUSED
from torsh import schemas
from torsh.cli import build_parser, main
from torsh.formats import format_for, load_file
from torsh.translate import LOSSY

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "fixtures" / "corpus"
#: Every config file of the corpus (hostfiles and the launch command lines are read by `launch`, not `validate`).
#: The folders of dialects whose whole corpus torsh reads (the newer folders hold dialects still to come); files
#: refused on purpose (the REFUSED lists of the corpus tests) are left out.
READ_FOLDERS = {"deepspeed", "deepspeed_config_templates", "accelerate", "fsdp"}
FILES = sorted(p for p in CORPUS.rglob("*") if p.is_file() and format_for(p) and p.parent.name in READ_FOLDERS
               and p.name not in {*ACCELERATE_REFUSED, *DEEPSPEED_REFUSED})
LOSSY_VALUES = {f.value for f in LOSSY}


def validate(path: Path, *options: str) -> tuple[int, dict | str]:
    """``torsh-migrate validate --report json``: (exit code, the report or the error text)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["validate", "--report", "json", *options, str(path)])
    (result,) = json.loads(out.getvalue())["files"]
    return code, result["report"] if code == 0 else "\n".join(e["message"] for e in result["errors"])


def schema_error_paths(data: object, dialect: str) -> set[str]:
    """Dotted paths of everything the dialect's JSON Schema (as an editor applies it) rejects in ``data``."""
    paths = set()
    for error in jsonschema.Draft202012Validator(schemas.load(dialect)).iter_errors(data):
        where = [str(p) for p in error.absolute_path]
        if error.validator == "additionalProperties":  # one path per unexpected key
            paths |= {".".join([*where, key]) for key in set(error.instance) - set(error.schema.get("properties", {}))}
        else:
            paths.add(".".join(where))
    return paths


def test_the_corpus_is_covered():
    assert len(FILES) >= 60
    assert {p.parent.name for p in FILES} >= {"deepspeed", "accelerate", "fsdp"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.stem[:50]}")
def test_what_the_cli_accepts_the_schema_accepts_or_the_report_flags(path):
    # An editor's schema check and `validate --strict` agree: a file the CLI reads either satisfies its dialect's
    # schema, or every schema complaint is a key the CLI reports as lost (so --strict fails on it too).
    code, report = validate(path)
    assert code == 0, report
    assert schemas.load(report["source"]) is not None
    lossy = {n["source_path"] for n in report["notes"] if n["fidelity"] in LOSSY_VALUES}
    unreported = schema_error_paths(load_file(path)[0], report["source"]) - lossy
    assert not unreported, f"the {report['source']} schema rejects {sorted(unreported)}; the CLI accepts them silently"


BROKEN = [[None]]  # a shape no schema property of these dialects allows


def _mutations() -> list[tuple[Path, str, str]]:
    """(file, dialect, key): per corpus file, its first top-level key whose value the schema types."""
    from torsh import adapters

    found = []
    for path in FILES:
        data = load_file(path)[0]
        dialect = adapters.sniff(data)
        validator = jsonschema.Draft202012Validator(schemas.load(dialect))
        key = next((k for k in data if not validator.is_valid({**data, k: BROKEN})), None)
        if key is not None:  # (the HF-trainer FSDP keys are read by the adapter but untyped in the schema)
            found.append((path, dialect, key))
    return found


MUTATIONS = _mutations()


def test_most_corpus_files_have_a_key_the_schema_types():
    assert len(MUTATIONS) >= 55


@pytest.mark.parametrize("path, dialect, key", MUTATIONS, ids=lambda v: v.stem[:50] if isinstance(v, Path) else "")
def test_a_value_the_schema_rejects_the_cli_rejects(path, dialect, key, tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**load_file(path)[0], key: BROKEN}))
    code, error = validate(broken, "--from", dialect)
    assert code == 2 and key in error, error


# ---- pre-commit -------------------------------------------------------------------------------------------------


def hooks() -> list[dict]:
    return yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text(encoding="utf-8"))


def test_pre_commit_hook_runs_validate_strict_on_config_files():
    (hook,) = hooks()
    assert hook["id"] == "torsh-validate" and hook["language"] == "python"
    assert hook["entry"] == "torsh-migrate validate --strict"
    files = re.compile(hook["files"])
    for name in ("ds_config.json", "configs/ds_config_zero3.json", "deepspeed/zero2.json", "accelerate_config.yaml",
                 "configs/fsdp.yml", "torsh.toml", "train/Horovod.yaml", "zero3_offload.hjson"):  # fmt: skip
        assert files.search(name), name
    for name in ("package.json", ".github/workflows/ci.yml", "pyproject.toml", "ds_config.py", "docs/index.md"):
        assert not files.search(name), name
    # what the hook is meant for, by name: the corpus files named like configs
    assert sum(bool(files.search(p.relative_to(CORPUS).as_posix())) for p in FILES) >= 40


def _validate_takes_strict_and_several_files() -> bool:
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            build_parser().parse_args(["validate", "--strict", "a.json", "b.json"])
    except SystemExit:
        return False
    return True


def test_pre_commit_hook_entry_as_pre_commit_calls_it(tmp_path):
    if not _validate_takes_strict_and_several_files():
        pytest.skip("this build's `validate` does not take --strict and several files yet (the hook needs both)")
    (hook,) = hooks()
    good = [CORPUS / "deepspeed" / "huggingface__transformers__ds_config_zero2.json",
            CORPUS / "accelerate" / "huggingface__accelerate__multi_gpu.yaml"]  # fmt: skip
    bad = tmp_path / "ds_config.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": "three"}}')
    argv = [sys.executable, "-m", "torsh", *hook["entry"].split()[1:]]
    ran = subprocess.run([*argv, *map(str, good)], capture_output=True, text=True, timeout=120)
    assert ran.returncode in (0, 1), ran.stderr  # 1: a key the strict check reports as lost
    failed = subprocess.run([*argv, str(good[0]), str(bad)], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 2 and "zero_optimization.stage" in failed.stderr
