"""Every input that ever crashed a reader, writer, ``explain``, ``snippet`` or a parser, replayed.

The inputs live in tests/fixtures/fuzz_regressions/<dialect>/ (written by ``fuzz_long.py``). One whose crash is
in a file with open crashes (``test_fuzz_readers.OPEN``) is an xfail naming it; any other crash fails.
"""

from pathlib import Path

import pytest

from fuzz_long import REGRESSIONS, Crash, Runner, load_fixtures, replay
from test_fuzz_readers import judge

FIXTURES = load_fixtures()


def _id(crash: Crash) -> str:
    return f"{crash.dialect}-{crash.stage}-{crash.exception}"


#: Seconds a replayed hang may take before it counts as still hanging.
HANG_TIMEOUT = 5


@pytest.mark.parametrize("crash", FIXTURES, ids=[_id(c) for c in FIXTURES])
def test_crashing_input_now_raises_only_config_errors(crash):
    if crash.stage != "hang":
        judge(replay(crash))
        return
    # A hang is replayed in a worker process with a time limit, so a hang that is still there cannot stop the suite.
    runner = Runner(HANG_TIMEOUT)
    try:
        kind = "text" if crash.dialect.startswith("parse-") else "input"
        found = runner.run(kind, crash.dialect.removeprefix("parse-"), crash.input)
    finally:
        runner.close()
    judge([crash] if found is None else found)


def test_fixture_folder_exists_and_fixtures_load():
    assert Path(REGRESSIONS).is_dir()
    assert FIXTURES, "no regression fixture loaded"
