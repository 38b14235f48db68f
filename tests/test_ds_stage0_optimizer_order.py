"""ZeRO stage-0 checkpoints between real DeepSpeed 0.19.8 and torsh with an optimizer of two parameter groups, the
no-decay group (biases, LayerNorm) first as Hugging Face builds them (2 gloo ranks, data-parallel).

DeepSpeed's stage-0 optimizer state is the torch optimizer's ``state_dict()``: its parameters are numbered in
the order of the optimizer's groups, not the model's. torsh reads it in that order (DeepSpeed -> torsh), and
writes its own optimizer's ``state_dict()`` into ``mp_rank_00_model_states.pt`` so that DeepSpeed's default
``load_checkpoint`` (optimizer state included) resumes a torsh checkpoint (torsh -> DeepSpeed). Either way the
resumed run's losses are those of the run that saved.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is installed by requirements-dev.txt in CI")

import _engine_harness as h  # noqa: E402

SAVE_AT, STEPS = 2, 4
CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 0}}


def _engine(backend: str, seed: int):
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    optimizer = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0},
                                   {"params": decay, "weight_decay": 0.1}], lr=0.01)  # fmt: skip
    engine, *_ = h.backend(backend).initialize(model=model, optimizer=optimizer, config=dict(CONFIG))
    return engine


def _steps(engine, rank: int, steps) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _saved_and_resumed(rank: int, saver: str, loader: str, root: Path) -> dict:
    """``saver`` trains, saves at step 2 and trains on; ``loader`` (other initial weights) loads and trains on."""
    first = _engine(saver, seed=0)
    _steps(first, rank, range(SAVE_AT))
    first.save_checkpoint(str(root), tag="t")
    continued = _steps(first, rank, range(SAVE_AT, STEPS))
    second = _engine(loader, seed=7)
    second.load_checkpoint(str(root), tag="t")  # optimizer state included (DeepSpeed's default)
    return {"continued": continued, "resumed": _steps(second, rank, range(SAVE_AT, STEPS))}


def both_ways(rank: int, world_size: int, scenario: dict) -> dict:  # noqa: ARG001
    root = Path(scenario["dir"])
    return {"ds_to_torsh": _saved_and_resumed(rank, "deepspeed", "torsh", root / "ds"),
            "torsh_to_ds": _saved_and_resumed(rank, "torsh", "deepspeed", root / "torsh")}  # fmt: skip


@pytest.fixture(scope="module")
def records() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out")
        out.mkdir()
        h.spawn([{"name": "both", "dir": tmp}], 2, str(out), runner=both_ways)
        return h.ranks_of([json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], "both")


@pytest.mark.parametrize("direction", ["ds_to_torsh", "torsh_to_ds"])
def test_stage0_optimizer_state_of_two_groups_resumes_the_other_engine(records, direction):
    """DeepSpeed's stage-0 checkpoint resumes in torsh with DeepSpeed's losses (its optimizer state mapped by the
    groups' order: in the model's order the first state, a bias's, would meet ``0.weight``); torsh's resumes in
    DeepSpeed with torsh's losses (its model-states file carries the optimizer state DeepSpeed loads)."""
    for rank, rec in enumerate(records):
        run = rec[direction]
        assert run["resumed"] == pytest.approx(run["continued"], rel=1e-6, abs=0), f"rank {rank}: {run}"
