"""ZeRO-1 as DeepSpeed runs it (``torsh.engine.zero.partition`` with DDP's all-reduce), on 2 gloo ranks in one
launch, beside real DeepSpeed 0.19.8 where values are compared:

- per-step losses, gradient norms and final weights equal DeepSpeed's stage 1 (fp32 and bf16, weight-decay
  groups, gradient accumulation, clipping);
- parameters stay plain whole tensors; each rank's optimizer state holds only its partition; the optimizer is the
  script's class (``engine.optimizer.optimizer``), and ``optimizer.state_dict()`` needs no consolidation;
- a stage-1 checkpoint resumes exactly at stages 0, 1, 2 and 3, and stage 0/2/3 checkpoints at stage 1;
- a checkpoint and ``optimizer.state_dict()`` files written by stage 1 before it ran on the partition (torch's
  ``ZeroRedundancyOptimizer``; ``tests/fixtures/checkpoints/torsh_zero1_legacy``) resume with the losses that job
  went on with;
- optimizer offload keeps the master partition and the state on the CPU, and ``offload_states`` /
  ``reload_states`` leave the training unchanged;
- a script's own ``ZeroRedundancyOptimizer`` passed to ``initialize`` trains, saves and loads at every stage as
  the optimizer class it wraps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is installed by requirements-dev.txt in CI")

import _engine_harness as h  # noqa: E402

pytestmark = pytest.mark.slow

MODULE = "test_zero1_partition"
ENGINES = ("torsh", "deepspeed")
FP32 = 1e-5
LEGACY = Path(__file__).parent / "fixtures" / "checkpoints" / "torsh_zero1_legacy"


def layout(rank: int, world_size: int, scenario: dict) -> dict:
    import torch

    import torsh

    model = h.build_model(0)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, opt, *_ = torsh.initialize(model=model, optimizer=adamw, config=scenario["config"])
    h.train(engine, rank, 0, 2)
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    saved = opt.state_dict()  # DeepSpeed's is the rank's partition too; torch's ZeRO raised "not consolidated"
    return {"param_types": sorted({type(p).__name__ for p in engine.module.parameters()}),
            "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
            "state_numel": [v.numel() for v in state], "trainable": sum(p.numel() for p in model.parameters()),
            "inner": engine.optimizer.optimizer is opt, "class": type(opt).__name__,
            "saved_groups": len(saved["param_groups"]), "kind": engine._shard.kind}  # fmt: skip


def _make(stage: int, seed: int = 1, **extra):
    import torsh

    model = h.build_model(seed)
    config = h.ds_config(stage, gradient_clipping=1.0, gradient_accumulation_steps=2, **extra)
    return torsh.initialize(model=model, model_parameters=model.parameters(), config=config)[0]


def resume(rank: int, world_size: int, scenario: dict) -> dict:
    """Each writer stage trains 4 micro-steps, saves, trains 4 more; each reader stage loads the save and trains
    the same 4."""
    out = {}
    for writer in scenario["writers"]:
        engine = _make(writer)
        h.train(engine, rank, 0, 4)
        engine.save_checkpoint(scenario["dir"], tag=f"s{writer}")
        out[f"straight_s{writer}"] = h.train(engine, rank, 4, 4)
        for reader in scenario["readers"][writer]:
            other = _make(reader, seed=2)
            other.load_checkpoint(scenario["dir"], tag=f"s{writer}")
            out[f"s{writer}_to_s{reader}"] = h.train(other, rank, 4, 4)
    return out


def legacy(rank: int, world_size: int, scenario: dict) -> dict:
    """The checkpoint and per-rank ``torch.save`` files stage 1 wrote before it ran on the partition."""
    import torch

    import torsh

    def start(stage: int):
        model = h.build_model(3)
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        config = h.ds_config(stage, gradient_accumulation_steps=2, gradient_clipping=1.0)
        return torsh.initialize(model=model, optimizer=adamw, config=config)[:2]

    out = {}
    for stage in (1, 2):
        engine, _ = start(stage)
        engine.load_checkpoint(scenario["dir"], tag="zero1")
        out[f"checkpoint_s{stage}"] = h.train(engine, rank, 4, 4)
    engine, optimizer = start(1)
    saved = torch.load(Path(scenario["dir"]) / f"optimizer_rank{rank}.pt", weights_only=True)
    engine.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    out["torch_save"] = h.train(engine, rank, 4, 4)
    try:  # every rank given rank 0's file: the other partition's state is missing
        saved = torch.load(Path(scenario["dir"]) / "optimizer_rank0.pt", weights_only=True)
        optimizer.load_state_dict(saved["optimizer"])
        out["incomplete"] = None
    except ValueError as exc:
        out["incomplete"] = str(exc)
    return out


def offload(rank: int, world_size: int, scenario: dict) -> dict:
    """Optimizer offload at stage 1: the master partition and the state on the CPU; ``offload_states`` mid-run."""
    engine = _make(1, zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}})
    losses = h.train(engine, rank, 0, 4)
    engine.offload_states()
    moved = len(engine._offloaded or [])
    engine.reload_states()
    losses += h.train(engine, rank, 4, 4)
    part = engine._shard.partition
    state_devices = {str(v.device) for s in engine.optimizer.state.values() for v in s.values() if hasattr(v, "device")}
    return {"losses": losses, "master_devices": sorted({str(m.device) for m in part.masters}),
            "state_devices": sorted(state_devices), "on_cpu": engine.zero_cpu_offload(), "moved": moved}


def plain(rank: int, world_size: int, scenario: dict) -> dict:
    """The same run as :func:`offload` without offload, for the losses."""
    engine = _make(1, seed=1)
    return {"losses": h.train(engine, rank, 0, 8)}


def torch_zero_client(rank: int, world_size: int, scenario: dict) -> dict:
    """A script that built torch's ``ZeroRedundancyOptimizer`` itself and passes it to ``initialize``, at each
    stage: it trains as the plain AdamW it wraps (the configured stage partitions, or not), saves and loads."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import torsh

    out = {}
    for stage in (0, 1, 2, 3):
        for kind in ("zero", "adamw"):
            model = h.build_model(0)
            if kind == "zero":
                opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            engine, optimizer, *_ = torsh.initialize(model=model, optimizer=opt, config=h.ds_config(stage))
            out[f"{kind}_s{stage}"] = h.train(engine, rank, 0, 3)
            engine.save_checkpoint(f"{scenario['dir']}/{kind}{stage}", tag="t")
            engine.load_checkpoint(f"{scenario['dir']}/{kind}{stage}", tag="t")
            out[f"{kind}_s{stage}"] += h.train(engine, rank, 3, 1)
            optimizer.state_dict()  # no consolidation needed at any stage
    return out


def _scenarios(tmp) -> list[dict]:
    out = []
    for engine in ENGINES:
        for dtype in ("fp32", "bf16"):
            extra = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
            config = h.ds_config(1, gradient_accumulation_steps=2, gradient_clipping=0.5, **extra)
            out.append({"name": f"parity_{dtype}_{engine}", "kind": "call", "target": "test_zero_partition:parity",
                        "engine": engine, "config": config})  # fmt: skip
    out.append({"name": "layout", "kind": "call", "target": f"{MODULE}:layout",
                "config": h.ds_config(1, bf16={"enabled": True})})  # fmt: skip
    (tmp / "resume").mkdir()
    out.append({"name": "resume", "kind": "call", "target": f"{MODULE}:resume", "dir": str(tmp / "resume"),
                "writers": [1, 0, 2, 3], "readers": {1: [1, 0, 2, 3], 0: [1], 2: [1], 3: [1]}})  # fmt: skip
    out.append({"name": "legacy", "kind": "call", "target": f"{MODULE}:legacy", "dir": str(LEGACY)})
    out.append({"name": "offload", "kind": "call", "target": f"{MODULE}:offload"})
    out.append({"name": "plain", "kind": "call", "target": f"{MODULE}:plain"})
    out.append({"name": "torch_zero", "kind": "call", "target": f"{MODULE}:torch_zero_client", "dir": str(tmp)})
    return out


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return h.run(_scenarios(tmp_path_factory.mktemp("zero1")))


def _flat(value) -> list[float]:
    return [v for row in value for v in (row if isinstance(row, list) else [row])]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_losses_norms_and_weights_equal_deepspeed_stage1(records, dtype):
    ours, theirs = h.both(records, f"parity_{dtype}", ENGINES)
    rtol = 1e-6 if dtype == "fp32" else 2**-7
    for a, b in zip(ours, theirs):
        assert a["losses"] == pytest.approx(b["losses"], rel=rtol)
        assert a["norms"] == pytest.approx(b["norms"], rel=FP32 if dtype == "fp32" else 0.05)
        for name, expected in b["weights"].items():
            assert _flat(a["weights"][name]) == pytest.approx(_flat(expected), rel=rtol,
                                                              abs=1e-6 if dtype == "fp32" else 2e-2), name


def test_parameters_whole_optimizer_state_partitioned_and_state_dict_without_consolidation(records):
    for rec in h.ranks_of(records, "layout"):
        assert rec["param_types"] == ["Parameter"] and rec["param_dtypes"] == ["torch.bfloat16"]
        assert rec["inner"] and rec["class"] == "AdamW" and rec["saved_groups"] == 1
        assert rec["kind"] == "ddp"  # DDP all-reduces the whole gradients; the partition steps
        # exp_avg and exp_avg_sq over this rank's flat fp32 partition: about half the model (padding aside)
        assert sum(rec["state_numel"]) == pytest.approx(rec["trainable"], rel=0.05)


@pytest.mark.parametrize("pair", ["s1_to_s1", "s1_to_s0", "s1_to_s2", "s1_to_s3", "s0_to_s1", "s2_to_s1",
                                  "s3_to_s1"])
def test_stage1_checkpoints_move_between_stages_exactly(records, pair):
    for rec in h.ranks_of(records, "resume"):
        writer = pair.split("_to_")[0]
        assert rec[pair] == pytest.approx(rec[f"straight_{writer}"], rel=FP32)


def test_checkpoints_written_by_stage1_before_the_partition_still_resume(records):
    expected = json.loads((LEGACY / "expected.json").read_text())["after"]
    for rank, rec in enumerate(h.ranks_of(records, "legacy")):
        assert rec["checkpoint_s1"] == pytest.approx(expected[rank], rel=1e-6)
        assert rec["checkpoint_s2"] == pytest.approx(expected[rank], rel=FP32)
        assert rec["torch_save"] == pytest.approx(expected[rank], rel=1e-6)
        assert "rank(s) [0] of [2] ranks" in rec["incomplete"] and "each rank its own" in rec["incomplete"]


def test_optimizer_offload_and_offload_states_at_stage1(records):
    for rec, plain in zip(h.ranks_of(records, "offload"), h.ranks_of(records, "plain")):
        assert rec["on_cpu"] and rec["master_devices"] == ["cpu"] and rec["state_devices"] == ["cpu"]
        assert rec["losses"] == pytest.approx(plain["losses"], rel=FP32)


def test_a_script_zero_redundancy_optimizer_trains_as_the_optimizer_it_wraps(records):
    for rec in h.ranks_of(records, "torch_zero"):
        for stage in (0, 1, 2, 3):
            assert rec[f"zero_s{stage}"] == pytest.approx(rec[f"adamw_s{stage}"], rel=FP32), stage
