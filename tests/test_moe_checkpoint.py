"""Checkpoints of a model with MoE expert parallelism (ep_size 2, 2 experts, 2 gloo ranks: each rank holds one
expert): torsh's save/load resumes exactly at ZeRO stages 0-2, writes DeepSpeed 0.19.8's expert layout
(``layer_<L>_expert_<E>_mp_rank_00_model_states.pt``, ``mp_rank_00_model_states.pt`` without the experts, at
stage 0 ``expp_rank_<r>_mp_rank_00_optim_states.pt``), and the checkpoints move between torsh and real DeepSpeed
in both directions with the same weights and, continuing, the same losses."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

STEPS, SAVE_AT = 4, 2


def _model(moe_cls, ep_size: int = 2):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(4, 4)
            self.moe = moe_cls(4, torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), num_experts=2,
                               ep_size=ep_size, use_rts=False, min_capacity=0)  # fmt: skip
            self.out = torch.nn.Linear(4, 2)

        def forward(self, x):
            out, l_aux, _ = self.moe(self.inp(x))
            return self.out(out).square().mean() + l_aux

    torch.manual_seed(0)
    return Net()


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
            "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}}}  # fmt: skip


def _batch(rank: int, step: int):
    return torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(engine, rank: int, steps) -> list[float]:
    losses = []
    for step in steps:
        loss = engine(_batch(rank, step))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _weights(engine) -> dict[str, list]:
    return {k: v.float().flatten().tolist() for k, v in engine.module.state_dict().items()}


def _init(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")  # fmt: skip
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _resume_ranks(rank: int, world_size: int, port: int, out: str) -> None:
    """Per stage: an uninterrupted run, and one saved at step 2 and loaded into a fresh engine (other initial
    weights) that continues."""
    import torch.distributed as dist

    import torsh
    from torsh.compat.deepspeed.moe.layer import MoE

    _init(rank, world_size, port)
    record = {}
    for stage in (0, 1, 2):
        engine = torsh.initialize(model=_model(MoE), config=_config(stage))[0]
        whole = _train(engine, rank, range(STEPS))
        engine = torsh.initialize(model=_model(MoE), config=_config(stage))[0]
        first = _train(engine, rank, range(SAVE_AT))
        ckpt = Path(out, f"stage{stage}")
        engine.save_checkpoint(str(ckpt), tag="t")
        saved = _weights(engine)
        torch.manual_seed(1)
        fresh = _model(MoE)
        for p in fresh.parameters():
            torch.nn.init.normal_(p)
        engine = torsh.initialize(model=fresh, config=_config(stage))[0]
        path, _ = engine.load_checkpoint(str(ckpt), tag="t")
        if stage == 0:  # DeepSpeed's save_16bit_model below stage 3: rank 0's module (its own experts)
            engine.save_16bit_model(out, "model16.bin")
            record["16bit"] = sorted(torch.load(Path(out, "model16.bin"), weights_only=True))
        record[stage] = {"whole": whole, "resumed": first + _train(engine, rank, range(SAVE_AT, STEPS)),
                         "loaded_weights_equal": _weights_after_load(saved, ckpt, stage, rank),
                         "files": sorted(os.listdir(ckpt / "t")), "global_steps": engine.global_steps}  # fmt: skip
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def _weights_after_load(saved: dict, ckpt: Path, stage: int, rank: int) -> bool:
    """The weights a fresh engine holds after loading equal those saved (checked on a module-only load)."""
    import torsh
    from torsh.compat.deepspeed.moe.layer import MoE

    torch.manual_seed(2)
    engine = torsh.initialize(model=_model(MoE), config=_config(stage))[0]
    engine.load_checkpoint(str(ckpt), tag="t", load_module_only=True)
    return _weights(engine) == saved


@pytest.mark.slow
def test_expert_parallel_checkpoints_resume_exactly_at_stages_0_to_2(tmp_path):
    from _engine_harness import free_port, start

    start(_resume_ranks, (2, free_port(), str(tmp_path)), 2)
    records = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(records):
        for stage in ("0", "1", "2"):
            run = record[stage]
            assert run["resumed"] == pytest.approx(run["whole"], rel=1e-6, abs=0), (rank, stage)
            assert run["loaded_weights_equal"] and run["global_steps"] == STEPS, (rank, stage)
    files = records[0]["0"]["files"]
    assert {"layer_0_expert_0_mp_rank_00_model_states.pt", "layer_0_expert_1_mp_rank_00_model_states.pt",
            "mp_rank_00_model_states.pt", "expp_rank_0_mp_rank_00_optim_states.pt",
            "expp_rank_1_mp_rank_00_optim_states.pt"} <= set(files)  # fmt: skip
    assert "expp_rank_0_mp_rank_00_optim_states.pt" not in records[0]["2"]["files"]  # DeepSpeed: ZeRO files only
    model_states = torch.load(tmp_path / "stage0" / "t" / "mp_rank_00_model_states.pt", weights_only=True)
    assert model_states["num_experts"] == [2] and not any("deepspeed_experts" in k for k in model_states["module"])
    assert "moe.deepspeed_moe.gate.wg.weight" in model_states["module"]
    expert1 = torch.load(tmp_path / "stage0" / "t" / "layer_0_expert_1_mp_rank_00_model_states.pt",
                         weights_only=True)  # fmt: skip
    assert sorted(expert1) == [f"moe.deepspeed_moe.experts.deepspeed_experts.1.{i}.{w}" for i in (0, 1)
                               for w in ("bias", "weight")]  # fmt: skip
    assert [k for k in records[0]["16bit"] if "experts" in k] == [
        f"moe.deepspeed_moe.experts.deepspeed_experts.0.{i}.{w}" for i in (0, 1) for w in ("bias", "weight")]


def test_expert_names_local_and_global():
    """Rank 1 of an expert-parallel group of 2, 2 local experts per layer: local expert i is global 2 + i; the
    router and the layer's other keys keep their names; another rank's expert has no local name here."""
    from torsh.engine.checkpoint.moe_experts import ExpertCheckpoint, _Layer

    experts = ExpertCheckpoint.__new__(ExpertCheckpoint)
    experts.layers = [_Layer(0, "blocks.1.moe.", 2, 1, True)]
    key = "blocks.1.moe.deepspeed_moe.experts.deepspeed_experts.{}.0.weight"
    assert experts.global_name(key.format(1)) == key.format(3)
    assert experts.local_name(key.format(2)) == key.format(0) and experts.local_name(key.format(0)) is None
    for other in ("blocks.1.moe.deepspeed_moe.gate.wg.weight", "blocks.0.fc.weight"):
        assert experts.global_name(other) == other and not experts.is_expert(other)
    state = {key.format(0): torch.ones(1), "blocks.1.moe.deepspeed_moe.gate.wg.weight": torch.zeros(1)}
    assert list(experts.non_expert(state)) == ["blocks.1.moe.deepspeed_moe.gate.wg.weight"]
    assert {name: list(v) for name, v in experts.expert_files(state).items()} == {
        "layer_0_expert_2_mp_rank_00_model_states.pt": [key.format(2)]}


# ---- torsh <-> real DeepSpeed ---------------------------------------------------------------------------------


def _interop_ranks(rank: int, world_size: int, port: int, out: str, stage: int, ep_size: int = 2) -> None:
    """torsh trains 2 steps and saves; DeepSpeed loads it (with the optimizer state at stage 0, the weights only
    at stage 2: torsh's ZeRO optimizer state is in its DCP files) and continues 2 steps. And the reverse. Each
    saver's file names are recorded."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE as DsMoE

    import torsh
    from torsh.compat.deepspeed.moe.layer import MoE

    _init(rank, world_size, port)
    with_optimizer = stage == 0
    record = {}
    for saver, loader in (("torsh", "deepspeed"), ("deepspeed", "torsh")):
        build = {"torsh": lambda m: torsh.initialize(model=m, config=_config(stage))[0],
                 "deepspeed": lambda m: deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                                             config=_config(stage))[0]}  # fmt: skip
        classes = {"torsh": MoE, "deepspeed": DsMoE}
        first = build[saver](_model(classes[saver], ep_size))
        _train(first, rank, range(SAVE_AT))
        ckpt = Path(out, f"{saver}-{stage}")
        first.save_checkpoint(str(ckpt), tag="t")
        dist.barrier()
        record[f"{saver}_files"] = sorted(os.listdir(ckpt / "t"))
        expected = _train(first, rank, range(SAVE_AT, STEPS)) if with_optimizer else None
        saved = _weights_at_save(first, ckpt, lambda c=classes[saver]: _model(c, ep_size), build[saver])
        torch.manual_seed(3)
        second = build[loader](_model(classes[loader], ep_size))
        second.load_checkpoint(str(ckpt), tag="t", load_optimizer_states=with_optimizer)
        loaded = _weights(second)
        if loader == "torsh" and stage == 2 and ep_size > 1:  # DeepSpeed's ZeRO-2 files of MoE groups: refused
            try:
                second.load_checkpoint(str(ckpt), tag="t")
            except Exception as exc:  # noqa: BLE001 - recorded for the test
                record["zero_optimizer_refused"] = f"{type(exc).__name__}: {exc}"
        record[f"{saver}->{loader}"] = {
            "weights_equal": loaded.keys() == saved.keys() and all(
                torch.allclose(torch.tensor(loaded[k]), torch.tensor(saved[k]), rtol=0, atol=0) for k in saved),
            "continued": _train(second, rank, range(SAVE_AT, STEPS)), "expected": expected,
            "global_steps": second.global_steps}  # fmt: skip
        dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    # the engines go while their groups are still registered: a group whose last holder is a DDP reducer freed
    # after destroy_process_group is destroyed with the GIL held, and a gloo thread still releasing its last
    # collective (it needs the GIL) then waits for ever (seen here with both engines' objects in one process)
    del first, second
    gc.collect()
    dist.destroy_process_group()


def _weights_at_save(engine, ckpt: Path, model, build) -> dict:
    """The weights the saving engine had at the save (read back by a fresh engine of its own kind)."""
    torch.manual_seed(4)
    again = build(model())
    again.load_checkpoint(str(ckpt), tag="t", load_optimizer_states=False)
    return _weights(again)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_checkpoints_move_between_torsh_and_real_deepspeed(tmp_path, stage):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from _engine_harness import free_port, start

    start(_interop_ranks, (2, free_port(), str(tmp_path), stage), 2)
    for rank in range(2):
        record = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        if stage == 2:
            assert "load_optimizer_states=False" in record.pop("zero_optimizer_refused")
        for way, run in record.items():
            if way.endswith("_files"):
                continue
            assert run["weights_equal"], (rank, way)
            assert run["global_steps"] == STEPS, (rank, way)
            if run["expected"] is not None:  # the optimizer state moved too: the run continues as the saver's
                assert run["continued"] == pytest.approx(run["expected"], rel=1e-5), (rank, way)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_ep_size_1_checkpoints_use_deepspeeds_moe_layout_both_ways(tmp_path, stage):
    """ep_size=1 (every rank holds both experts): DeepSpeed still writes its MoE layout (the model has MoE layers),
    and so does torsh; each loads the other's, with the same weights and, at stage 0 where the optimizer state
    moves too, the same continued losses."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from _engine_harness import free_port, start

    start(_interop_ranks, (2, free_port(), str(tmp_path), stage, 1), 2)
    moe_files = {"layer_0_expert_0_mp_rank_00_model_states.pt", "layer_0_expert_1_mp_rank_00_model_states.pt",
                 "mp_rank_00_model_states.pt"}  # fmt: skip
    for rank in range(2):
        record = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        for saver in ("torsh", "deepspeed"):
            files = set(record[f"{saver}_files"])
            assert moe_files <= files, (saver, files)
            assert ("expp_rank_0_mp_rank_00_optim_states.pt" in files) == (stage == 0), (saver, files)
            assert "expp_rank_1_mp_rank_00_optim_states.pt" not in files, (saver, files)
        for way in ("torsh->deepspeed", "deepspeed->torsh"):
            run = record[way]
            assert run["weights_equal"] and run["global_steps"] == STEPS, (rank, way)
            if stage == 0:
                assert run["continued"] == pytest.approx(run["expected"], rel=1e-5), (rank, way)
    for saver in ("torsh", "deepspeed"):
        states = torch.load(tmp_path / f"{saver}-{stage}" / "t" / "mp_rank_00_model_states.pt", weights_only=False)
        assert states["num_experts"] == [2] and not any("deepspeed_experts" in k for k in states["module"]), saver


@pytest.mark.slow
def test_one_rank_moe_checkpoints_use_deepspeeds_moe_layout_both_ways(tmp_path):
    """One rank (ep_size 1, both experts local): DeepSpeed's MoE layout both ways, the optimizer state with it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from _engine_harness import free_port, start

    start(_interop_ranks, (1, free_port(), str(tmp_path), 0, 1), 1)
    record = json.loads(Path(tmp_path, "rank0.json").read_text())
    deepspeeds = {"expp_rank_0_mp_rank_00_optim_states.pt", "layer_0_expert_0_mp_rank_00_model_states.pt",
                  "layer_0_expert_1_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt"}  # fmt: skip
    assert set(record["deepspeed_files"]) == deepspeeds and deepspeeds <= set(record["torsh_files"])
    for way in ("torsh->deepspeed", "deepspeed->torsh"):
        run = record[way]
        assert run["weights_equal"] and run["continued"] == pytest.approx(run["expected"], rel=1e-5), way


# ---- NVMe optimizer offload ------------------------------------------------------------------------------------


def test_expert_zero_full_view_keeps_nvme_state_resident():
    """ExpertZero's checkpoint view is the partition's one implementation: under NVMe offload the optimizer state
    is read back for the duration of the view (and written out after it)."""
    import contextlib

    from torsh.engine.parallel.moe_zero import ExpertZero
    from torsh.engine.zero.nvme import SWAP_ATTR
    from torsh.engine.zero.partition_checkpoint import CheckpointViews

    events = []

    class Swapper:
        @contextlib.contextmanager
        def resident(self, params=None):
            events.append("in")
            yield
            events.append("out")

    class Part:
        reduces = True

        def _load_view(self, *args):
            events.append("load")

    optimizer = type("Opt", (), {SWAP_ATTR: Swapper()})()
    zero = ExpertZero([Part(), Part()], [])
    object.__setattr__(zero, "_module_view", lambda module: (events.append("module") or "root", {}))
    object.__setattr__(zero, "_optimizer_view", lambda opt, view_of: events.append("optim") or "view")
    with zero.full_view(None, optimizer, load=True) as pair:
        assert pair == ("root", "view") and events == ["in", "module", "optim"]
    assert events == ["in", "module", "optim", "load", "load", "out"]
    assert ExpertZero.full_view is CheckpointViews.full_view


def _nvme_ranks(rank: int, world_size: int, port: int, out: str) -> None:
    """MoE layers with offload_optimizer nvme and cpu at ZeRO-2 (ep 2), ZeRO-1 (ep 1) and stage 0: the losses."""
    import torch.distributed as dist

    import torsh
    from torsh.compat.deepspeed.moe.layer import MoE

    _init(rank, world_size, port)
    record = {}
    try:
        for stage, ep_size in ((2, 2), (1, 1), (0, 2)):
            for device in ("cpu", "nvme"):
                config = _config(stage)
                config["zero_optimization"]["offload_optimizer"] = {"device": device, "nvme_path": out}
                try:
                    engine = torsh.initialize(model=_model(MoE, ep_size), config=config)[0]
                    record[f"{stage}-{ep_size}-{device}"] = _train(engine, rank, range(3))
                except Exception as exc:  # noqa: BLE001 (reported, asserted below)
                    record[f"{stage}-{ep_size}-{device}"] = f"{type(exc).__name__}: {exc}"
                engine = None  # freed while its groups are registered (see _interop_ranks)
                gc.collect()
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def test_moe_with_nvme_optimizer_offload_trains_as_cpu_offload(tmp_path):
    """The MoE optimizer groups under NVMe offload at ZeRO-1/2 (and stage 0): CPU offload's losses, bit for bit
    (was refused: the swapper stepped one group's piece with the other groups' state in the files)."""
    from _engine_harness import free_port, start

    start(_nvme_ranks, (2, free_port(), str(tmp_path)), 2)
    for rank in range(2):
        record = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        for key in ("2-2", "1-1", "0-2"):
            cpu, disk = record[f"{key}-cpu"], record[f"{key}-nvme"]
            assert isinstance(cpu, list) and len(cpu) == 3, (rank, key, cpu)
            assert disk == cpu, (rank, key, disk, cpu)
