"""The list ``make conformance`` compares DeepSpeed's unit tests with (``deepspeed_unit_results.tsv``) is well formed.

The tests themselves run in ``make conformance`` (``tests/conformance/run_deepspeed.py``), not here: this only
reads the list, so that an edit that would break the comparison fails ``make test`` at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "conformance"))

from run_deepspeed import ENGINES, OUTCOMES, Expected, file_of  # noqa: E402


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
