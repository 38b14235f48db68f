"""The list ``make conformance`` compares DeepSpeed's unit tests with (``deepspeed_unit_results.tsv``) is well formed.

The tests themselves run in ``make conformance`` (``tests/conformance/run_deepspeed.py``), not here: this only
reads the list, so that an edit that would break the comparison fails ``make test`` at once.
"""

from __future__ import annotations

import io
import signal
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "conformance"))

from extend_archive import closure, imported_helpers  # noqa: E402
from run_deepspeed import ENGINES, OUTCOMES, Expected, file_of, files_to_run, main  # noqa: E402


def test_every_row_has_known_outcomes_and_a_reason_for_each_difference():
    expected = Expected()
    assert expected.rows, "no rows"
    problems = []
    for name, row in expected.rows.items():
        for engine in ENGINES:
            if row[engine] not in OUTCOMES:
                problems.append(f"{name}: {engine} outcome {row[engine]!r} is not one of {OUTCOMES}")
        if row["reason"].startswith("TODO"):
            problems.append(f"{name}: give the reason ({row['reason'][:80]})")
        recorded = row["deepspeed"] != "not-run"
        if recorded and row["torsh"] != row["deepspeed"] and not row["reason"]:
            problems.append(f"{name}: DeepSpeed {row['deepspeed']}, torsh {row['torsh']}, and no reason")
        if row["counted"] != ("yes" if row["deepspeed"] == "passed" else "no"):
            problems.append(f"{name}: counted must be yes exactly where DeepSpeed passes")
    assert not problems, "\n".join(problems)


def test_files_are_declared_run_or_excluded_with_the_reason():
    expected = Expected()
    assert expected.run_files(), "no file is declared run"
    for name, (status, reason) in expected.files.items():
        assert name.startswith("unit/") and name.endswith(".py"), name
        assert status in ("run", "excluded"), f"{name}: {status}"
        assert status == "run" or reason, f"{name}: say why it is excluded"
    run = set(expected.run_files())
    for name in expected.rows:
        assert file_of(name) in expected.files, f"{name}: its file has no #file line"
    assert any(file_of(n) in run for n in expected.rows), "no row of a run file"


def test_files_the_list_runs_that_the_archive_lacks_are_skipped_and_named(tmp_path):
    expected = Expected()
    run = expected.run_files()
    every = run[1:] + ["unit/other/test_x.py"]
    files, absent = files_to_run(expected, every, None)
    assert files == run[1:] and absent == run[:1]
    files, absent = files_to_run(expected, every, None, all_files=True)
    assert set(files) == set(every) and absent == run[:1]
    files, absent = files_to_run(expected, every, [run[0], "unit/other/test_x.py"])
    assert files == ["unit/other/test_x.py"] and absent == run[:1]


def test_a_run_with_an_archive_lacking_every_listed_file_passes_and_says_so(tmp_path, capsys, monkeypatch):
    """CI runs the list with the shared archive, which may hold fewer files than the list declares run."""
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the runner's handlers are not for this process
    archive = tmp_path / "deepspeed-tests-edaa722.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"def test_nothing():\n    pass\n"
        info = tarfile.TarInfo("deepspeed-tests-edaa722/tests/unit/other/test_x.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert main(["--archive", str(archive), "--results", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert out.count("not in the archive") == 1
    assert f"skipped: {len(Expected().run_files())} files" in out
    # Named explicitly, a file the archive lacks is an error.
    assert main(["--archive", str(archive), "--results", str(tmp_path / "out.json"),
                 "--files", Expected().run_files()[0]]) == 2  # fmt: skip


def test_extend_archive_takes_each_test_file_with_the_helpers_it_imports():
    sources = {
        "tests/unit/__init__.py": "",
        "tests/unit/common.py": "import os\n",
        "tests/unit/util.py": "from unit.common import x\n",
        "tests/unit/alexnet_model.py": "from .util import y\n",
        "tests/unit/simple_model.py": "import torch\n",
        "tests/unit/v1/moe/__init__.py": "",
        "tests/unit/v1/moe/test_moe.py": "from unit.simple_model import *\nfrom unit.alexnet_model import A\n",
        "tests/unit/pipe/test_pipe.py": "def f():\n    import unit.common\n",
    }
    assert imported_helpers("tests/unit/alexnet_model.py", sources["tests/unit/alexnet_model.py"]) >= {
        "tests/unit/util.py"}  # fmt: skip
    found = closure(["tests/unit/v1/moe/test_moe.py", "tests/unit/pipe/test_pipe.py"], sources.get)
    assert set(found) == set(sources)


def test_a_file_that_does_not_import_on_the_second_engine_recorded_is_absent_on_the_first(tmp_path):
    """DeepSpeed's column recorded first (its tests ran), then torsh's with the file not importing: the file's own
    row says DeepSpeed has no such row (absent), not that DeepSpeed was not run."""
    from run_deepspeed import COLUMNS, update

    path = tmp_path / "list.tsv"
    path.write_text("#file\tunit/a/test_x.py\trun\n" + "\t".join(COLUMNS) + "\n")
    expected = Expected(path)
    update(expected, "deepspeed", ["unit/a/test_x.py"],
           {"unit/a/test_x.py::test_one": {"outcome": "passed", "message": "", "seconds": 1}})  # fmt: skip
    update(expected, "torsh", ["unit/a/test_x.py"],
           {"unit/a/test_x.py": {"outcome": "error", "message": "E   ImportError: no name", "seconds": None}})  # fmt: skip
    assert expected.rows["unit/a/test_x.py"]["deepspeed"] == "absent"
    assert expected.rows["unit/a/test_x.py::test_one"]["torsh"] == "error"
