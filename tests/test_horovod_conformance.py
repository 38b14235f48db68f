"""Horovod 0.28.1's own PyTorch test file, unchanged, against torsh.horovod on 2 gloo ranks.

Horovod's ``test/parallel/test_torch.py`` and the helpers it imports are read at test time from Horovod's source
archive (never copied into this repository): ``horovod-0.28.1-src.tar.gz`` in ``../shared/conformance/`` beside the
repository (the frameworks' test files CI provides), else an archive with the test folder in ``.venv/sdist``. They
are extracted to a temporary folder and run the way
Horovod's CI runs them: every rank runs the whole file under pytest, once with the variables ``horovodrun --gloo``
exports (the file's Gloo-controller branch) and once with ``mpirun``'s (its MPI branch); see
``horovod_conformance_rank.py``. ``import horovod.torch`` resolves to ``torsh.horovod`` in every rank.

Each test of the file has one expected outcome per branch in ``horovod_conformance_expected.txt`` (pass, skip,
fail, hang, crash), with the reason for anything but pass; a test whose outcome differs in either direction fails
here. A test running longer than :data:`PER_TEST_SECONDS` is a hang: its launch stops and the run goes on from the
next test. ``TORSH_UPDATE_HOROVOD_EXPECTED=1`` rewrites the outcomes in the list (keeping the reasons) after a
deliberate change; review the diff.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SDIST_DIR = ROOT / ".venv" / "sdist"
# The frameworks' own test files, beside the repository (read-only in CI): see its README.md.
SHARED_DIR = ROOT.parent / "shared" / "conformance"
EXPECTED = HERE / "horovod_conformance_expected.txt"
RANK_SCRIPT = HERE / "horovod_conformance_rank.py"
BRANCHES = ("gloo", "mpi")
OUTCOMES = ("pass", "skip", "fail", "hang", "crash")
PER_TEST_SECONDS = 30.0
VERSION = "0.28.1"
TEST_FILE = "test/parallel/test_torch.py"
# What test_torch.py imports from Horovod's tree besides horovod.torch (which is torsh.horovod).
MEMBERS = (TEST_FILE, "test/utils/common.py", "test/conftest.py", "horovod/runner/util/threads.py")


def _archives() -> list[Path]:
    """Where Horovod's test file may be, in order: GitHub's source archive in the shared folder, then .venv/sdist."""
    return [a for folder in (SHARED_DIR, SDIST_DIR) if folder.is_dir()
            for a in sorted(folder.glob(f"horovod-{VERSION}*.tar.gz"))]  # fmt: skip


def _extract(target: Path) -> bool:
    """Horovod's test file and helpers from the first archive that has them into ``target``; False when none has.

    GitHub's v0.28.1 source archive (``horovod-0.28.1-src.tar.gz``) in ``../shared/conformance/`` is read first;
    the PyPI sdist ``make venv`` downloads to ``.venv/sdist`` ships no ``test/`` folder and is passed over.
    """
    for archive in _archives():
        with tarfile.open(archive) as tar:
            names = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name and m.isfile()}
            if TEST_FILE not in names:
                continue
            for member in MEMBERS:
                if member not in names:
                    continue
                out = target / member
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(tar.extractfile(names[member]).read())
            for package in ("horovod", "horovod/runner", "horovod/runner/util"):
                (target / package / "__init__.py").touch()
            return True
    return False


def _test_names(source: Path) -> list[str]:
    tree = ast.parse((source / TEST_FILE).read_text())
    return [f.name for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "TorchTests"
            for f in c.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                      "HOROVOD_", "TORCHELASTIC", "GROUP_", "OMPI_",
                                                                      "PMI_"))}  # fmt: skip
    return {**env, "OMP_NUM_THREADS": "1"}


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _combine(per_rank: list[tuple[str, str]]) -> tuple[str, str]:
    """Both ranks' outcomes of one test -> one: the worst, with its message."""
    return max(per_rank, key=lambda om: OUTCOMES.index(om[0]))


def run_branch(source: Path, branch: str, out: Path, names: list[str]) -> dict[str, tuple[str, str]]:
    """Every test of the file on 2 ranks in one launch (another after each hang or crash): name -> outcome."""
    results: dict[str, tuple[str, str]] = {}
    remaining = sorted(names)  # the order pytest runs a unittest class in (the whole file in the first launch)
    for attempt in range(len(names) + 1):
        if not remaining:
            break
        folder = out / f"{branch}{attempt}"
        folder.mkdir(parents=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), str(RANK_SCRIPT), branch, str(source), str(folder), str(PER_TEST_SECONDS),
               *(remaining if attempt else [])]  # fmt: skip
        log = folder / "log.txt"
        with log.open("w") as fh:
            proc = subprocess.Popen(cmd, env=_env(), stdout=fh, stderr=subprocess.STDOUT, cwd=source,
                                    start_new_session=True)  # fmt: skip
            try:
                proc.wait(timeout=PER_TEST_SECONDS * (len(remaining) + 4))
            except subprocess.TimeoutExpired:  # the ranks' own watchdogs failed: stop the whole launch
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        ended: dict[str, list[tuple[str, str]]] = {}
        started: set = set()
        for rank in (0, 1):
            for rec in _read(folder / f"rank{rank}.jsonl"):
                if rec["event"] == "start":
                    started.add(rec["test"])
                else:
                    ended.setdefault(rec["test"], []).append((rec["outcome"], rec["message"]))
        for name, outs in ended.items():
            if len(outs) == 2 or any(o == "hang" for o, _ in outs):
                results[name] = _combine(outs)
        stuck = [n for n in remaining if n in started and n not in results]
        for name in stuck:  # started, never finished on both ranks: the process died in it
            partial = ended.get(name, [])
            results[name] = _combine(partial + [("crash", "the rank process died: " + log.read_text()[-1500:])])
        progress = len(remaining)
        remaining = [n for n in remaining if n not in results]
        if len(remaining) == progress:  # the launch failed before running anything new: report, do not loop
            for name in remaining:
                results[name] = ("crash", "not run: " + log.read_text()[-1500:])
            break
    return results


def read_expected() -> dict[str, tuple[str, str, str]]:
    """Test name -> (gloo outcome, mpi outcome, reason) from the list."""
    expected = {}
    for line in EXPECTED.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split(maxsplit=3)
        expected[parts[0]] = (parts[1], parts[2], parts[3] if len(parts) > 3 else "")
    return expected


def _write_expected(measured: dict[str, dict[str, tuple[str, str]]], names: list[str]) -> None:
    old = read_expected() if EXPECTED.exists() else {}
    header = [ln for ln in EXPECTED.read_text().splitlines() if ln.startswith("#")] if EXPECTED.exists() else []
    width = max(map(len, names))
    lines = header[:]
    for name in names:
        gloo, mpi = measured["gloo"][name][0], measured["mpi"][name][0]
        reason = old.get(name, ("", "", ""))[2]
        if reason.startswith("TODO"):
            reason = ""
        if (gloo, mpi) != ("pass", "pass") and not reason:
            message = next((measured[b][name][1] for b in BRANCHES if measured[b][name][0] != "pass"), "")
            reason = "TODO: " + (message.splitlines() or [""])[-1][:150]
        lines.append(f"{name:<{width}}  {gloo:<5}  {mpi:<5}  {reason}".rstrip())
    EXPECTED.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def conformance(tmp_path_factory):
    work = tmp_path_factory.mktemp("horovod")
    source = work / "src"
    if not _extract(source):
        pytest.skip(f"no Horovod {VERSION} archive with {TEST_FILE}: looked for horovod-{VERSION}*.tar.gz in "
                    f"{SHARED_DIR} and {SDIST_DIR} (PyPI's sdist ships no test/ folder; GitHub's v{VERSION} source "
                    f"archive, horovod-{VERSION}-src.tar.gz, has it)")
    names = _test_names(source)
    with ThreadPoolExecutor(len(BRANCHES)) as pool:
        futures = {b: pool.submit(run_branch, source, b, work / "runs", names) for b in BRANCHES}
        measured = {b: f.result() for b, f in futures.items()}
    if os.environ.get("TORSH_UPDATE_HOROVOD_EXPECTED"):
        _write_expected(measured, names)
    summary = {b: {o: sum(1 for r in measured[b].values() if r[0] == o) for o in OUTCOMES} for b in BRANCHES}
    print(f"\nHorovod {VERSION} test_torch.py on torsh.horovod, 2 ranks: {json.dumps(summary)}")
    return names, measured


def test_expected_list_is_well_formed():
    expected = read_expected()
    for name, (gloo, mpi, reason) in expected.items():
        assert gloo in OUTCOMES and mpi in OUTCOMES, f"{name}: outcomes must be among {OUTCOMES}"
        assert reason or (gloo, mpi) == ("pass", "pass"), f"{name}: every outcome but pass needs its reason"
        assert not reason.startswith("TODO"), f"{name}: give the reason"


@pytest.mark.slow
def test_every_test_of_the_file_is_listed(conformance):
    names, _ = conformance
    expected = read_expected()
    assert sorted(set(names) - set(expected)) == [], "tests of the file missing from the expected list"
    assert sorted(set(expected) - set(names)) == [], "listed tests that the file does not have"


@pytest.mark.slow
def test_outcomes_match_the_list(conformance):
    names, measured = conformance
    expected = read_expected()
    differences = []
    for name in names:
        if name not in expected:
            continue
        for branch, want in zip(BRANCHES, expected[name][:2], strict=True):
            got, message = measured[branch][name]
            if got != want:
                differences.append(f"{name} [{branch}]: expected {want}, got {got}\n    {message[:600]}")
    assert not differences, f"{len(differences)} outcomes differ from {EXPECTED.name}:\n" + "\n".join(differences)

