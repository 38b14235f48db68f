"""Which files of a DeepSpeed checkpoint directory the reader takes, and the directories it refuses before reading
any file: pipeline-parallel files, another model-parallel size than the engine's, gaps in the ranks, no model
states."""

from __future__ import annotations

from pathlib import Path

import pytest

from torsh.engine.checkpoint.io import CheckpointError
from torsh.engine.checkpoint.from_deepspeed import _Layout


def _dir(tmp_path: Path, *names: str) -> Path:
    for name in names:
        (tmp_path / name).write_bytes(b"")
    return tmp_path


def test_stage_1_2_layout_takes_the_model_file_and_the_optimizer_files_in_rank_order(tmp_path):
    root = _dir(tmp_path, "mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                "zero_pp_rank_0_mp_rank_00_optim_states.pt", "notes.txt")  # fmt: skip
    layout = _Layout(root)
    assert layout.model_files == [root / "mp_rank_00_model_states.pt"]
    assert [f.name for f in layout.optim_files] == ["zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                   "zero_pp_rank_1_mp_rank_00_optim_states.pt"]  # fmt: skip


def test_stage_3_layout_takes_the_per_rank_model_files_and_bf16_optimizer_files(tmp_path):
    root = _dir(tmp_path, "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt",
                "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    layout = _Layout(root)
    assert [f.name for f in layout.model_files] == ["zero_pp_rank_0_mp_rank_00_model_states.pt",
                                                   "zero_pp_rank_1_mp_rank_00_model_states.pt"]  # fmt: skip
    assert [f.name for f in layout.optim_files] == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                   "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]  # fmt: skip


def test_model_parallel_layout_takes_the_files_of_its_own_model_parallel_rank(tmp_path):
    """Under an mpu each model-parallel rank reads its ``mp_rank_XX`` files only (DeepSpeed's names)."""
    root = _dir(tmp_path, "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt")
    layout = _Layout(root, 1, 2)
    assert layout.model_files == [root / "mp_rank_01_model_states.pt"]
    assert [f.name for f in layout.optim_files] == ["zero_pp_rank_0_mp_rank_01_optim_states.pt"]
    (tmp_path / "gap").mkdir()
    with pytest.raises(CheckpointError, match=r"ranks \[0, 2\] \(mp_rank_XX\), expected 0..2"):
        _Layout(_dir(tmp_path / "gap", "mp_rank_00_model_states.pt", "mp_rank_02_model_states.pt"), 0, 3)


@pytest.mark.parametrize(("names", "message"), [
    (["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"],
     r"holds the files of 2 model-parallel rank\(s\) \(mp_rank_00..mp_rank_01\) but this engine has model-parallel "
     r"size 1"),
    (["mp_rank_00_model_states.pt", "layer_01-model_states.pt"],
     r"layer_01-model_states.pt is not a DeepSpeed data-parallel checkpoint file"),
    (["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
      "zero_pp_rank_2_mp_rank_00_optim_states.pt"],
     r"is incomplete: optimizer files for ranks \[0, 2\] \(expected 0..1\)"),
    (["zero_pp_rank_0_mp_rank_00_optim_states.pt"], r"has no mp_rank_00_model_states.pt"),
    (["zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
     r"is incomplete: model files for ranks \[1\]$"),
])  # fmt: skip
def test_refused_layouts_are_errors_naming_the_file_or_directory(tmp_path, names, message):
    with pytest.raises(CheckpointError, match=message):
        _Layout(_dir(tmp_path, *names))


def test_missing_optimizer_ranks_are_reported_before_missing_model_files(tmp_path):
    root = _dir(tmp_path, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match=r"optimizer files for ranks \[1\]"):
        _Layout(root)
