"""Every real file of the corpus (tests/fixtures/corpus, sources in its SOURCES.md files) through every command.

The property: whatever a real public config holds, `torsh-migrate` answers with an exit code - 0 (done), 1 (lossy
or different) or 2 (refused, with a message) - and never with a traceback. Each file is run through `validate`,
`explain`, `convert --to` every dialect, `snippet` and `diff` against a sibling; each real launch line (and a job on
each real hostfile) through `launch --to` every launcher. One test per file collects every failing command, so one
run lists them all.

The input dialect is sniffed, or given with `--from` where the folder names a dialect torsh has. Commands run
in-process (`torsh.cli.main`) in the file's folder, where relative paths inside a config (an Accelerate YAML's
`deepspeed_config_file`) resolve the same whether torsh reads them relative to the file or to the working directory.
Two things a command repeats for every call are done once per module (CPU: the module makes ~7,000 calls): the
argument parser `main` builds (the same parser each time; a parse does not change it), and the parse of a file's
text (every command of a file reads the same text; each gets its own copy of what the parse returned, and a text
whose parse fails is parsed again by every command).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import re
import traceback
from pathlib import Path

import pytest

import torsh.cli
from torsh import adapters, formats
from torsh.cli import main

CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus"
#: exit codes a user may get: done, lossy/different, refused with a message
EXIT_CODES = (0, 1, 2)
#: the dialect each folder holds, by preference; the first one torsh has is passed with --from (else sniffed)
FOLDER_DIALECTS = {
    "deepspeed": ("deepspeed",), "deepspeed_config_templates": ("deepspeed",), "accelerate": ("accelerate",),
    "accelerate_variants": ("accelerate",), "fsdp": ("fsdp",), "fairscale": ("fairscale",),
    "horovod": ("horovod",), "torchtitan": ("torchtitan",), "torchtune": ("torchtune",),
    "fsdp_plugin_json": ("fsdp_plugin", "fsdp"), "lightning": ("lightning",), "trainer_yaml": (), "refused": (),
}  # fmt: skip
LAUNCHERS = ("torchrun", "deepspeed", "horovodrun", "mpirun", "all")
#: config files: everything in the folders above but the source records
FILES = sorted(p for folder in FOLDER_DIALECTS for p in (CORPUS / folder).glob("*")
               if p.is_file() and p.name != "SOURCES.md")  # fmt: skip
LINES = [line for name in ("lines.json", "script_lines.json")
         for line in json.loads((CORPUS / "launch" / name).read_text(encoding="utf-8"))]  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _once_per_module():
    """One argument parser for every ``main`` call of the module, and one parse per (text, format)."""
    parsed: dict[tuple[str, str], tuple[object, list[str]]] = {}
    parse = formats._parse

    def parse_once(text: str, fmt: str, notes: list[str]):
        if (text, fmt) not in parsed:
            own: list[str] = []
            parsed[text, fmt] = (parse(text, fmt, own), own)  # a parse that raises is not kept
        data, own = parsed[text, fmt]
        notes.extend(own)
        return copy.deepcopy(data)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torsh.cli, "build_parser", functools.cache(torsh.cli.build_parser))
        patch.setattr(formats, "_parse", parse_once)
        yield


def _dialect(path: Path) -> str | None:
    known = set(adapters.names())
    return next((d for d in FOLDER_DIALECTS[path.parent.name] if d in known), None)


def _sibling(path: Path) -> Path:
    """The next file of the same folder (wrapping), or the first file of another folder for a lone file."""
    same = [p for p in FILES if p.parent == path.parent]
    if len(same) > 1:
        return same[(same.index(path) + 1) % len(same)]
    return next(p for p in FILES if p.parent != path.parent)


def _commands(path: Path) -> list[list[str]]:
    dialect = _dialect(path)
    src = ["--from", dialect] if dialect else []
    sibling = _sibling(path)
    other = _dialect(sibling)
    diff = ["diff", path.name, str(sibling)] + (["--from-a", dialect] if dialect else [])
    diff += ["--from-b", other] if other else []
    return ([["validate", path.name, *src], ["explain", path.name, *src]]
            + [["convert", path.name, "--to", target, *src] for target in adapters.names()]
            + [["snippet", path.name, *src], diff])  # fmt: skip


def _run(argv: list[str]) -> str | None:
    """None when ``main(argv)`` ends with a user-facing exit code, else what went wrong (one line)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as exc:  # argparse's usage error: the shell sees this code
        code = exc.code if isinstance(exc.code, int) else 2
    except Exception as exc:  # noqa: BLE001 - the property: nothing but an exit code may come out
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        first = (str(exc).splitlines() or [""])[0][:160]
        return f"{type(exc).__name__}: {first} [{Path(frame.filename).name}:{frame.lineno}]"
    if isinstance(code, int) and code in EXIT_CODES:
        return None
    said = next((line for line in err.getvalue().splitlines() if line.strip()), "")
    return f"exit code {code!r}: {said[:160]}"


def _failures(calls: list[list[str]]) -> list[str]:
    failures = []
    for argv in calls:
        what = _run(argv)
        if what is not None:
            shown = " ".join(a if len(a) < 60 else "<...>" for a in argv)
            failures.append(f"  torsh-migrate {shown}\n      -> {what}")
    return failures


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_command_answers_a_corpus_file_with_an_exit_code(path, monkeypatch):
    monkeypatch.chdir(path.parent)
    failures = _failures(_commands(path))
    assert not failures, f"{path.parent.name}/{path.name}: {len(failures)} command(s) raised:\n" + "\n".join(failures)


@pytest.mark.parametrize("line", LINES, ids=[line["id"] for line in LINES])
def test_every_launcher_answers_a_real_launch_line_with_an_exit_code(line, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    failures = _failures([["launch", "--to", target, "--", line["command"]] for target in LAUNCHERS])
    assert not failures, f"{line['id']}: {len(failures)} command(s) raised:\n" + "\n".join(failures)


HOSTFILES = sorted(p for p in (CORPUS / "launch").iterdir() if p.name.endswith("hostfile"))


@pytest.mark.parametrize("hostfile", HOSTFILES, ids=lambda p: p.name)
def test_every_launcher_answers_a_job_on_a_real_hostfile_with_an_exit_code(hostfile, monkeypatch):
    monkeypatch.chdir(hostfile.parent)
    job = f"deepspeed --hostfile {hostfile.name} train.py"
    failures = _failures([["launch", "--to", target, "--hostfile", hostfile.name, "--", job] for target in LAUNCHERS])
    assert not failures, f"{hostfile.name}: {len(failures)} command(s) raised:\n" + "\n".join(failures)


# ---- the corpus itself -----------------------------------------------------------------------------------

_SOURCES = ("SOURCES.md", "deepspeed/SOURCES.md", "launch/SOURCES.md")


def _rows() -> list[dict[str, str]]:
    """Every row of every SOURCES.md table, keyed by its table's header (file or id, repository, commit, ...)."""
    rows = []
    for name in _SOURCES:
        header: list[str] = []
        for line in (CORPUS / name).read_text(encoding="utf-8").splitlines():
            if not line.startswith("| "):
                header = [] if not line.strip() else header
                continue
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not header:
                header = [c.split(" ")[0] for c in cells]  # "id (lines.json)" -> "id"
            elif not line.startswith("| ---"):
                rows.append(dict(zip(header, cells)))
    return rows


def test_every_corpus_file_and_line_has_a_source_commit_and_licence():
    rows = _rows()
    named = {row.get("file") or row.get("id") for row in rows}
    missing = [f"{p.parent.name}/{p.name}" for p in FILES if p.name not in named]
    assert not missing, missing
    assert {line["id"] for line in LINES} <= named
    for row in rows:
        assert "/" in row["repository"] and row["license"], row
        assert re.fullmatch(r"[0-9a-f]{40}", row["commit"]), row


def test_the_corpus_looks_like_the_world():
    """At least 250 real config files from at least 30 repositories, across every dialect folder (launch lines
    come on top)."""
    repos = {row["repository"] for row in _rows() if "file" in row}
    assert len(FILES) + len(HOSTFILES) >= 250, len(FILES)
    assert len(repos) >= 30, sorted(repos)
    assert all(any(p.parent.name == folder for p in FILES) for folder in FOLDER_DIALECTS)
