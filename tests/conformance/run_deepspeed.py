"""DeepSpeed's own unit tests, unchanged, against torsh (or real DeepSpeed), compared with the kept list.

``make conformance`` runs this. DeepSpeed's test files are read from ``deepspeed-tests-edaa722.tar.gz`` in
``../shared/conformance/`` beside the repository (never copied into it), extracted to a temporary folder and run
there file by file under pytest, the way they were run by hand before (``tests/deepspeed_conformance.md``):
``DS_ACCELERATOR=cpu``, ``LOCAL_SIZE=2`` (DeepSpeed's CPU accelerator then counts two devices), DeepSpeed's
``DistributedTest`` harness spawning the 2 ranks, ``DS_UNITTEST_TIMEOUT`` per test, and for torsh ``deepspeed``
resolved to ``torsh.compat.deepspeed`` in every process by torsh's ``sitecustomize`` (``torsh run --no-python``'s)
on ``PYTHONPATH``.

Each test's outcome -- ``passed``, ``failed``, ``skipped`` (the test skips itself), ``hung`` (no result within the
per-test limit: the session is stopped and started again after that test), ``error`` (the file does not import),
``absent`` (the engine does not collect it) or ``not-run`` (the file's time limit ran out first) -- is written to
a JSON file and compared with the engine's column of ``tests/deepspeed_unit_results.tsv``, for the files that
list declares run (its ``#file`` lines; the others are declared excluded there, with the reason). Any difference,
in either direction, and any test the list does not have, fails the run (exit 1).

After a deliberate change, or once the drop-in's code is final, re-record with ``--update`` (``make conformance
UPDATE=1``): the engine's column is rewritten for the files run, reasons are kept, rows new to the list get a
``TODO`` reason to fill in. Real DeepSpeed's column is recorded with ``--engine deepspeed --update`` (``make
conformance-record-deepspeed``; DeepSpeed JIT-builds a C++ op the first time, into ``TORCH_EXTENSIONS_DIR``).
``--files`` runs only some files; ``--all-files`` also runs the excluded ones. ``--archive`` runs from another
archive of the same shape (``extend_archive.py`` builds one with more files); files the list declares run that the
archive in use lacks are named once and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ARCHIVE = ROOT.parent / "shared" / "conformance" / "deepspeed-tests-edaa722.tar.gz"
EXPECTED = ROOT / "tests" / "deepspeed_unit_results.tsv"
RESULTS_DIR = ROOT / ".venv" / "conformance"
ENGINES = ("deepspeed", "torsh")
OUTCOMES = ("passed", "failed", "skipped", "hung", "error", "absent", "not-run")
COLUMNS = ("nodeid", "deepspeed", "torsh", "counted", "reason")
# Imported once by the forkserver DeepSpeed's harness forks its ranks from (see _record_plugin.py).
PRELOAD = "torch,deepspeed"


# --- the list -------------------------------------------------------------------------------------------------


class Expected:
    """``tests/deepspeed_unit_results.tsv``: comment lines (``#``), ``#file`` lines (which files run, which are
    excluded and why), a header, then one row per test: node id, DeepSpeed's result, torsh's, counted, reason."""

    def __init__(self, path: Path = EXPECTED):
        self.path = path
        self.comments: list[str] = []
        self.files: dict[str, tuple[str, str]] = {}  # file -> ("run" | "excluded", reason)
        self.rows: dict[str, dict[str, str]] = {}
        header_seen = False
        for line in path.read_text().splitlines():
            if line.startswith("#file\t"):
                _, name, status, *reason = line.split("\t")
                self.files[name] = (status, reason[0] if reason else "")
            elif line.startswith("#") or not line.strip():
                self.comments.append(line)
            elif not header_seen:
                assert tuple(line.split("\t")) == COLUMNS, f"{path.name}: header must be {COLUMNS}"
                header_seen = True
            else:
                cells = line.split("\t") + [""] * len(COLUMNS)
                self.rows[cells[0]] = dict(zip(COLUMNS, cells[: len(COLUMNS)], strict=True))

    def run_files(self) -> list[str]:
        return [f for f, (status, _) in self.files.items() if status == "run"]

    def write(self) -> None:
        lines = [c for c in self.comments if c.strip()]
        lines += ["\t".join(("#file", name, status, reason)).rstrip("\t")
                  for name, (status, reason) in self.files.items()]  # fmt: skip
        lines.append("\t".join(COLUMNS))
        for row in self.rows.values():
            row["counted"] = "yes" if row["deepspeed"] == "passed" else "no"
            lines.append("\t".join(row[c] for c in COLUMNS))
        self.path.write_text("\n".join(lines) + "\n")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# --- running one file -----------------------------------------------------------------------------------------


def _environment(engine: str, test_timeout: int, worker: int, preload: bool) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC", "GROUP_", "PYTEST_",
                                "CUDA_VISIBLE"))}  # fmt: skip
    path = [str(HERE)]  # the recording plugin
    if engine == "torsh":
        import torsh.run  # noqa: PLC0415  (only its folder: the sitecustomize `torsh run --no-python` installs)

        path.insert(0, torsh.run.SITE_DIR)
    path += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(DS_ACCELERATOR="cpu", LOCAL_SIZE="2", DS_UNITTEST_TIMEOUT=str(test_timeout), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(path), TORSH_CONFORMANCE_PRELOAD=PRELOAD if preload else "",
               # DeepSpeed's get_master_port() offsets its port range by the xdist worker number: files run at once
               # take ports from disjoint ranges.
               PYTEST_XDIST_WORKER=f"gw{worker}")  # fmt: skip
    return env


_running: set[int] = set()  # process groups of the sessions running now, killed if the runner is stopped


def _kill(proc: subprocess.Popen) -> None:
    """The launched pytest and everything it started (its session: the forkserver, the ranks)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _stop(signum, frame):
    for pgid in list(_running):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(128 + signum)


def _read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def run_file(tests_dir: Path, test_file: str, engine: str, work: Path, *, test_timeout: int, file_timeout: int,
             worker: int = 0, preload: bool = True) -> dict[str, dict]:  # fmt: skip
    """Every test of one file: node id -> {outcome, message, seconds}. A session stopped on a hang (DeepSpeed's
    harness ends it with ``pytest.exit``; the runner kills it past ``test_timeout`` + a grace) is started again
    with the tests left; past ``file_timeout`` the tests left are ``not-run``."""
    results: dict[str, dict] = {}
    collected: list[str] | None = None
    per_test_limit = test_timeout + 60
    started_file = time.monotonic()
    env = _environment(engine, test_timeout, worker, preload)
    for attempt in range(10_000):
        folder = work / f"{test_file.replace('/', '_')}.{attempt}"
        folder.mkdir(parents=True)
        events_path = folder / "events.jsonl"
        env["TORSH_CONFORMANCE_EVENTS"] = str(events_path)
        env.pop("TORSH_CONFORMANCE_ONLY", None)
        if collected is not None:
            (folder / "only.txt").write_text("".join(n + "\n" for n in collected if n not in results))
            env["TORSH_CONFORMANCE_ONLY"] = str(folder / "only.txt")
        cmd = [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "-p", "_record_plugin",
               "-p", "no:xdist", "--color=no", "-q", test_file]  # fmt: skip
        log = folder / "log.txt"
        killed_for = None
        with log.open("w") as fh:
            proc = subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            _running.add(proc.pid)
            current, since = None, time.monotonic()
            while proc.poll() is None:
                time.sleep(1.0)
                events = _read_events(events_path)
                last = next((e for e in reversed(events) if e["event"] in ("start", "end")), None)
                if last is not None and last["event"] == "start" and last["test"] != current:
                    current, since = last["test"], time.monotonic()
                elif last is None or last["event"] == "end":
                    current = None
                now = time.monotonic()
                if current is not None and now - since > per_test_limit:
                    killed_for = f"no result after {per_test_limit} s (DS_UNITTEST_TIMEOUT {test_timeout} s + 60 s)"
                elif now - started_file > file_timeout:
                    killed_for = f"the file's time limit ({file_timeout} s) ran out"
                if killed_for:
                    _kill(proc)
                    proc.wait()
                    break
            _kill(proc)  # what the session left behind (a forkserver, ranks of a hung test)
            _running.discard(proc.pid)
        events = _read_events(events_path)
        for ev in events:
            if ev["event"] == "collected" and collected is None:
                collected = ev["tests"]
            elif ev["event"] == "end":
                results[ev["test"]] = {k: ev[k] for k in ("outcome", "message", "seconds")}
        starts = [ev["test"] for ev in events if ev["event"] == "start"]
        tail = log.read_text()[-1200:]
        if starts and starts[-1] not in results:  # started, no result: hung, or the session died in it
            if "Test hanged" in tail:
                result = ("hung", f"no result within DS_UNITTEST_TIMEOUT ({test_timeout} s): DeepSpeed's harness "
                                  "ended the session (pytest.exit 'Test hanged')")  # fmt: skip
            elif killed_for:
                result = ("hung", killed_for)
            else:
                result = ("failed", "the pytest session ended in this test: " + tail[-600:])
            results[starts[-1]] = {"outcome": result[0], "seconds": None, "message": result[1]}
        if collected is None:  # nothing collected and no import error recorded: the session failed before
            if not any(r["outcome"] == "error" for r in results.values()):
                results[test_file] = {"outcome": "error", "seconds": None, "message": tail}
            break
        left = [n for n in collected if n not in results]
        if not left:
            break
        if time.monotonic() - started_file > file_timeout or (not starts and not killed_for):
            why = f"the file's time limit ({file_timeout} s) ran out" if starts or killed_for else tail
            for name in left:
                results[name] = {"outcome": "not-run", "seconds": None, "message": why}
            break
    return results


# --- comparing ------------------------------------------------------------------------------------------------


def compare(expected: Expected, engine: str, files: list[str], measured: dict[str, dict]) -> list[str]:
    """Differences between the measured outcomes and the engine's column, for the files run."""
    differences = []
    listed = {n for n in expected.rows if file_of(n) in files}
    for name in sorted(listed | set(measured)):
        want = expected.rows.get(name, {}).get(engine)
        got = _outcome_of(name, measured, expected)
        if want is None:
            differences.append(f"{name}: not in {EXPECTED.name}; {engine} gives {got}")
        elif got != want:
            message = measured.get(name, {}).get("message", "")
            differences.append(f"{name}: expected {want}, got {got}" + (f"\n    {message[:500]}" if message else ""))
    return differences


def _outcome_of(name: str, measured: dict[str, dict], expected: Expected) -> str:
    if name in measured:
        return measured[name]["outcome"]
    if measured.get(file_of(name), {}).get("outcome") == "error":  # the file does not import: nor does this test
        return "error"
    return "absent"


def update(expected: Expected, engine: str, files: list[str], measured: dict[str, dict]) -> None:
    """The engine's column rewritten for the files run; rows new to the list get the other engine ``not-run``.

    Reasons written by hand are kept. A row both engines pass has none. Otherwise a row without one gets the
    engine's message: ``TODO: ...`` where both engines are recorded and differ (to be replaced by the reason),
    ``measured: ...`` where they agree or the other engine is not recorded (``not-run``)."""
    other = "torsh" if engine == "deepspeed" else "deepspeed"
    for name in sorted({n for n in expected.rows if file_of(n) in files} | set(measured)):
        got = _outcome_of(name, measured, expected)
        if "::" not in name:  # a file that does not import on one engine: kept while it does not, on either
            row = expected.rows.get(name, {"deepspeed": "absent", "torsh": "absent"})
            if got != "error" and row[other] != "error":
                expected.rows.pop(name, None)
                continue
            if got != "error":
                row[engine] = "absent"
                continue
        file_row = expected.rows.get(file_of(name), {})  # the file did not import on the other engine
        if "::" not in name:  # this engine's import error: the other engine has no such row if its tests ran
            ran = any(file_of(n) == name and "::" in n and r[other] != "not-run" for n, r in expected.rows.items())
            first = "absent" if ran else "not-run"
        else:
            first = "error" if file_row.get(other) == "error" else "not-run"
        row = expected.rows.setdefault(name, {"nodeid": name, other: first, "counted": "", "reason": ""})
        row[engine] = got
        ds, torsh = row["deepspeed"], row["torsh"]
        automatic = not row["reason"] or row["reason"].startswith(("TODO", "measured: "))
        if ds == torsh == "passed" or (automatic and "not-run" in (ds, torsh) and got == "passed"):
            row["reason"] = ""
        elif automatic:
            result = measured.get(name) or measured.get(file_of(name)) or {}
            if ds == torsh:
                row["reason"] = f"measured: both {got}: {_last_line(result)}"
            else:
                prefix = "measured" if "not-run" in (ds, torsh) else "TODO"
                row["reason"] = f"{prefix}: {engine} {got}: {_last_line(result)}"
    expected.rows = dict(sorted(expected.rows.items(), key=lambda kv: _order_key(kv[0])))


def _order_key(name: str) -> tuple:
    return (file_of(name), name)


def _last_line(result: dict) -> str:
    """The message's last line, without the folders of this machine (the list is kept in the repository)."""
    lines = [ln.strip().removeprefix("E").strip() for ln in (result.get("message") or "").splitlines() if ln.strip()]
    line = re.sub(r"\(?/[^\s()'\"]*/(?=(?:torsh|deepspeed|unit|tests)/)", "", lines[-1] if lines else "")
    return re.sub(r"(\.py)\)", r"\1", line)[:200] or result.get("outcome", "")


# --- main -----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=ENGINES, default="torsh")
    parser.add_argument("--files", nargs="*", help="only these files (unit/...), default: the list's run files")
    parser.add_argument("--all-files", action="store_true", help="every test file of the archive")
    parser.add_argument("--update", action="store_true", help="rewrite the engine's column for the files run")
    parser.add_argument("--test-timeout", type=int, default=int(os.environ.get("DS_UNITTEST_TIMEOUT", 120)))
    parser.add_argument("--file-timeout", type=int, default=900)
    parser.add_argument("--jobs", type=int, default=1, help="files run at once")
    parser.add_argument("--no-preload", action="store_true", help="each rank imports torch and the engine itself")
    parser.add_argument("--results", type=Path, help="JSON of the outcomes (default: .venv/conformance/)")
    parser.add_argument("--from-results", type=Path, help="compare (or --update) from a results JSON, run nothing")
    parser.add_argument("--archive", type=Path, default=ARCHIVE,
                        help="DeepSpeed's test archive to run from (default: the shared one; a larger one: "
                             "extend_archive.py)")  # fmt: skip
    args = parser.parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop)

    if not args.archive.is_file():
        print(f"DeepSpeed's test archive is not there: looked for {args.archive}"
              + (" (the shared conformance folder beside the repository)" if args.archive == ARCHIVE else ""),
              file=sys.stderr)  # fmt: skip
        return 2
    expected = Expected()
    if args.from_results:
        saved = json.loads(args.from_results.read_text())
        files = [f for f in (args.files or (saved["files"] if args.all_files else expected.run_files()))
                 if f in saved["files"]]  # fmt: skip
        measured = {n: r for n, r in saved["tests"].items() if file_of(n) in files}
        return _conclude(expected, args.engine, files, measured, args.update)
    started = time.monotonic()
    results_path = args.results or RESULTS_DIR / f"deepspeed-unit-{args.engine}.json"
    with tempfile.TemporaryDirectory(prefix="ds-conformance-") as tmp:
        work = Path(tmp)
        with tarfile.open(args.archive) as tar:
            tar.extractall(work / "src", filter="data")
        (top,) = (work / "src").iterdir()
        tests_dir = top / "tests"
        every = sorted(str(p.relative_to(tests_dir)) for p in tests_dir.glob("unit/**/test_*.py"))
        files, absent = files_to_run(expected, every, args.files, all_files=args.all_files)
        if args.files and absent:
            print(f"not in the archive ({args.archive.name}): {absent}", file=sys.stderr)
            return 2
        if absent:
            print(f"not in the archive ({args.archive.name}), skipped: {len(absent)} files the list runs: "
                  + ", ".join(absent), flush=True)  # fmt: skip
        print(f"DeepSpeed's unit tests on {args.engine}: {len(files)} files, {args.jobs} at once, "
              f"DS_UNITTEST_TIMEOUT={args.test_timeout}s, {args.file_timeout}s per file", flush=True)  # fmt: skip
        measured: dict[str, dict] = {}
        done: list[str] = []  # the results file is written after each file: a run stopped halfway keeps them
        lock = threading.Lock()
        free_workers = list(range(args.jobs))

        def one(test_file: str) -> None:
            with lock:
                worker = free_workers.pop()
            t0 = time.monotonic()
            try:
                results = run_file(tests_dir, test_file, args.engine, work / "runs", test_timeout=args.test_timeout,
                                   file_timeout=args.file_timeout, worker=worker,
                                   preload=not args.no_preload)  # fmt: skip
            finally:
                with lock:
                    free_workers.append(worker)
            counts = {o: sum(1 for r in results.values() if r["outcome"] == o) for o in OUTCOMES}
            with lock:
                measured.update(results)
                done.append(test_file)
                _save(results_path, args.engine, [f for f in files if f in done], measured, time.monotonic() - started)
                print(f"{time.monotonic() - t0:7.1f}s  {test_file}  " + _tally(counts), flush=True)

        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(one, files))
    elapsed = time.monotonic() - started
    _save(results_path, args.engine, files, measured, elapsed)
    totals = {o: sum(1 for r in measured.values() if r["outcome"] == o) for o in OUTCOMES}
    print(f"{elapsed:.0f}s in all  {_tally(totals)}; results in {results_path}")
    return _conclude(expected, args.engine, files, measured, args.update)


def files_to_run(expected: Expected, every: list[str], requested: list[str] | None, *,
                 all_files: bool = False) -> tuple[list[str], list[str]]:  # fmt: skip
    """The files to run and, apart, those asked for that the archive does not hold. The list may declare files
    ``run`` that an older archive lacks (the shared archive is extended after the list): those are skipped, so
    that the run compares what it can until the archive has them."""
    wanted = requested or (sorted(set(every) | set(expected.run_files())) if all_files else expected.run_files())
    return [f for f in wanted if f in every], [f for f in wanted if f not in every]


def _tally(counts: dict[str, int]) -> str:
    """``outcome=N`` per outcome seen: a test runner's summary line ("N passed, N failed") would be read by CI as
    this run's verdict, which is the comparison with the list, not how many DeepSpeed tests torsh passes."""
    return " ".join(f"{o}={n}" for o, n in counts.items() if n)


def _save(path: Path, engine: str, files: list[str], measured: dict[str, dict], seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"engine": engine, "files": files, "seconds": round(seconds), "tests": measured},
                               indent=1, sort_keys=True))  # fmt: skip


def _conclude(expected: Expected, engine: str, files: list[str], measured: dict[str, dict], write: bool) -> int:
    if write:
        update(expected, engine, files, measured)
        expected.write()
        todo = [n for n, r in expected.rows.items() if r["reason"].startswith("TODO")]
        print(f"{EXPECTED.name}: {engine}'s column rewritten for {len(files)} files"
              + (f"; {len(todo)} rows need their reason (TODO)" if todo else ""))  # fmt: skip
        return 0
    differences = compare(expected, engine, files, measured)
    if differences:
        print(f"\n{len(differences)} outcomes differ from {EXPECTED.name} ({engine}'s column; after a deliberate "
              "change re-record with `make conformance UPDATE=1` and review the diff):\n" + "\n".join(differences))
        return 1
    print(f"every outcome is the one {EXPECTED.name} expects")
    return 0


if __name__ == "__main__":
    sys.exit(main())
