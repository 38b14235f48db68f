"""Real torchtitan job configs, torchtitan's own and forks', read as torchtitan without being told the dialect.

torchtitan's llama3 files (its last TOML versions, before torchtitan 0.3 moved to Python config classes) read with a
note for every key. Files of forks built on older torchtitan versions (llama-mimi, YNNtitan) are recognised as
torchtitan and read too: each key torchtitan 0.2.2 does not define is a dropped note where it is, saying which
torchtitan read it (and what it is called now) or that it is the fork's own, and ``--strict`` fails on it as
torchtitan 0.2.2 refuses the file for it - never a native-torsh "unknown key 'job'".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torsh import adapters
from torsh.cli import main
from torsh.formats import load_file
from torsh.translate import Fidelity

CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus" / "torchtitan"
_FORK = "torchtitan 0.2.2 defines no such"


def _read(name: str):
    raw, _ = load_file(CORPUS / name)
    assert adapters.sniff(raw) == "torchtitan"
    return adapters.load(CORPUS / name)


def _dropped(t) -> dict[str, str]:
    """The notes of the keys torchtitan 0.2.2 does not define: dropped where they are, lossy (refused by torchtitan)."""
    notes = {n.source_path: n for n in t.notes if n.refused}
    assert all(n.fidelity is Fidelity.DROPPED and n.target_path is None and n.lossy for n in notes.values())
    return {path: n.reason for path, n in notes.items()}


def _validate(name: str, capsys, *flags: str) -> tuple[int, dict]:
    """``torsh-migrate validate --report json`` on a corpus file: the exit code and the file's JSON result."""
    capsys.readouterr()
    code = main(["validate", "--report", "json", *flags, str(CORPUS / name)])
    (result,) = json.loads(capsys.readouterr().out)["files"]
    return code, result


def _notes(t, section: str) -> dict:
    return {n.source_path: n for n in t.notes if n.source_path.startswith(section + ".")}


def _no_effect(t, section: str, what: str) -> None:
    """Every key of a section that configures the job but not its distribution: an ignored note saying so."""
    notes = _notes(t, section)
    assert notes and all(n.fidelity is Fidelity.IGNORED and n.target_path is None for n in notes.values())
    assert all(what in n.reason and "distributed" in n.reason for n in notes.values()), notes


# ---- torchtitan's own files ---------------------------------------------------------------------------------------


def test_torchtitans_llama3_debug_model_reads_with_a_note_for_every_key():
    t = _read("pytorch__torchtitan__llama3__debug_model.toml")
    assert (t.result.sharding.stage, t.result.parallelism.tp) == (3, 1)
    assert t.result.activation_checkpointing.enabled
    for section, what in (("validation", "held-out"), ("lr_scheduler", "learning-rate"), ("metrics", "logged")):
        _no_effect(t, section, what)


def test_torchtitans_llama3_70b_reads_its_tensor_parallelism_and_notes_validation():
    t = _read("pytorch__torchtitan__llama3__llama3_70b.toml")
    assert (t.result.sharding.stage, t.result.parallelism.tp) == (3, 8)
    _no_effect(t, "validation", "held-out")


def test_torchtitans_llama3_405b_reads_its_tensor_parallelism_and_notes_validation():
    t = _read("pytorch__torchtitan__llama3__llama3_405b.toml")
    assert (t.result.sharding.stage, t.result.parallelism.tp) == (3, 8)
    _no_effect(t, "validation", "held-out")
    assert _notes(t, "parallelism")["parallelism.enable_async_tensor_parallel"].fidelity is Fidelity.IGNORED


#: What --strict fails on in torchtitan's own files: what torsh runs differently, never a key it does not know.
_UPSTREAM_LOSSY = {
    "pytorch__torchtitan__llama3__debug_model.toml": {"compile.enable", "activation_checkpoint.mode"},
    "pytorch__torchtitan__llama3__llama3_70b.toml": {"compile.enable", "parallelism.tensor_parallel_degree"},
    "pytorch__torchtitan__llama3__llama3_405b.toml": {"compile.enable", "parallelism.tensor_parallel_degree"},
}


@pytest.mark.parametrize("name", sorted(_UPSTREAM_LOSSY))
def test_torchtitans_own_files_have_no_unknown_key_and_strict_names_only_what_torsh_runs_differently(name, capsys):
    t = _read(name)
    assert _dropped(t) == {}
    assert {n.source_path for n in t.lossy} == _UPSTREAM_LOSSY[name]
    code, result = _validate(name, capsys, "--strict")
    assert (code, result["valid"], result["dialect"]) == (1, True, "torchtitan")
    assert not [n for n in result["report"]["notes"] if n["refused"]]


# ---- forks ----------------------------------------------------------------------------------------------------------

#: What llama-mimi's files hold that torchtitan 0.2.2 does not define: keys of the torchtitan it forked (mid-2025),
#: and its own.
_MIMI = {
    "training.compile": "torchtitan 0.1.0", "validation.enabled": "between 0.1.0 and 0.2.0",
    "checkpoint.enable_checkpoint": "torchtitan 0.1.0", "float8": "torchtitan 0.1.0",
    "lr_scheduler.lr_min": "torchtitan 0.1.0", "model.num_quantizers": _FORK, "training.task": _FORK,
    "evaluation": _FORK,
}  # fmt: skip


_MIMI_FILES = ["llm-jp__llama-mimi__llama3_1_8b.toml", "llm-jp__llama-mimi__llama3_2_1b.toml"]


@pytest.mark.parametrize("name", _MIMI_FILES)
def test_llama_mimis_files_read_as_torchtitan_with_a_note_for_each_key_torchtitan_0_2_2_lacks(name):
    t = _read(name)
    dropped = _dropped(t)
    assert set(dropped) == set(_MIMI)
    for path, said in _MIMI.items():
        assert said in dropped[path], (path, dropped[path])
    assert "did you mean 'lr_scheduler.min_lr_factor'?" in dropped["lr_scheduler.lr_min"]
    assert "did you mean 'checkpoint.enable'?" in dropped["checkpoint.enable_checkpoint"]
    assert "custom_config_module" in dropped["training.task"]
    # the rest is torchtitan 0.2.2's: FSDP over every rank, its batch sizes and clipping, no activation checkpointing
    cfg = t.result
    assert (cfg.sharding.stage, cfg.batch.global_batch_size, cfg.gradients.clip_max_norm) == (3, 1024, 1.0)
    assert cfg.batch.micro_batch_size in (8, 32) and not cfg.activation_checkpointing.enabled
    assert {n.source_path for n in t.lossy} == set(_MIMI)


#: YNNtitan's chemlactica_125m.toml: a torchtitan of autumn 2024 with the fork's own keys.
_YNN_OLD = {
    "job.use_for_integration_test", "metrics.enable_color_printing", "model.norm_type", "training.batch_size",
    "training.warmup_steps", "training.data_parallel_degree", "training.tensor_parallel_degree", "training.compile",
    "experimental.pipeline_parallel_degree", "experimental.enable_async_tensor_parallel",
    "checkpoint.enable_checkpoint", "checkpoint.interval_type", "checkpoint.model_weights_only", "float8",
    "float8.enable_float8_linear",
}  # fmt: skip
_YNN_OWN = {
    "metrics.enable_aim", "metrics.save_aim_folder", "training.gradient_accumulation_steps",
    "training.data_processing_style", "training.representation_type", "validation.valid_freq",
    "validation.enable_valid", "dataloader", "checkpoint.load_folder", "checkpoint.save_folder",
}  # fmt: skip


def test_ynntitans_chemlactica_file_reads_as_torchtitan_with_a_note_for_each_key_torchtitan_0_2_2_lacks():
    t = _read("YerevaNN__YNNtitan__chemlactica_125m.toml")
    dropped = _dropped(t)
    assert set(dropped) == _YNN_OLD | _YNN_OWN
    assert all("torchtitan 0.2.2 refuses" in dropped[k] for k in _YNN_OLD)
    assert all(_FORK in dropped[k] for k in _YNN_OWN)
    assert "did you mean 'parallelism.data_parallel_shard_degree'?" in dropped["training.data_parallel_degree"]
    assert "before 0.1.0" in dropped["training.batch_size"]
    # its 2024 spellings are not read: torchtitan 0.2.2's defaults stand, and --strict says why
    assert (t.result.sharding.stage, t.result.gradients.clip_max_norm) == (3, 1.0)
    assert t.result.batch.micro_batch_size is None
    assert {n.source_path for n in t.lossy} == _YNN_OLD | _YNN_OWN


_FORKS = {**dict.fromkeys(_MIMI_FILES, set(_MIMI)), "YerevaNN__YNNtitan__chemlactica_125m.toml": _YNN_OLD | _YNN_OWN}


@pytest.mark.parametrize("name", sorted(_FORKS))
def test_a_forks_file_is_valid_and_strict_fails_on_exactly_the_keys_torchtitan_0_2_2_lacks(name, capsys):
    code, result = _validate(name, capsys)
    assert (code, result["valid"], result["dialect"]) == (0, True, "torchtitan")
    refused = {n["source_path"]: n for n in result["report"]["notes"] if n["refused"]}
    assert set(refused) == _FORKS[name] and {n["fidelity"] for n in refused.values()} == {"dropped"}
    code, result = _validate(name, capsys, "--strict")
    assert code == 1 and f": {len(_FORKS[name])} lossy key(s):" in result["lossy"]  # those keys, and only them
    capsys.readouterr()
    assert main(["convert", "--to", "deepspeed", "--strict", str(CORPUS / name)]) == 1
    assert main(["convert", "--to", "deepspeed", str(CORPUS / name)]) == 0
