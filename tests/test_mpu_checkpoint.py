"""DeepSpeed checkpoints written under a Megatron-style ``mpu`` (model-parallel size 2) load into torsh, and torsh's
load into DeepSpeed (2 gloo ranks, data-parallel size 1).

DeepSpeed names each model-parallel rank's files by the rank (``mp_rank_01_model_states.pt``, at ZeRO-1/2
``zero_pp_rank_0_mp_rank_01_optim_states.pt``): each rank of a torsh engine built with the same mpu reads its own
and continues with DeepSpeed's losses; real DeepSpeed loads the model states torsh writes per model-parallel
rank (at stage 0 with the optimizer state, which they hold there). A checkpoint with another number of model-parallel ranks than the engine's is a ``CheckpointError`` saying
which sizes differ. The model, mpu, data and config are those of ``tests/test_mpu.py``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import _engine_harness as h  # noqa: E402
import test_mpu as m  # noqa: E402

SAVE_AT = m.STEPS // 2


def _engine(backend: str, mpu, stage: int, seed: int):
    """An engine over the column/row-parallel MLP (initial weights from ``seed``) under ``mpu``; ``mpu`` None:
    the unsplit MLP, data-parallel over both ranks."""
    deepspeed = h.backend(backend)
    model = m.full_mlp(seed)
    if mpu is not None:
        model = m.split_mlp(model, mpu.get_model_parallel_rank(), 2, mpu.get_model_parallel_group())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), mpu=mpu,
                                      config=m.config(stage))  # fmt: skip
    return engine


def _steps(engine, mpu, steps) -> list[float]:
    losses = []
    for step in steps:
        x, y = m.data(step, mpu.get_data_parallel_rank())
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _weights(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _first_run(backend: str, mpu, stage: int, save: Path) -> dict:
    """Train 2 steps, save (tag ``t``), train 2 more: the losses, and the weights saved."""
    engine = _engine(backend, mpu, stage, seed=0)
    losses = _steps(engine, mpu, range(SAVE_AT))
    saved = _weights(engine)
    engine.save_checkpoint(str(save), tag="t")
    losses += _steps(engine, mpu, range(SAVE_AT, m.STEPS))
    engine.destroy() if hasattr(engine, "destroy") else None
    return {"losses": losses, "saved": saved}


def _resumed(backend: str, mpu, stage: int, load: Path, **kwargs) -> dict:
    """A fresh engine (other initial weights) loads ``load`` and trains the last 2 steps."""
    engine = _engine(backend, mpu, stage, seed=7)
    engine.load_checkpoint(str(load), tag="t", **kwargs)
    loaded = _weights(engine)
    out = {"losses": _steps(engine, mpu, range(SAVE_AT, m.STEPS)), "loaded": loaded,
           "global_steps": engine.global_steps,
           "mp_world_size": getattr(engine, "loaded_checkpoint_mp_world_size", None)}  # fmt: skip
    engine.destroy() if hasattr(engine, "destroy") else None
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def both_ways(rank: int, world_size: int, scenario: dict) -> dict:  # noqa: ARG001
    """DeepSpeed saves and torsh resumes (all states); torsh saves and DeepSpeed loads it: at stage 0 all states
    (DeepSpeed's default load), compared with torsh's own continued run; at stage 2 (the optimizer state is in
    torsh's DCP files only) the module states, as a torsh engine loads them, for the comparison."""
    stage, root = scenario["stage"], Path(scenario["dir"])
    mpu = m.MegatronMpu(2)
    theirs = _first_run("deepspeed", mpu, stage, root / "ds")
    into_torsh = _resumed("torsh", mpu, stage, root / "ds")
    ours = _first_run("torsh", mpu, stage, root / "torsh")
    only = {"load_module_only": True} if stage else {}
    into_ds = _resumed("deepspeed", mpu, stage, root / "torsh", **only)
    torsh_module_only = _resumed("torsh", mpu, stage, root / "torsh", load_module_only=True)
    names = sorted(os.listdir(root / "ds" / "t"))
    return {"ds": theirs["losses"], "torsh_from_ds": into_torsh["losses"], "ds_files": names,
            "torsh_loaded_ds_weights": _same(into_torsh["loaded"], theirs["saved"]),
            "global_steps": into_torsh["global_steps"], "loaded_mp_world_size": into_torsh["mp_world_size"],
            "torsh": ours["losses"], "ds_from_torsh": into_ds["losses"],
            "torsh_module_only": torsh_module_only["losses"],
            "ds_loaded_torsh_weights": _same(into_ds["loaded"], ours["saved"])}  # fmt: skip


def _deepspeed_layout(torsh_dir: Path, out: Path) -> Path:
    """A stage-0 DeepSpeed checkpoint made from a torsh one: its ``mp_rank_XX_model_states.pt`` files alone
    (without the DCP files a torsh checkpoint keeps beside them)."""
    (out / "t").mkdir(parents=True, exist_ok=True)
    for file in (torsh_dir / "t").glob("mp_rank_*_model_states.pt"):
        shutil.copy(file, out / "t" / file.name)
    return out


def model_parallel_sizes(rank: int, world_size: int, scenario: dict) -> dict:  # noqa: ARG001
    """The mp_rank_XX module states load into the engine of the same mpu, each rank its own slices; another
    model-parallel size is an error on every rank."""
    import torch.distributed as dist

    from torsh.engine.checkpoint.io import CheckpointError

    root = Path(scenario["dir"])
    mpu = m.MegatronMpu(2)
    saved = _first_run("torsh", mpu, 0, root / "torsh")["saved"]
    if rank == 0:
        _deepspeed_layout(root / "torsh", root / "mp2")
        _deepspeed_layout(root / "torsh", root / "mp1")
        os.remove(root / "mp1" / "t" / "mp_rank_01_model_states.pt")
    dist.barrier()
    out = {"loaded": _same(_resumed("torsh", mpu, 0, root / "mp2", load_module_only=True)["loaded"], saved)}
    for name, engine_mpu, load in (("mp1_into_mp2", mpu, "mp1"), ("mp2_into_plain", None, "mp2"),
                                   ("count_differs_from_saved", None, "mp1")):  # fmt: skip
        engine = _engine("torsh", engine_mpu, 0, seed=7)
        out[f"{name}_checkpoint_mp_rank"] = engine.checkpoint_mp_rank
        try:
            engine.load_checkpoint(str(root / load), tag="t")
            out[name] = None
        except CheckpointError as err:
            out[name] = str(err)
        engine.destroy() if hasattr(engine, "destroy") else None
    return out


def _run(scenarios: list[dict], runner) -> list[dict]:
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        h.spawn(scenarios, 2, out, runner=runner)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


def test_each_model_parallel_rank_loads_its_own_module_states_and_other_sizes_are_refused(tmp_path):
    """The stage-0 DeepSpeed layout (``mp_rank_00`` and ``mp_rank_01`` model states) into an engine of the same
    mpu: each rank gets the slices saved from its model-parallel rank. One model-parallel rank's files into an
    engine of model-parallel size 2, or two into an engine without an mpu, are errors naming both sizes and what
    to do; a file count that differs from the saved ``mp_world_size`` is DeepSpeed's error. The engine's
    ``checkpoint_mp_rank`` is the model-parallel rank whose files it reads."""
    records = _run([{"name": "sizes", "dir": str(tmp_path)}], model_parallel_sizes)
    for rank, rec in enumerate(h.ranks_of(records, "sizes")):
        assert rec["loaded"]
        # DeepSpeed's checkpoint_mp_rank: the mpu's model-parallel rank (each rank is one here), 0 without an mpu
        assert (rec["mp1_into_mp2_checkpoint_mp_rank"], rec["mp2_into_plain_checkpoint_mp_rank"]) == (rank, 0)
        assert "holds the files of 1 model-parallel rank(s) (mp_rank_00..mp_rank_00) but this engine has " \
               "model-parallel size 2: initialize the engine with an mpu of model-parallel size 1" \
               in rec["mp1_into_mp2"], rec["mp1_into_mp2"]  # fmt: skip
        assert "holds the files of 2 model-parallel rank(s) (mp_rank_00..mp_rank_01) but this engine has " \
               "model-parallel size 1: initialize the engine with the Megatron-style mpu it was saved under" \
               in rec["mp2_into_plain"], rec["mp2_into_plain"]  # fmt: skip
        assert "checkpoint count 1 is different from saved mp_world_size 2" in rec["count_differs_from_saved"]


@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_and_torsh_load_each_others_model_parallel_checkpoints(tmp_path, stage):
    """Real DeepSpeed 0.19.8 trains 2 steps under the mpu and saves (``mp_rank_00``/``mp_rank_01`` model states,
    at ZeRO-2 one ``zero_pp_rank_0_mp_rank_XX_optim_states.pt`` per model-parallel rank); a torsh engine with other
    initial weights loads it and its next 2 losses are those of DeepSpeed's own continued run. The other way,
    DeepSpeed loads torsh's checkpoint: at stage 0 with its default ``load_checkpoint`` (optimizer state included)
    and continues with torsh's own continued losses; at stage 2 with ``load_module_only=True``, the weights torsh
    saved and the losses of a torsh engine that loads it the same way."""
    pytest.importorskip("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    records = _run([{"name": "both", "stage": stage, "dir": str(tmp_path)}], both_ways)
    for rank, rec in enumerate(h.ranks_of(records, "both")):
        wanted = {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"}
        if stage:
            wanted |= {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"}
        assert wanted <= set(rec["ds_files"]), rec["ds_files"]
        assert rec["torsh_loaded_ds_weights"], f"rank {rank}: the weights are not those DeepSpeed saved"
        assert (rec["global_steps"], rec["loaded_mp_world_size"]) == (m.STEPS, 2)
        m._close(rec["torsh_from_ds"], rec["ds"][SAVE_AT:], f"stage {stage} torsh resumed vs DeepSpeed")
        m._close(rec["torsh"], rec["ds"], f"stage {stage} torsh vs DeepSpeed")
        assert rec["ds_loaded_torsh_weights"], f"rank {rank}: DeepSpeed did not load the weights torsh saved"
        want = rec["torsh_module_only"] if stage else rec["torsh"][SAVE_AT:]
        m._close(rec["ds_from_torsh"], want, f"stage {stage} DeepSpeed from torsh")
