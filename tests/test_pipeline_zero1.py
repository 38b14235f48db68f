"""The pipeline engine's ZeRO-1 on the engine's partition (``torsh.engine.zero.partition`` in its stage-1 mode over
a stage's data-parallel replicas), on 2 gloo ranks in one launch (1 stage x 2 replicas), beside real DeepSpeed
0.19.8's ``PipelineEngine`` where values are compared:

- per-step losses equal DeepSpeed's pipeline at ZeRO-1 (fp32 and bf16);
- no ``ZeroRedundancyOptimizer``: the optimizer is the script's class over the flat fp32 partition, its
  ``state_dict()`` is this rank's partition (no consolidation), the parameters stay whole and equal on both ranks;
- checkpoints move between the pipeline's stage 0 and ZeRO-1 exactly, both ways, fp32 and bf16;
- checkpoints written when the pipeline's ZeRO-1 was torch's ``ZeroRedundancyOptimizer``
  (``tests/fixtures/checkpoints/torsh_pipeline_zero1_legacy``) resume with the losses and weights that job went on
  with.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is installed by requirements-dev.txt in CI")

import _engine_harness as h  # noqa: E402

pytestmark = pytest.mark.slow

MODULE = "test_pipeline_zero1"
LEGACY = Path(__file__).parent / "fixtures" / "checkpoints" / "torsh_pipeline_zero1_legacy"
DTYPES = ("fp32", "bf16")


def _loss(out, y):
    import torch

    return torch.nn.functional.cross_entropy(out.float(), y)


def make(stage: int, seed: int, dtype: str, engine: str = "torsh", client=None, **zero):
    """A 1-stage pipeline (its replicas: every rank) of three linear layers, AdamW, clipping, 2 micro-batches
    (``client``: the optimizer class the script builds and passes instead; ``zero``: more ZeRO settings)."""
    import torch

    import importlib

    ds = h.backend(engine)
    if engine == "deepspeed":
        ds.init_distributed(dist_backend="gloo")  # DeepSpeed's PipelineModule builds its groups through it
    from_pipe = importlib.import_module("deepspeed.pipe" if engine == "deepspeed" else "torsh.compat.deepspeed.pipe")
    torch.manual_seed(seed)
    spec = from_pipe.LayerSpec
    layers = [spec(torch.nn.Linear, 8, 16), torch.nn.ReLU(), spec(torch.nn.Linear, 16, 16), torch.nn.ReLU(),
              spec(torch.nn.Linear, 16, 4)]  # fmt: skip
    net = from_pipe.PipelineModule(layers=layers, loss_fn=_loss, num_stages=1, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
              "gradient_clipping": 0.5, "zero_optimization": {"stage": stage, **zero},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True}}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if client is not None:
        del config["optimizer"]
        return ds.initialize(model=net, optimizer=client(net.parameters()), config=config)[0]
    return ds.initialize(model=net, model_parameters=[p for p in net.parameters()], config=config)[0]


def _data(engine, step: int):
    import torch

    for k in range(engine.micro_batches):
        g = torch.Generator().manual_seed(100 * (step * engine.micro_batches + k) + engine.mpu.get_data_parallel_rank())
        x = torch.randn(2, 8, generator=g)
        yield (x.to(torch.bfloat16) if engine.bfloat16_enabled() else x), torch.randint(0, 4, (2,), generator=g)


def train(engine, start: int, steps: int) -> list[float]:
    return [engine.train_batch(_data(engine, s)).item() for s in range(start, start + steps)]


def _weights(engine) -> list[float]:
    return [float(p.detach().double().sum()) for p in engine.module.parameters()]


def parity(rank: int, world_size: int, scenario: dict) -> dict:
    engine = make(1, 3, scenario["dtype"], scenario["engine"])
    return {"losses": train(engine, 0, 6)}


def layout(rank: int, world_size: int, scenario: dict) -> dict:
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    engine = make(1, 3, "bf16")
    train(engine, 0, 2)
    opt = engine.optimizer
    saved = opt.state_dict()  # torch's ZeroRedundancyOptimizer raised "not consolidated" here
    state = [v for s in saved["state"].values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    part = engine._shard.partition
    found = [type(v).__name__ for v in [opt, getattr(opt, "optimizer", None), *engine.__dict__.values()]
             if isinstance(v, ZeroRedundancyOptimizer)]  # fmt: skip
    return {"zero_redundancy": found, "class": type(opt).__name__, "inner": opt.optimizer is opt,
            "state_numel": [v.numel() for v in state], "partition_numel": [m.numel() for m in part.masters],
            "trainable": sum(p.numel() for p in engine.module.parameters()), "groups": saved["param_groups"],
            "keys": sorted(saved), "step_dtypes": sorted({str(m.dtype) for g in opt.param_groups for m in g["params"]}),
            "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
            "param_types": sorted({type(p).__name__ for p in engine.module.parameters()}),
            "weights": _weights(engine)}  # fmt: skip


def variants(rank: int, world_size: int, scenario: dict) -> dict:
    """The script's own optimizer object, optimizer offload, and an optimizer that needs whole tensors."""
    import torch

    from torsh.errors import ConfigError

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    plain = train(make(1, 3, "bf16"), 0, 3)
    client = make(1, 3, "bf16", client=adamw)
    offload = make(1, 3, "bf16", offload_optimizer={"device": "cpu"})
    out = {"plain": plain, "client": train(client, 0, 3), "offload": train(offload, 0, 3),
           "offload_devices": sorted({str(m.device) for m in offload._shard.partition.masters}),
           "client_class": type(client.optimizer).__name__}  # fmt: skip
    try:
        make(1, 3, "fp32", client=lambda params: torch.optim.Adafactor(params))
    except ConfigError as exc:
        out["whole"] = str(exc)
    return out


def moves(rank: int, world_size: int, scenario: dict) -> dict:
    """Each writer stage trains 3 steps, saves, trains 3 more; the reader stage loads the save and trains the same 3."""
    out = {}
    for dtype in DTYPES:
        for writer, reader in ((1, 0), (0, 1), (1, 1)):
            engine = make(writer, 3, dtype)
            train(engine, 0, 3)
            tag = f"{dtype}_s{writer}_s{reader}"
            engine.save_checkpoint(scenario["dir"], tag=tag)
            straight = train(engine, 3, 3)
            other = make(reader, 5, dtype)
            other.load_checkpoint(scenario["dir"], tag=tag)
            out[tag] = {"straight": straight, "resumed": train(other, 3, 3), "weights": _weights(engine),
                        "resumed_weights": _weights(other)}  # fmt: skip
            if (writer, reader) == (1, 1):
                out["files"] = sorted(p.name for p in (Path(scenario["dir"]) / tag).iterdir())
    return out


def legacy(rank: int, world_size: int, scenario: dict) -> dict:
    out = {}
    for dtype in DTYPES:
        engine = make(1, 5, dtype)
        engine.load_checkpoint(scenario["dir"], tag=f"zero1_{dtype}")
        out[dtype] = train(engine, 3, 3)
        out[f"{dtype}_weights"] = _weights(engine)
    return out


def across(rank: int, world_size: int, scenario: dict) -> dict:
    """ZeRO-1 pipeline checkpoints between the engines: each one's weights load into the other
    (``load_optimizer_states=False``); DeepSpeed's optimizer partition asked of torsh is a CheckpointError saying
    so (DeepSpeed refuses torsh's with its own assertion)."""
    from torsh.engine.checkpoint.io import CheckpointError

    out = {}
    for writer, reader in (("torsh", "deepspeed"), ("deepspeed", "torsh")):
        engine = make(1, 3, "fp32", writer)
        train(engine, 0, 2)
        engine.save_checkpoint(scenario["dir"], tag=writer)
        other = make(1, 5, "fp32", reader)
        other.load_checkpoint(scenario["dir"], tag=writer, load_optimizer_states=False)
        out[writer] = {"weights": _weights(engine), "loaded": _weights(other)}
    try:
        make(1, 5, "fp32").load_checkpoint(scenario["dir"], tag="deepspeed")
        out["optimizer_refused"] = None
    except CheckpointError as exc:
        out["optimizer_refused"] = str(exc)
    return out


def _scenarios(tmp: Path) -> list[dict]:
    out = [{"name": f"parity_{dtype}_{engine}", "kind": "call", "target": f"{MODULE}:parity", "engine": engine,
            "dtype": dtype} for dtype in DTYPES for engine in ("torsh", "deepspeed")]  # fmt: skip
    out.append({"name": "layout", "kind": "call", "target": f"{MODULE}:layout"})
    out.append({"name": "variants", "kind": "call", "target": f"{MODULE}:variants"})
    out.append({"name": "moves", "kind": "call", "target": f"{MODULE}:moves", "dir": str(tmp)})
    out.append({"name": "legacy", "kind": "call", "target": f"{MODULE}:legacy", "dir": str(LEGACY)})
    (tmp / "across").mkdir()
    out.append({"name": "across", "kind": "call", "target": f"{MODULE}:across", "dir": str(tmp / "across")})
    return out


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return h.run(_scenarios(tmp_path_factory.mktemp("pipeline_zero1")))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pipeline_zero1_losses_equal_deepspeeds_pipeline_engine(records, dtype):
    ours, theirs = h.both(records, f"parity_{dtype}")
    for a, b in zip(ours, theirs):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6 if dtype == "fp32" else 2**-8)


def test_pipeline_zero1_is_the_partition_and_state_dict_is_the_ranks_partition(records):
    ranks = h.ranks_of(records, "layout")
    for rec in ranks:
        assert rec["zero_redundancy"] == [] and rec["class"] == "AdamW" and rec["inner"]
        assert rec["keys"] == ["param_groups", "state"]  # torch's own format: no per-rank marker, no collective
        assert [g["params"] for g in rec["groups"]] == [[0]]  # one flat master per group
        assert rec["step_dtypes"] == ["torch.float32"] and rec["param_dtypes"] == ["torch.bfloat16"]
        assert rec["param_types"] == ["Parameter"]
        # exp_avg and exp_avg_sq over this rank's flat partition: half the stage's elements (padding aside)
        assert rec["state_numel"] == rec["partition_numel"] * 2
        assert sum(rec["partition_numel"]) == pytest.approx(rec["trainable"] / 2, abs=len(rec["partition_numel"]) * 2)
    assert ranks[0]["weights"] == ranks[1]["weights"]  # whole, equal parameters on both replicas


def test_pipeline_zero1_with_the_scripts_optimizer_and_with_optimizer_offload(records):
    for rec in h.ranks_of(records, "variants"):
        assert rec["client_class"] == "AdamW" and rec["client"] == rec["plain"]
        assert rec["offload_devices"] == ["cpu"] and rec["offload"] == rec["plain"]
        assert "Adafactor updates whole tensors" in rec["whole"] and "sharding.stage" in rec["whole"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pair", ["s1_s0", "s0_s1", "s1_s1"])
def test_pipeline_checkpoints_move_between_stage_0_and_zero1_exactly(records, dtype, pair):
    # the same stage: the same values; between stages the clipping norm is summed differently (per parameter in
    # fp32 at stage 0, per partition in fp64 at ZeRO-1), which moves fp32 weights in the last bits
    tol = 0 if pair == "s1_s1" else 1e-6
    for rec in h.ranks_of(records, "moves"):
        run = rec[f"{dtype}_{pair}"]
        assert run["resumed"] == pytest.approx(run["straight"], rel=tol, abs=0)
        assert run["resumed_weights"] == pytest.approx(run["weights"], rel=tol, abs=tol)  # sums of the weights


def test_pipeline_zero1_keeps_deepspeeds_file_layout(records):
    for rec in h.ranks_of(records, "moves"):
        assert {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "zero_pp_rank_1_mp_rank_00_optim_states.pt", "layer_00-model_states.pt"} <= set(rec["files"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_checkpoints_of_the_zero_redundancy_optimizer_still_resume(records, dtype):
    expected = json.loads((LEGACY / "expected.json").read_text())
    for rec in h.ranks_of(records, "legacy"):
        assert rec[dtype] == pytest.approx(expected["after"][dtype], rel=1e-6)
        assert rec[f"{dtype}_weights"] == pytest.approx(expected["weights_after"][dtype], rel=1e-6, abs=1e-6)


def test_the_plan_names_the_pipelines_own_data_parallel_kind():
    from torsh.config import TorshConfig
    from torsh.plan import plan

    for stage, kind in ((0, "ddp"), (1, "zero1")):
        cfg = TorshConfig.model_validate({"sharding": {"stage": stage}})
        decided = plan(cfg, 2, pipeline=True)
        assert decided.pipeline and decided.data_parallel == kind
        [step] = [s for s in decided.steps if s.startswith("pipeline stages")]
        assert "the pipeline engine all-reduces" in step and "DDP (" not in " ".join(decided.steps)
    assert not plan(TorshConfig.model_validate({"sharding": {"stage": 1}}), 2).pipeline


def test_zero1_pipeline_weights_load_in_either_engine_and_deepspeeds_optimizer_is_refused_by_name(records):
    for rec in h.ranks_of(records, "across"):
        for writer in ("torsh", "deepspeed"):
            assert rec[writer]["loaded"] == pytest.approx(rec[writer]["weights"], rel=1e-7, abs=0), writer
        text = rec["optimizer_refused"]
        assert text and "DeepSpeed's ZeRO-1 optimizer partition" in text and "load_optimizer_states=False" in text
