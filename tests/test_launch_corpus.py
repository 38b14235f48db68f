"""Real launch lines from public scripts (tests/fixtures/corpus/launch, sources in its SOURCES.md).

Each line reads with every option accounted for, and each translation to every launcher round-trips through the
core model: reading the written command back gives the same script, arguments, environment and topology - or the
writer reported the loss (an unsupported / dropped / approximate note on that field).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from adapter_validator import assert_accounted

from torsh.adapters import _cmdline, launch
from torsh.adapters._hostfile import parse_hostfile
from torsh.adapters._launch_writers import plan
from torsh.config import TorshConfig

CORPUS = Path(__file__).parent / "fixtures" / "corpus" / "launch"
LINES = json.loads((CORPUS / "lines.json").read_text(encoding="utf-8"))
HOSTFILES = sorted(p for p in CORPUS.iterdir() if p.name.endswith("hostfile"))
TOPOLOGY = ("launch.nnodes", "launch.max_nnodes", "launch.nproc_per_node", "launch.world_size", "launch.hosts",
            "launch.hostfile", "launch.include", "launch.exclude", "launch.node_rank")  # fmt: skip


def test_the_corpus_is_large_enough_and_every_line_has_a_source():
    assert len(LINES) >= 15
    sources = (CORPUS / "SOURCES.md").read_text(encoding="utf-8")
    for line in LINES:
        assert line["id"] in sources and line["repo"] and len(line["commit"]) == 40, line["id"]
    for path in HOSTFILES:
        assert path.name in sources


@pytest.mark.parametrize("line", LINES, ids=[line["id"] for line in LINES])
def test_each_line_reads_with_every_option_accounted(line):
    parsed = _cmdline.parse(line["command"])
    translation = launch.read(line["command"])
    assert_accounted(parsed, translation)
    assert translation.result.launch.script
    assert launch.sniff(line["command"]) == 1.0


@pytest.mark.parametrize("path", HOSTFILES, ids=[p.name for p in HOSTFILES])
def test_each_real_hostfile_reads(path):
    hosts = parse_hostfile(path.read_text(encoding="utf-8"))
    assert hosts and all(name for name, _ in hosts)


def _essence(cfg: TorshConfig) -> dict:
    """What must survive a translation: the script, its arguments, the environment and the process layout."""
    L = cfg.launch
    p = plan(L)
    shape = sorted(n.nproc for n in p.nodes) if p.nodes is not None else (str(p.nnodes or 1), str(p.nproc))
    env = {k: v for k, v in L.env.items() if k != "CUDA_VISIBLE_DEVICES"}
    return {"script": L.script, "args": L.script_args, "module": L.module, "env": env,
            "forward_env": sorted(L.forward_env), "shape": shape}  # fmt: skip


def _lines(command: str) -> list[str]:
    return [line for line in command.splitlines() if line and not line.startswith("#")]


@pytest.mark.parametrize("target", launch.VERSIONS)
@pytest.mark.parametrize("line", LINES, ids=[line["id"] for line in LINES])
def test_each_translation_round_trips_through_the_core_model(line, target):
    original = launch.read(line["command"]).result
    written = launch.write(original, version=target)
    command = written.result
    assert command.launcher == target and command.commands
    lost = {n.source_path for n in written.lossy}
    texts = [str(command)] if target in launch.SCHEDULERS else _lines(command)  # a script or manifest: read whole
    backs = [launch.read(text, hostfile=command.files.get("hostfile")).result for text in texts]
    assert len(backs) == len(command.commands)
    want = _essence(original)
    for back in backs:
        got = _essence(back)
        for key in ("script", "args", "module"):
            assert got[key] == want[key], (key, got[key], want[key])
        if not lost & {"launch.env", "launch.forward_env"}:
            assert got["env"] == want["env"]
            if target == "mpirun":  # the others pass the launching shell's whole environment on by themselves
                assert got["forward_env"] == want["forward_env"]
    if not lost & set(TOPOLOGY):
        if len(backs) > 1:  # one command per node: together they are the layout
            assert sorted(b.launch.nproc_per_node for b in backs) == want["shape"]
        else:
            assert _essence(backs[0])["shape"] == want["shape"], written.notes


@pytest.mark.parametrize("line", LINES, ids=[line["id"] for line in LINES])
def test_writing_back_to_the_same_launcher_is_identity(line):
    read = launch.read(line["command"])
    source = read.result.extensions.get("launch", {}).get("program") or next(
        k for k in _cmdline.LAUNCHER_FLAGS if k in _cmdline.parse(line["command"]))
    target = "torchrun" if "torch" in source or source == "tune run" else source
    if target not in launch.VERSIONS:
        pytest.skip(f"{source} is read, not written")
    written = launch.write(read.result, version=target)
    back = launch.read(_lines(written.result)[0]).result
    completed = {"master_addr", "master_port", "node_rank", "nnodes", "hostfile"}  # filled in by the writer when unset
    a = read.result.launch.model_dump()
    b = back.launch.model_dump()
    for key in completed:
        if a[key] is None:
            b[key] = None
    assert a == b
    assert back.extensions == read.result.extensions
