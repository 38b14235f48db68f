""""auto" everywhere: every command and every target on configs that hold the Hugging Face "auto" convention.

Carried where the target accepts it (DeepSpeed JSON, Accelerate's inline deepspeed_config), resolved with a note
where the value is known, otherwise left out with a deferred note naming who sets it - never a crash, and never
an "auto" in a file whose consumer cannot read it.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from torsh import adapters, cli, parity
from torsh.config import AUTO
from torsh.translate import Fidelity, holds_auto

HERE = Path(__file__).parent
AUTO_DIR = HERE / "fixtures" / "consumer" / "auto"
AUTO_FILES = sorted(AUTO_DIR.iterdir())
ROOT = HERE.parent
_SUFFIXES = (".json", ".yaml", ".yml", ".toml", ".conf")
#: The migration examples (the corpus goes through every command in tests/test_corpus_property.py; here only
#: through parity, which that test leaves out).
ALL_FILES = sorted(p for p in (ROOT / "migration_examples").rglob("*") if p.suffix in _SUFFIXES)
CORPUS_FILES = sorted(p for p in (HERE / "fixtures" / "corpus").rglob("*") if p.suffix in _SUFFIXES)
#: (dialect, version) of every writer whose consumer has no "auto".
NO_AUTO_TARGETS = [("fsdp", "fsdp1"), ("fsdp", "fsdp2"), ("fairscale", None), ("accelerate", "fsdp1"),
                   ("accelerate", "fsdp2"), ("accelerate", "ddp")]  # fmt: skip


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def no_launch(monkeypatch):
    """parity without its processes: the runs return one record per scenario, so only the set-up is exercised."""
    seen = []

    def fake_run(scenarios, engine, **kwargs):
        seen.extend((engine, s.config) for s in scenarios)
        record = {"step": 1, "loss": 1.0, "grad_norm": 1.0, "lr": 0.1, "loss_scale": 1.0, "skipped": False}
        return {"scenarios": {s.name: {"records": [record]} for s in scenarios}}

    monkeypatch.setattr(parity, "run", fake_run)
    return seen


def commands(path: Path, tmp_path: Path) -> list[list[str]]:
    out = str(tmp_path / "out")
    argv = [["validate", str(path)], ["explain", str(path)], ["explain", str(path), "--report", "json"],
            ["snippet", str(path)], ["parity", str(path), "--steps", "1"]]  # fmt: skip
    for target in adapters.names():
        argv.append(["convert", str(path), "--to", target, "-o", out, "--force"])
    for version in ("fsdp1", "fsdp2", "deepspeed", "ddp"):
        argv.append(["convert", str(path), "--to", "accelerate", "--variant", version, "-o", out, "--force"])
    return argv


@pytest.mark.parametrize("path", AUTO_FILES + ALL_FILES, ids=lambda p: p.name[:60])
def test_every_command_and_target_ends_in_a_result_or_a_config_error(path, tmp_path, no_launch):
    for argv in commands(path, tmp_path):
        code, _, err = run_cli(argv)  # an exception other than ConfigError would propagate and fail here
        assert code in (0, 2), (argv, code, err)
        if code == 2:
            assert "error:" in err and "Traceback" not in err, (argv, err)


@pytest.mark.parametrize("path", AUTO_FILES, ids=lambda p: p.name)
def test_auto_files_are_read(path):
    translation = adapters.load(path)
    assert translation.result.deferred_paths() or any(n.fidelity is Fidelity.DEFERRED for n in translation.notes)


@pytest.mark.parametrize("path", CORPUS_FILES, ids=lambda p: str(p.relative_to(HERE)))
def test_parity_setup_ends_in_a_result_or_a_config_error_for_every_corpus_file(path, no_launch, monkeypatch):
    monkeypatch.chdir(path.parent)
    code, _, err = run_cli(["parity", path.name, "--steps", "1"])
    assert code in (0, 2), (path, code, err)
    assert code == 0 or ("error:" in err and "Traceback" not in err), err


@pytest.mark.parametrize("target", NO_AUTO_TARGETS, ids=lambda t: "-".join(filter(None, t)))
@pytest.mark.parametrize("path", AUTO_FILES, ids=lambda p: p.name)
def test_no_auto_reaches_a_consumer_that_cannot_read_it(path, target):
    cfg = adapters.load(path).result
    written = adapters.write(cfg, target[0], version=target[1])
    assert not holds_auto(written.result), written.result
    for path_ in cfg.deferred_paths():
        section = path_.split(".")[0]
        assert any(n.source_path.startswith(section) for n in written.notes), (path_, written.notes)


def test_auto_is_carried_to_deepspeed_and_to_accelerate_inline_deepspeed():
    cfg = adapters.load(AUTO_DIR / "deepspeed_zero3_hf_auto.json").result
    ds = adapters.write(cfg, "deepspeed").result
    assert ds["train_micro_batch_size_per_gpu"] == "auto" and ds["bf16"]["enabled"] == "auto"
    assert ds["scheduler"]["params"]["warmup_max_lr"] == "auto"
    acc = adapters.write(cfg, "accelerate", version="deepspeed")
    assert acc.result["deepspeed_config"]["zero_stage"] == 3
    assert "mixed_precision" not in acc.result
    note = next(n for n in acc.notes if n.source_path == "precision.param_dtype")
    assert note.fidelity is Fidelity.DEFERRED and "--mixed_precision" in note.reason


def test_zero_stage_auto_is_read_as_the_stage_accelerate_fills_in():
    translation = adapters.read({"train_batch_size": 8, "zero_optimization": {"stage": "auto"}}, "deepspeed")
    assert translation.result.sharding.stage == 2
    note = next(n for n in translation.notes if n.source_path == "zero_optimization.stage")
    assert note.fidelity is Fidelity.APPROXIMATE and "Accelerate" in note.reason


def test_hybrid_auto_is_resolved_from_the_processes_per_node_when_known():
    cfg = adapters.load(AUTO_DIR / "torsh_hybrid_auto.json").result
    assert cfg.sharding.hybrid_shard_size is AUTO
    mesh = adapters.write(cfg, "fsdp", version="fsdp2").result["fully_shard"]["mesh"]
    assert mesh["shape"] == [-1, 8]
    unknown = adapters.load(AUTO_DIR / "fsdp2_mesh_auto.json").result
    written = adapters.write(unknown, "fsdp", version="fsdp2")
    assert "mesh" not in written.result.get("fully_shard", {})
    note = next(n for n in written.notes if n.source_path == "sharding.hybrid_shard_size")
    assert note.fidelity is Fidelity.DEFERRED and "LOCAL_WORLD_SIZE" in note.reason


def test_snippet_with_auto_precision_and_mesh_is_valid_python():
    from torsh.adapters.fsdp import snippet

    code = snippet(adapters.load(AUTO_DIR / "fsdp2_mesh_auto.json").result)
    compile(code, "snippet", "exec")
    assert "LOCAL_WORLD_SIZE" in code and "MixedPrecisionPolicy(param_dtype=..." in code


def test_parity_resolves_auto_from_its_scenario(no_launch):
    code, out, err = run_cli(["parity", str(HERE / "fixtures" / "corpus" / "deepspeed" /
                                          "huggingface__transformers__ds_config_zero2.json"), "--steps", "5"])
    assert code == 0, err
    (engine, reference), = [(e, c) for e, c in no_launch if e == "deepspeed"][:1]
    assert not holds_auto(reference)
    assert reference["train_batch_size"] == reference["train_micro_batch_size_per_gpu"] * 2
    assert reference["scheduler"]["params"]["warmup_max_lr"] == reference["optimizer"]["params"]["lr"]
    assert "auto" in out and "train_micro_batch_size_per_gpu" in out  # the filled values are printed as notes
    candidate = [c for e, c in no_launch if e == "torsh"][0]
    assert not holds_auto(candidate)


def test_parity_resolution_follows_deepspeed_batch_rule():
    resolved, notes = parity.resolve_auto({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto",
                                           "gradient_accumulation_steps": 2}, nproc=2, steps=3)  # fmt: skip
    assert resolved["train_micro_batch_size_per_gpu"] == 8 and len(notes) == 1
    resolved, _ = parity.resolve_auto({"pipeline": {"stages": "auto"}, "zero_optimization": {"stage": "auto"}},
                                      nproc=2, steps=3)
    assert resolved["pipeline"]["stages"] == "auto" and resolved["zero_optimization"]["stage"] == 2


def test_explain_json_with_auto_is_json():
    code, out, _ = run_cli(["explain", str(AUTO_DIR / "deepspeed_every_auto.json"), "--report", "json"])
    assert code == 0 and json.loads(out)["deferred"]


@pytest.mark.slow
def test_parity_runs_a_config_of_auto_values_under_real_deepspeed_and_torsh(tmp_path):
    pytest.importorskip("deepspeed", reason="the reference run is real DeepSpeed")
    report = parity.check_config(str(AUTO_DIR / "deepspeed_hf_trainer_auto.json"), steps=2, workdir=tmp_path)
    assert report.passed, report.comparison
    assert any(n.startswith("train_micro_batch_size_per_gpu: \"auto\" -> 4") for n in report.comparison.notes)
