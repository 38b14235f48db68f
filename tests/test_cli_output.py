"""torsh-migrate's output hygiene: exit codes, closed pipes, ``-o`` files, one document per stream, plain tables."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torsh.cli import EXIT_BROKEN_PIPE, EXIT_INTERNAL, main
from torsh.cli._common import render_table

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "migration_examples" / "torsh" / "torsh_config.toml"
DS = ROOT / "tests" / "fixtures" / "corpus" / "deepspeed" / "huggingface__accelerate__zero_stage1_config.json"
ZERO3 = ROOT / "migration_examples" / "deepspeed" / "zero3_cpu_offload.json"
BOX = set("─│┃━┏┓┗┛┡┩╇╋┼├┤┬┴╭╮╰╯")


def run_cli(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    """torsh-migrate in a fresh interpreter: for what depends on the process (umask, file descriptors, pipes)."""
    kwargs.setdefault("timeout", 120)
    return subprocess.run([sys.executable, "-m", "torsh.cli", *args], capture_output=True, text=True, **kwargs)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``main(args)`` in this process, with stdout and stderr as text streams that are not a terminal: its exit code
    and output as ``run_cli`` gives them (an exception escaping ``main`` fails the test)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: a usage error
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return subprocess.CompletedProcess(["torsh-migrate", *args], code, out.getvalue(), err.getvalue())


# ---- internal errors and closed pipes


def test_internal_error_exits_3_with_one_line_and_no_traceback():
    code = ("import sys; import torsh.cli.validate as v\n"
            "def broken(args): raise RuntimeError('boom')\n"
            "v.run = broken\n"
            "from torsh.cli import main; sys.exit(main(['validate', 'x.json']))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_INTERNAL == 3
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("internal error in 'validate': RuntimeError: boom") and "please report" in lines[0]
    assert done.stdout == ""


def test_internal_error_in_process(monkeypatch, capsys):
    import torsh.cli.explain as explain

    monkeypatch.setattr(explain, "run", lambda args: {}["missing"])
    assert main(["explain", str(SEED)]) == 3
    err = capsys.readouterr().err
    assert "internal error in 'explain': KeyError" in err and "Traceback" not in err


def test_closed_pipe_exits_quietly():
    files = " ".join([str(DS)] * 40)  # far more than a pipe buffer of report lines
    script = f"{sys.executable} -m torsh.cli validate {files} | head -1; echo \"status=${{PIPESTATUS[0]}}\" >&2"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert len(done.stdout.splitlines()) == 1
    assert done.stderr.strip() == f"status={EXIT_BROKEN_PIPE}", done.stderr


# ---- -o


def test_output_onto_a_directory_is_an_error_even_with_force(tmp_path):
    for extra in ([], ["--force"]):
        done = cli("convert", str(SEED), "--to", "torsh", "-o", str(tmp_path), *extra)
        assert done.returncode == 2 and "is a directory" in done.stderr and "Traceback" not in done.stderr


def test_output_into_a_missing_directory_is_an_error(tmp_path):
    done = cli("convert", str(SEED), "--to", "torsh", "-o", str(tmp_path / "no" / "x.toml"))
    assert done.returncode == 2 and "does not exist" in done.stderr


def test_output_into_an_unwritable_directory_is_an_error(tmp_path, monkeypatch, capsys):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    assert main(["convert", str(SEED), "--to", "torsh", "-o", str(tmp_path / "x.toml")]) == 2
    err = capsys.readouterr().err
    assert "cannot create a file" in err and "Permission denied" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_output_into_a_read_only_directory_is_an_error(tmp_path):  # pragma: no cover - CI runs as a user
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    done = run_cli("convert", str(SEED), "--to", "torsh", "-o", str(locked / "x.toml"))
    assert done.returncode == 2 and "Traceback" not in done.stderr


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_output_file_honours_the_umask(tmp_path, umask, mode):
    out = tmp_path / "job.toml"
    done = run_cli("convert", str(SEED), "--to", "torsh", "-o", str(out), preexec_fn=lambda: os.umask(umask))
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(out.stat().st_mode) == mode


@pytest.mark.parametrize("mode", [0o640, 0o755, 0o600])
def test_force_keeps_an_existing_files_mode(tmp_path, mode):
    out = tmp_path / "job.toml"
    out.write_text("old")
    out.chmod(mode)
    done = cli("convert", str(SEED), "--to", "torsh", "-o", str(out), "--force")
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(out.stat().st_mode) == mode and "[batch]" in out.read_text()


def test_output_to_dev_stdout_writes_through(tmp_path):
    done = run_cli("convert", str(SEED), "--to", "torsh", "-o", "/dev/stdout")
    assert done.returncode == 0 and json.loads(done.stdout)["batch"]  # only the config: the report is on stderr
    assert "source key" in done.stderr


def test_sigterm_during_output_removes_the_temporary_file(tmp_path):
    out = tmp_path / "job.toml"
    code = ("import os, sys, time\n"
            "real = os.replace\n"
            "def slow(a, b):\n"
            "    time.sleep(60)\n"
            "    real(a, b)\n"
            "os.replace = slow\n"
            "from torsh.cli import main\n"
            f"sys.exit(main(['convert', {str(SEED)!r}, '--to', 'torsh', '-o', {str(out)!r}]))\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".job.toml.*.tmp")):
            assert time.monotonic() < deadline and child.poll() is None, "no temporary file appeared"
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        assert child.wait(30) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert list(tmp_path.iterdir()) == []


# ---- one document per stream


def test_convert_json_report_is_one_document_beside_the_converted_file():
    done = cli("convert", str(ZERO3), "--to", "deepspeed", "--report", "json")
    assert done.returncode == 0, done.stderr
    converted = json.loads(done.stdout)  # stdout: only the converted config
    assert converted["zero_optimization"]["stage"] == 3
    report = json.loads(done.stderr)  # stderr: exactly one JSON document
    assert set(report) >= {"read", "write"} and report["write"]["target"] == "deepspeed"


def test_convert_json_report_with_output_file_is_one_document_on_stdout(tmp_path):
    out = tmp_path / "ds.json"
    done = cli("convert", str(ZERO3), "--to", "deepspeed", "--report", "json", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["output"] == str(out)
    assert json.loads(out.read_text())["zero_optimization"]["stage"] == 3


def _launch_lines() -> list[str]:
    """Corpus command lines that are themselves valid shell (some hold documentation placeholders like <args>)."""
    lines = json.loads((ROOT / "tests" / "fixtures" / "corpus" / "launch" / "lines.json").read_text())
    commands = [entry["command"] for entry in lines]
    return [c for c in commands if subprocess.run(["bash", "-n"], input=c, text=True).returncode == 0][:12]


@pytest.mark.parametrize("show_env", [[], ["--show-env"]])
def test_launch_stdout_is_a_shell_script(tmp_path, show_env):
    checked = 0
    for line in _launch_lines():
        done = cli("launch", line, "--to", "all", *show_env)
        if done.returncode == 2:  # a line this launcher grammar refuses: an error, not a script
            assert "Traceback" not in done.stderr
            continue
        script = tmp_path / "run.sh"
        script.write_text(done.stdout)
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert syntax.returncode == 0, f"{line}\n{done.stdout}\n{syntax.stderr}"
        assert "source key" not in done.stdout and "exact" not in done.stdout.replace("# ", "")
        assert "source key" in done.stderr  # the reports
        checked += 1
    assert checked >= 5


def test_launch_hostfile_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "hostfile"
    os.mkfifo(fifo)
    done = run_cli("launch", "deepspeed --hostfile hostfile train.py", "--hostfile", str(fifo), timeout=30)
    assert done.returncode == 2 and "named pipe" in done.stderr


# ---- tables


def test_tables_fit_80_columns_without_cutting_keys():
    keys = ["zero_optimization.stage3_param_persistence_threshold", "zero_optimization.offload_optimizer.pin_memory"]
    rows = [(k, "extensions.deepspeed." + k, "10000000", "ignored", "a performance knob of DeepSpeed's ZeRO-3 "
             "with no effect under the FSDP2 engine; kept for a DeepSpeed round trip") for k in keys]  # fmt: skip
    for width in (80, 100, 200):
        text = render_table("t", ("source key", "target", "value", "fidelity", "reason"), rows, width)
        assert all(len(line) <= width for line in text.splitlines()), text
        for key in keys:
            assert key in text  # never folded mid-word
    piped = render_table("t", ("a", "b"), [("k", "word " * 60)], None)
    assert len(piped.splitlines()) == 4  # title, header, rule, the row: into a pipe, never wrapped


def _run_in_terminal(args: list[str], columns: int = 80) -> str:
    import pty

    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns)}
    child = subprocess.Popen([sys.executable, "-m", "torsh.cli", *args], stdout=follower, stderr=subprocess.DEVNULL,
                             env=env, cwd=ROOT)  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    child.wait(60)
    os.close(leader)
    return b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")


@pytest.mark.parametrize("args", [
    ["validate", str(DS.relative_to(ROOT))],
    ["explain", str(ZERO3.relative_to(ROOT))],
    ["diff", str(DS.relative_to(ROOT)), str(ZERO3.relative_to(ROOT))],
])  # fmt: skip
def test_terminal_output_fits_80_columns(args):
    out = _run_in_terminal(args)
    assert out.strip()
    too_wide = [line for line in out.splitlines() if len(line) > 80]
    assert not too_wide, too_wide[:3]
    assert not BOX & set(out)


@pytest.mark.parametrize("args", [["diff", str(DS), str(ZERO3)], ["explain", str(ZERO3)], ["validate", str(DS)]])
def test_piped_output_is_plain_text(args):
    done = run_cli(*args)
    assert done.returncode in (0, 1), done.stderr
    assert not BOX & set(done.stdout) and "\x1b[" not in done.stdout


# ---- validate


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_validate_several_files_exit_code_is_the_worst(tmp_path):
    good = str(DS)
    bad = _write(tmp_path, "bad.json", '{"train_batch_size": 8, "zero_optimization": {"stage": 7}}')
    assert cli("validate", good, good).returncode == 0
    both = cli("validate", good, bad)
    assert both.returncode == 2 and "zero_optimization.stage" in both.stderr and f"OK: {good}" in both.stdout


def test_validate_strict(tmp_path):
    lossy = _write(tmp_path, "c.yaml", "ddp: {gradient_compression: true}\n")
    assert cli("validate", lossy).returncode == 0
    strict = cli("validate", lossy, "--strict")
    assert strict.returncode == 1 and "ddp.gradient_compression" in strict.stderr
    assert cli("validate", str(DS), lossy, "--strict").returncode == 1


def test_validate_json_report_holds_errors_and_is_one_document(tmp_path):
    bad = _write(tmp_path, "bad.json", '{"train_batch_size": 8, "zero_optimization": {"stage": 7}}')
    done = cli("validate", str(DS), bad, "--report", "json")
    assert done.returncode == 2
    data = json.loads(done.stdout)
    assert data["exit_code"] == 2 and [f["valid"] for f in data["files"]] == [True, False]
    errors = data["files"][1]["errors"]
    assert any(e["path"] == "zero_optimization.stage" and e["value"] == 7 for e in errors)
    assert data["files"][0]["report"]["source"] == "deepspeed"


def test_validate_notes_json_that_only_hjson_accepts(tmp_path):
    relaxed = _write(tmp_path, "ds.json", '{\n  // zero 1\n  "train_batch_size": 8,\n}\n')
    done = cli("validate", relaxed)
    assert done.returncode == 0 and "json.load" in done.stderr and "hjson" in done.stderr
    assert cli("validate", relaxed, "--strict").returncode == 1
    data = json.loads(cli("validate", relaxed, "--report", "json").stdout)
    assert data["files"][0]["syntax_notes"] and data["exit_code"] == 0
