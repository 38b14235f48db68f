"""Real torchtitan job configs, torchtitan's own and forks', read as torchtitan without being told the dialect.

torchtitan's llama3 files (its last TOML versions, before torchtitan 0.3 moved to Python config classes) read with a
note for every key. Files of forks built on older torchtitan versions (llama-mimi, YNNtitan) are still recognised as
torchtitan: what is refused is each key torchtitan 0.2.2 does not define, where it is, saying which torchtitan read
it (and what it is called now) or that it is the fork's own - never a native-torsh "unknown key 'job'".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torsh import adapters
from torsh.errors import ConfigError
from torsh.formats import load_file
from torsh.translate import Fidelity

CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus" / "torchtitan"
_FORK = "torchtitan 0.2.2 defines no such"


def _read(name: str):
    raw, _ = load_file(CORPUS / name)
    assert adapters.sniff(raw) == "torchtitan"
    return adapters.load(CORPUS / name)


def _findings(name: str) -> dict[str, str]:
    raw, _ = load_file(CORPUS / name)
    assert adapters.sniff(raw) == "torchtitan"
    with pytest.raises(ConfigError) as exc:
        adapters.load(CORPUS / name)
    assert exc.value.source.endswith(name)
    return {p.path: p.reason + (f" (did you mean {p.suggestion}?)" if p.suggestion else "") for p in exc.value.problems}


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


# ---- forks ----------------------------------------------------------------------------------------------------------

#: What llama-mimi's files hold that torchtitan 0.2.2 does not define: keys of the torchtitan it forked (mid-2025),
#: and its own.
_MIMI = {
    "training.compile": "torchtitan 0.1.0", "validation.enabled": "between 0.1.0 and 0.2.0",
    "checkpoint.enable_checkpoint": "torchtitan 0.1.0", "float8": "torchtitan 0.1.0",
    "lr_scheduler.lr_min": "torchtitan 0.1.0", "model.num_quantizers": _FORK, "training.task": _FORK,
    "evaluation": _FORK,
}  # fmt: skip


@pytest.mark.parametrize("name", ["llm-jp__llama-mimi__llama3_1_8b.toml", "llm-jp__llama-mimi__llama3_2_1b.toml"])
def test_llama_mimis_files_are_torchtitan_with_a_finding_for_each_key_torchtitan_0_2_2_lacks(name):
    findings = _findings(name)
    assert set(findings) == set(_MIMI)
    for path, said in _MIMI.items():
        assert said in findings[path], (path, findings[path])
    assert "min_lr_factor" in findings["lr_scheduler.lr_min"] and "checkpoint.enable" in findings[
        "checkpoint.enable_checkpoint"]  # fmt: skip
    assert "custom_config_module" in findings["training.task"]


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


def test_ynntitans_chemlactica_file_is_torchtitan_with_a_finding_for_each_key_torchtitan_0_2_2_lacks():
    findings = _findings("YerevaNN__YNNtitan__chemlactica_125m.toml")
    assert set(findings) == _YNN_OLD | _YNN_OWN
    assert all("torchtitan 0.2.2 refuses" in findings[k] for k in _YNN_OLD)
    assert all(_FORK in findings[k] for k in _YNN_OWN)
    assert "parallelism.data_parallel_shard_degree" in findings["training.data_parallel_degree"]
    assert "before 0.1.0" in findings["training.batch_size"]
