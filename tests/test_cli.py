"""torsh-migrate: exit codes, reports, no tracebacks for user errors, no torch, no silent overwrite."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from torsh.cli import main

SEED = Path(__file__).resolve().parent.parent / "migration_examples" / "torsh" / "torsh_config.toml"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """torsh-migrate in a fresh interpreter, the way a user runs it."""
    return subprocess.run([sys.executable, "-m", "torsh.cli", *args], capture_output=True, text=True, timeout=60)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``main(args)`` in this process: its exit code and the text it writes to stdout and stderr, as ``run_cli``
    gives them (a user error is an exit code and a message, never an exception; one escaping fails the test)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: a usage error, --help, --version
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return subprocess.CompletedProcess(["torsh-migrate", *args], code, out.getvalue(), err.getvalue())


def test_version_and_help():
    out = run_cli("--version")
    assert out.returncode == 0 and "torsh-migrate" in out.stdout
    helped = run_cli("--help")
    assert helped.returncode == 0 and "convert" in helped.stdout and "validate" in helped.stdout


def test_convert_to_file_with_report_and_no_overwrite(tmp_path):
    out = tmp_path / "job.toml"
    first = cli("convert", str(SEED), "--to", "torsh", "-o", str(out))
    assert first.returncode == 0, first.stderr
    assert "distributed.rank" in first.stdout and "ignored" in first.stdout  # the report
    assert "[batch]" in out.read_text()
    out.write_text("keep me")
    second = cli("convert", str(SEED), "--to", "torsh", "-o", str(out))
    assert second.returncode == 2 and "--force" in second.stderr and out.read_text() == "keep me"
    third = cli("convert", str(SEED), "--to", "torsh", "-o", str(out), "--force")
    assert third.returncode == 0 and "[batch]" in out.read_text()


def test_convert_json_report_and_yaml_output(tmp_path):
    done = cli("convert", str(SEED), "--to", "torsh", "--format", "yaml", "--report", "json")
    assert done.returncode == 0
    assert "micro_batch_size: 32" in done.stdout
    first = json.loads(done.stderr)["read"]  # one JSON document: the read and the write report
    assert first["source"] == "torsh" and first["counts"]["ignored"] == 1


def test_strict_fails_on_lossy(tmp_path):
    lossy = tmp_path / "c.yaml"
    lossy.write_text("ddp: {gradient_compression: true}\n")
    assert cli("convert", str(lossy), "--to", "torsh").returncode == 0
    strict = cli("convert", str(lossy), "--to", "torsh", "--strict")
    assert strict.returncode == 1 and "ddp.gradient_compression" in strict.stderr


@pytest.mark.parametrize(("content", "name", "needle"), [
    ('{"batch": {"micro_batch_size": 4,}', "bad.json", "not valid JSON"),
    ("sharding:\n  stage: [1\n", "bad.yaml", "not valid YAML"),
    ("[sharding\nstage=1", "bad.toml", "not valid TOML"),
    ('{"sharding": {"stages": 2}}', "unknown.json", "did you mean 'stage'"),
    ('{"sharding": {"stage": 2, "stage": 3}}', "dup.json", "duplicate key"),
    ("[distributed]\nbackend = 'gloo'\n", "wrong.json", "not valid JSON"),
    ("just a string", "scalar.yaml", "not a mapping"),
])  # fmt: skip
def test_bad_input_exit_2_without_traceback(tmp_path, content, name, needle):
    path = tmp_path / name
    path.write_text(content)
    for command in (["validate", str(path)], ["convert", str(path), "--to", "torsh"]):
        done = cli(*command)
        assert done.returncode == 2, done
        assert "Traceback" not in done.stderr
        assert needle in done.stderr and name in done.stderr


def test_missing_file_and_unknown_dialect():
    missing = cli("validate", "does-not-exist.json")
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
    dialect = cli("convert", str(SEED), "--to", "deepsped")
    assert dialect.returncode == 2 and "unknown dialect" in dialect.stderr
    schema = cli("schema", "torsch")
    assert schema.returncode == 2 and "did you mean 'torsh'" in schema.stderr


def test_schema_prints_json():
    done = cli("schema", "torsh")
    assert done.returncode == 0 and json.loads(done.stdout)["title"] == "TorshConfig"


def test_validate_reports_keys():
    done = cli("validate", str(SEED))
    assert done.returncode == 0 and "OK:" in done.stdout and "training.epochs" in done.stdout


def test_convert_never_imports_torch():
    code = (
        "import sys, contextlib, io\n"
        "from torsh.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        f"    rc = main(['convert', {str(SEED)!r}, '--to', 'torsh'])\n"
        "import torsh.config, torsh.adapters\n"
        "assert rc == 0, rc\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'fairscale', 'horovod'))\n"
        "print(heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_reading_a_valid_deepspeed_dict_or_a_torsh_file_imports_no_parser_or_validator_it_does_not_need():
    code = (
        "import sys, contextlib, io\n"
        "from torsh import adapters\n"
        "from torsh.cli import main\n"
        "def loaded(*names): return sorted(m for m in sys.modules if m.split('.')[0] in names)\n"
        "adapters.load({'train_micro_batch_size_per_gpu': 2, 'zero_optimization': {'stage': 2, 'overlap_comm': True},"
        " 'bf16': {'enabled': True}, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-4}}})\n"
        "print(loaded('jsonschema', 'referencing', 'rpds', 'attrs', 'tomllib', 'tomli', 'yaml', 'hjson', 'rich',"
        " 'tomli_w', 'difflib'))\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        f"    rc = main(['convert', {str(SEED)!r}, '--to', 'torsh'])\n"
        "assert rc == 0, rc\n"
        "print(loaded('jsonschema', 'referencing', 'rpds', 'attrs', 'yaml', 'hjson', 'rich', 'tomli_w'))\n"
    )  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "[]"]


def test_main_returns_exit_code(capsys):
    assert main(["validate", str(SEED)]) == 0
    assert main(["validate", "nope.toml"]) == 2


def test_toml_output_reports_each_null_it_leaves_out(tmp_path, capsys):
    """TOML has no null: a null kept from a torchtune file is left out of a TOML file and reported as dropped (not
    exact); YAML output keeps it."""
    src = Path(__file__).parent / "fixtures" / "corpus" / "torchtune" / "pytorch__torchtune__dev__3B_full_grpo.yaml"
    assert main(["convert", str(src), "--to", "torsh", "-o", str(tmp_path / "c.toml"), "--report", "json"]) == 0
    notes = {n["source_path"]: n for n in json.loads(capsys.readouterr().out)["write"]["notes"]}
    left_out = notes["extensions.torchtune.tokenizer.max_seq_len"]
    assert (left_out["fidelity"], left_out["target_path"]) == ("dropped", None)
    assert "max_seq_len" not in (tmp_path / "c.toml").read_text()
    assert main(["convert", str(src), "--to", "torsh", "-o", str(tmp_path / "c.yaml"), "--report", "json"]) == 0
    notes = {n["source_path"]: n for n in json.loads(capsys.readouterr().out)["write"]["notes"]}
    assert notes["extensions.torchtune.tokenizer.max_seq_len"]["fidelity"] == "exact"
    assert "max_seq_len: null" in (tmp_path / "c.yaml").read_text()
