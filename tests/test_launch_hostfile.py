"""Hostfiles of both grammars, host lists, and DeepSpeed's include/exclude rules."""

from __future__ import annotations

import pytest

from torsh.adapters._hostfile import (
    Node,
    format_host_list,
    format_hostfile,
    parse_host_list,
    parse_hostfile,
    parse_node_spec,
    resolve_nodes,
)
from torsh.errors import ConfigError


def test_both_grammars_comments_and_blank_lines():
    text = "\n# GPUs per node\nnode-a slots=8  # rack 1\n\nnode-b:4\n   \nnode-c\n10.0.0.4 slots=2 max_slots=4\n"
    assert parse_hostfile(text) == [("node-a", 8), ("node-b", 4), ("node-c", None), ("10.0.0.4", 2)]


def test_an_empty_or_comment_only_hostfile_is_empty_not_a_crash():
    assert parse_hostfile("") == [] and parse_hostfile("# nothing yet\n\n") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a slots=2\na slots=4\n", "listed twice (first on line 1)"),
        ("a slots=two\n", "hostfile:1"),
        ("a slots=0\n", "at least 1"),
        ("a b c\n", "expected 'host slots=N'"),
    ],
)
def test_bad_lines_name_the_line(text, message):
    with pytest.raises(ConfigError) as err:
        parse_hostfile(text)
    assert message in str(err.value)


def test_written_hostfile_reads_back_in_every_grammar():
    hosts = [("a", 8), ("b", None)]
    assert parse_hostfile(format_hostfile(hosts)) == hosts
    assert parse_host_list(format_host_list([("a", 8), ("b", 2)])) == [("a", 8), ("b", 2)]


def test_node_spec():
    assert parse_node_spec("w0@w1:0,2@w1:3", source="x") == {"w0": [], "w1": [0, 2, 3]}
    with pytest.raises(ConfigError):
        parse_node_spec("w1:a", source="x")


HOSTS = [("w0", 4), ("w1", 4), ("w2", 4)]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, [Node("w0", 4), Node("w1", 4), Node("w2", 4)]),
        ({"include": "w0@w1:0,2"}, [Node("w0", 4), Node("w1", 2, (0, 2))]),
        ({"include": "w2:0,1"}, [Node("w2", 2)]),
        ({"exclude": "w1@w2:3"}, [Node("w0", 4), Node("w2", 3)]),
        ({"exclude": "w0:0"}, [Node("w0", 3, (1, 2, 3)), Node("w1", 4), Node("w2", 4)]),
        ({"num_nodes": 2, "nproc_per_node": 2}, [Node("w0", 2), Node("w1", 2)]),
        ({"world_size": 6}, [Node("w0", 4), Node("w1", 2)]),
        ({"world_size": 4, "hosts": [("a", None), ("b", None)]}, [Node("a", 2), Node("b", 2)]),
    ],
)
def test_resolution_follows_deepspeed_and_horovod_rules(kwargs, expected):
    hosts = kwargs.pop("hosts", HOSTS)
    assert resolve_nodes(hosts, **kwargs) == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": "w9"}, "not in the hostfile"),
        ({"include": "w0:7"}, "no slot(s) [7]"),
        ({"num_nodes": 4}, "only 3 host(s)"),
        ({"world_size": 13}, "more processes than slots"),
    ],
)
def test_impossible_requests_are_errors(kwargs, message):
    with pytest.raises(ConfigError) as err:
        resolve_nodes(HOSTS, **kwargs)
    assert message in str(err.value)


def test_same_results_as_deepspeeds_own_filter():
    runner = pytest.importorskip("deepspeed.launcher.runner", reason="compares with the real DeepSpeed launcher")
    pool = dict(HOSTS)
    for include, exclude in [("w0@w1:0,2", ""), ("", "w1@w2:3"), ("", "w0:0"), ("w2:1,3", "")]:
        theirs = runner.parse_inclusion_exclusion(pool, include, exclude)
        ours = resolve_nodes(HOSTS, include=include or None, exclude=exclude or None)
        assert [(n.host, list(n.devices or range(n.nproc))) for n in ours] == list(theirs.items())
