"""One name per option across the torsh-migrate commands; old spellings keep working with a deprecation note."""

from __future__ import annotations

import argparse
import json

from torsh.cli import build_parser, main

SEED = "migration_examples/deepspeed/train_config.json"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("torsh-migrate has no sub-commands")


def _meaning(action: argparse.Action) -> tuple:
    """What an option does, as far as argparse can tell: where it stores, what it accepts, how it acts."""
    choices = tuple(action.choices) if action.choices is not None else None
    return action.dest, choices, type(action).__name__, action.nargs


def test_each_option_name_means_one_thing_across_commands():
    top = build_parser()
    seen: dict[str, dict[tuple, list[str]]] = {}
    for action in top._actions:  # the program's own options (--version) count as a command of their own
        for name in action.option_strings:
            seen.setdefault(name, {}).setdefault(_meaning(action), []).append("torsh-migrate")
    for command, parser in _subparsers(top).items():
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:  # hidden deprecated aliases: checked below
                continue
            for name in action.option_strings:
                if name in ("-h", "--help"):
                    continue
                seen.setdefault(name, {}).setdefault(_meaning(action), []).append(command)
    clashes = {name: meanings for name, meanings in seen.items() if len(meanings) > 1}
    assert not clashes, f"option names with more than one meaning: {clashes}"


def test_report_format_is_spelled_report_everywhere():
    for command, parser in _subparsers(build_parser()).items():
        for action in parser._actions:
            if action.help != argparse.SUPPRESS and action.choices is not None and set(action.choices) == {
                    "table", "json"}:  # fmt: skip
                assert action.option_strings == ["--report"], (command, action.option_strings)


def test_hidden_aliases_store_where_the_new_name_does():
    for command, parser in _subparsers(build_parser()).items():
        visible = {a.dest for a in parser._actions if a.help != argparse.SUPPRESS}
        for action in parser._actions:
            if action.help == argparse.SUPPRESS and action.option_strings:
                assert action.dest in visible, (command, action.option_strings)


def test_explain_format_is_a_deprecated_alias_of_report(capsys):
    assert main(["explain", SEED, "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["dialect"] == "deepspeed"
    assert err.strip().splitlines() == ["note: --format is deprecated; use --report (same meaning)"]
    assert main(["explain", SEED, "--report", "json"]) == 0
    out2, err2 = capsys.readouterr()
    assert out2 == out and err2 == ""


def test_convert_version_is_a_deprecated_alias_of_variant(tmp_path, capsys):
    source = "migration_examples/accelerate/fsdp1_to_fsdp2.yaml"
    new, old = tmp_path / "new.yaml", tmp_path / "old.yaml"
    assert main(["convert", source, "--to", "accelerate", "--variant", "fsdp2", "-o", str(new)]) == 0
    assert "deprecated" not in capsys.readouterr().err
    assert main(["convert", source, "--to", "accelerate", "--version", "fsdp2", "-o", str(old)]) == 0
    assert "note: --version is deprecated; use --variant" in capsys.readouterr().err
    assert new.read_text() == old.read_text()
    assert "fsdp_version: 2" in new.read_text()


def test_help_lists_only_the_new_names(capsys):
    for command, hidden in (("explain", "--format"), ("convert", "--version")):
        try:
            main([command, "--help"])
        except SystemExit:
            pass
        assert hidden not in capsys.readouterr().out


def test_a_wrong_variant_names_the_flag(capsys):
    source = "migration_examples/accelerate/fsdp1_to_fsdp2.yaml"
    assert main(["convert", source, "--to", "accelerate", "--variant", "fsdp3"]) == 2
    err = capsys.readouterr().err
    assert "--variant: expected one of" in err and "fsdp3" in err
