"""Syntax errors in a config name file:line:column and the parser's own problem, in every format."""

from __future__ import annotations

import re

import pytest

from torsh.cli import EXIT_BAD_INPUT, main

CASES = [
    # (file name, text, line, column, words of the parser's problem)
    ("bad.yaml", "train_batch_size: 8\nzero: [1, 2\nfp16: 3\n", 3, 5, "flow sequence"),
    ("bad.json", '{"train_batch_size": 8,\n "fp16": }\n', 2, 10, "Expecting value"),
    ("bad.toml", "train_batch_size = 8\nfp16 = = 2\n", 2, 8, "Invalid value"),
    ("end.toml", "train_batch_size = 8\nzero = [\n", 3, 1, "end of the file"),
]


@pytest.mark.parametrize(("name", "text", "line", "column", "words"), CASES, ids=[c[0] for c in CASES])
def test_syntax_error_names_file_line_and_column(tmp_path, capsys, name, text, line, column, words):
    path = tmp_path / name
    path.write_text(text)
    assert main(["validate", str(path)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"{path}:{line}:{column}: not valid {name.split('.')[1].upper()}: " in err, err
    assert words in err
    assert "(got" not in err and "None" not in err
    assert "Traceback" not in err


def test_syntax_error_carries_no_value():
    from torsh.errors import MISSING, ConfigError
    from torsh.formats import parse_text

    with pytest.raises(ConfigError) as caught:
        parse_text("a: [1\n", "yaml")
    problem = caught.value.problems[0]
    assert problem.value is MISSING
    assert (problem.line, problem.column) == (2, 1)
    assert re.search(r"^line 2, column 1: not valid YAML: ", str(problem))
