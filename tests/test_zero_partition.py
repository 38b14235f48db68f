"""ZeRO-2 as DeepSpeed runs it (``torsh.engine.zero.partition``), on 2 gloo ranks in one launch, beside real
DeepSpeed 0.19.8 where values are compared:

- between steps ``engine.module``'s parameters are plain whole tensors in the compute dtype, slices of one flat
  storage per reduce bucket (which the all-gather after a step writes into), and each rank's optimizer state holds
  only its partition (about 1/world of the trainable elements); the all-gather cut into ``allgather_bucket_size``
  pieces, or into a parameter the script gave new storage, trains the same;
- per-step losses and final weights equal DeepSpeed's stage 2 (fp32, with weight-decay groups, gradient
  accumulation, clipping and small reduce buckets);
- gradients are reduced in ``reduce_bucket_size`` buckets: one collective per bucket per backward;
- a stage-2 checkpoint resumes exactly at stage 2 and loads at stage 0, an FSDP2 (stage-3) one loads at stage 2; ``safe_get_full_fp32_param`` and
  ``safe_get_full_grad`` give the whole values; an optimizer that is not elementwise is refused by name.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is installed by requirements-dev.txt in CI")

import _engine_harness as h  # noqa: E402

pytestmark = pytest.mark.slow

MODULE = "test_zero_partition"
ENGINES = ("torsh", "deepspeed")
FP32 = 1e-5


def _groups(model):
    """Weight-decay groups as Hugging Face scripts build them (no decay for biases and norms), per-group lr."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}]


def _train(engine, rank: int, start: int, steps: int) -> list[float]:
    return h.train(engine, rank, start, steps, micro=2)


def parity(rank: int, world_size: int, scenario: dict) -> dict:
    """Weight-decay groups, accumulation 2, clipping, small buckets: losses, norms and weights."""
    backend = h.backend(scenario["engine"])
    model = h.build_model(0)
    engine, *_ = backend.initialize(model=model, model_parameters=_groups(model), config=scenario["config"])
    losses, norms = [], []
    for step in range(8):
        x, y = h.batch(step, rank, 2)
        loss = h.lm_loss(engine(x), y)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        losses.append(loss.item())
        if boundary:
            norms.append(float(engine.get_global_grad_norm()))
    weights = {n: p.detach().float().tolist() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "norms": norms, "weights": weights}


def layout(rank: int, world_size: int, scenario: dict) -> dict:
    """What a script sees between steps, and how much optimizer state a rank holds."""
    import torch

    import torsh

    model = h.build_model(0)
    engine, opt, *_ = torsh.initialize(model=model, model_parameters=model.parameters(), config=scenario["config"])
    _train(engine, rank, 0, 2)
    part = engine._shard.partition
    before = part.collectives
    x, y = h.batch(5, rank, 2)
    engine.backward(h.lm_loss(engine(x), y))
    per_backward = part.collectives - before
    engine.step()
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    trainable = sum(p.numel() for p in model.parameters())
    sd = model.state_dict()
    return {"param_types": sorted({type(p).__name__ for p in engine.module.parameters()}),
            "is_tensor": all(type(p.data) is torch.Tensor for p in engine.module.parameters()),
            "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
            "state_dict_types": sorted({type(v).__name__ for v in sd.values()}),
            "state_numel": [v.numel() for v in state], "trainable": trainable,
            "buckets": len(part.buckets), "per_backward": per_backward,
            "inner": engine.optimizer.optimizer is opt, "stage": engine.zero_optimization_stage(),
            "one_storage_per_bucket": all(p.untyped_storage().data_ptr() == b.values.untyped_storage().data_ptr()
                                          for b in part.buckets for p in b.params)}  # fmt: skip


def gathered(rank: int, world_size: int, scenario: dict) -> dict:
    """The all-gather after a step, three ways that must give the same training: parameters that are slices of
    their bucket's flat storage (the default), the same with the all-gather cut into pieces smaller than a rank's
    chunk (``allgather_bucket_size``), and a parameter whose storage the script replaced after ``initialize``
    (``p.data = ...``), which no longer is such a slice."""
    import torch

    import torsh

    out = {}
    for name, gather in (("default", None), ("pieces", 100), ("replaced", None)):
        model = h.build_model(0)
        zero = {"stage": 2, **({"allgather_bucket_size": gather} if gather else {})}
        engine = torsh.initialize(model=model, model_parameters=model.parameters(),
                                  config=h.ds_config(2, zero_optimization=zero))[0]  # fmt: skip
        if name == "replaced":
            p = model.blocks[0].up.weight
            p.data = p.data.clone()
        out[name] = _train(engine, rank, 0, 3)
        out[f"{name}_weights"] = torch.cat([q.detach().reshape(-1) for q in model.parameters()]).tolist()
    return out


def resume(rank: int, world_size: int, scenario: dict) -> dict:
    """Train 3 steps at stage 2, save, train 3 more; a new stage-2 engine and a stage-0 engine load the save and
    train the same 3 steps."""
    import torsh

    def make(stage: int):
        model = h.build_model(1)
        config = h.ds_config(stage, gradient_clipping=1.0)
        return torsh.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    engine = make(2)
    _train(engine, rank, 0, 3)
    engine.save_checkpoint(scenario["dir"], tag="t")
    out = {"straight": _train(engine, rank, 3, 3)}
    for stage in (2, 0):
        other = make(stage)
        other.load_checkpoint(scenario["dir"], tag="t")
        out[f"resumed_s{stage}"] = _train(other, rank, 3, 3)
        out[f"steps_s{stage}"] = other.global_steps
    # an FSDP2 checkpoint (DTensor shards by parameter name: stage 3's, and stage 2's before it ran on the
    # partition) loads into stage 2
    fsdp = make(3)
    _train(fsdp, rank, 0, 3)
    fsdp.save_checkpoint(scenario["dir"], tag="fsdp")
    out["fsdp_straight"] = _train(fsdp, rank, 3, 3)
    other = make(2)
    other.load_checkpoint(scenario["dir"], tag="fsdp")
    out["fsdp_resumed_s2"] = _train(other, rank, 3, 3)
    return out


def accessors(rank: int, world_size: int, scenario: dict) -> dict:
    """``deepspeed.utils``' whole-value accessors at stage 2 (bf16: the masters are fp32) against stage 0."""
    import torch

    import torsh
    from torsh.compat.deepspeed import utils

    out = {}
    for stage in (0, 2):
        model = h.build_model(0)
        config = h.ds_config(stage, bf16={"enabled": True})
        engine = torsh.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        _train(engine, rank, 0, 2)
        x, y = h.batch(9, rank, 2)
        engine.backward(h.lm_loss(engine(x), y))
        p = model.blocks[0].up.weight
        out[f"grad_s{stage}"] = utils.safe_get_full_grad(p).tolist()
        out[f"fp32_s{stage}"] = utils.safe_get_full_fp32_param(p).tolist()
        local = utils.safe_get_local_fp32_param(p)
        out[f"local_numel_s{stage}"] = local.numel()
        if stage == 2:
            utils.safe_set_full_fp32_param(p, torch.zeros_like(p, dtype=torch.float32))
            out["after_set"] = float(utils.safe_get_full_fp32_param(p).abs().sum())
        engine.step()
    return out


def refused(rank: int, world_size: int, scenario: dict) -> dict:
    """torch optimizers the engine cannot step, refused at initialize naming them: one that needs whole tensors at
    ZeRO-2; LBFGS (a closure) and SparseAdam (sparse gradients) at any stage, also from a callable; Adafactor and
    Rprop at stage 3, where torch cannot step them on FSDP2's shards, also when the config names them (they train
    at stage 0)."""
    import torch

    import torsh
    from torsh.errors import ConfigError

    def error(stage: int, make) -> str | None:
        model = h.build_model(0)
        try:
            engine = torsh.initialize(model=model, optimizer=make(model.parameters()), config=h.ds_config(stage))[0]
            h.train(engine, rank, 0, 1)
        except ConfigError as exc:
            return str(exc)
        return None

    def configured(stage: int, name: str) -> str | None:
        model = h.build_model(0)
        config = {**h.ds_config(stage), "optimizer": {"type": name, "params": {"lr": 1e-3}}}
        try:
            torsh.initialize(model=model, model_parameters=model.parameters(), config=config)
        except ConfigError as exc:
            return str(exc)
        return None

    return {"error_text": error(2, torch.optim.Adafactor),
            "lbfgs": [error(stage, torch.optim.LBFGS) for stage in (0, 3)],
            "lbfgs_callable": error(0, lambda params: torch.optim.LBFGS),  # the class as the callable
            "sparse": error(0, torch.optim.SparseAdam),
            "on_shards": [error(3, torch.optim.Adafactor), error(3, torch.optim.Rprop), configured(3, "Adafactor")],
            "stage0": [error(0, torch.optim.Adafactor), error(0, torch.optim.Rprop)]}  # fmt: skip


def _scenarios(tmp) -> list[dict]:
    out = []
    for engine in ENGINES:
        for dtype in ("fp32", "bf16"):
            extra = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
            config = h.ds_config(2, gradient_accumulation_steps=2, gradient_clipping=0.5,
                                 zero_optimization={"stage": 2, "reduce_bucket_size": 300,
                                                    "allgather_bucket_size": 700}, **extra)  # fmt: skip
            out.append({"name": f"parity_{dtype}_{engine}", "kind": "call", "target": f"{MODULE}:parity",
                        "engine": engine, "config": config})  # fmt: skip
    for size in (300, 10**9):
        out.append({"name": f"layout_{size}", "kind": "call", "target": f"{MODULE}:layout",
                    "config": h.ds_config(2, bf16={"enabled": True},
                                          zero_optimization={"stage": 2, "reduce_bucket_size": size})})  # fmt: skip
    (tmp / "resume").mkdir()
    out.append({"name": "resume", "kind": "call", "target": f"{MODULE}:resume", "dir": str(tmp / "resume")})
    out.append({"name": "accessors", "kind": "call", "target": f"{MODULE}:accessors"})
    out.append({"name": "gathered", "kind": "call", "target": f"{MODULE}:gathered"})
    out.append({"name": "refused", "kind": "call", "target": f"{MODULE}:refused"})
    return out


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return h.run(_scenarios(tmp_path_factory.mktemp("zero2")))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_losses_norms_and_weights_equal_deepspeed_stage2(records, dtype):
    ours, theirs = h.both(records, f"parity_{dtype}", ENGINES)
    rtol = FP32 if dtype == "fp32" else 2**-7
    for a, b in zip(ours, theirs):
        assert a["losses"] == pytest.approx(b["losses"], rel=rtol)
        assert a["norms"] == pytest.approx(b["norms"], rel=rtol if dtype == "fp32" else 0.05)
        for name, expected in b["weights"].items():
            got = a["weights"][name]
            flat_a = [v for row in got for v in (row if isinstance(row, list) else [row])]
            flat_b = [v for row in expected for v in (row if isinstance(row, list) else [row])]
            assert flat_a == pytest.approx(flat_b, rel=rtol, abs=1e-6 if dtype == "fp32" else 2e-2), name


def test_parameters_are_plain_whole_tensors_and_state_is_partitioned(records):
    for rec in h.ranks_of(records, "layout_300"):
        assert rec["param_types"] == ["Parameter"] and rec["is_tensor"]
        assert rec["param_dtypes"] == ["torch.bfloat16"]  # DeepSpeed's module is cast to the compute dtype
        assert rec["state_dict_types"] == ["Tensor"]
        assert rec["inner"] and rec["stage"] == 2
        assert rec["one_storage_per_bucket"]  # DeepSpeed's flat parameter groups: the all-gather writes into them
        per_rank = rec["trainable"] / 2
        # exp_avg and exp_avg_sq, one flat tensor per group, together about half the model (padding aside)
        assert sum(rec["state_numel"]) == pytest.approx(2 * per_rank, rel=0.05)


def test_one_collective_per_reduce_bucket(records):
    small, large = h.ranks_of(records, "layout_300")[0], h.ranks_of(records, "layout_1000000000")[0]
    assert large["buckets"] == 1 and large["per_backward"] == 1
    assert small["buckets"] > 3  # ~1.8k trainable elements in buckets of at most 300 (a larger tensor alone)
    assert small["per_backward"] == small["buckets"]


def test_gather_into_storage_in_pieces_or_replaced_trains_the_same(records):
    ranks = h.ranks_of(records, "gathered")
    for rec in ranks:
        for name in ("pieces", "replaced"):
            assert rec[name] == rec["default"], name
            assert rec[f"{name}_weights"] == rec["default_weights"], name
    assert ranks[0]["default_weights"] == ranks[1]["default_weights"]  # every rank holds the same whole values


def test_stage2_checkpoint_resumes_exactly_at_stage2_and_stage0(records):
    for rec in h.ranks_of(records, "resume"):
        assert rec["resumed_s2"] == pytest.approx(rec["straight"], rel=1e-6)
        assert rec["resumed_s0"] == pytest.approx(rec["straight"], rel=FP32)
        assert rec["steps_s2"] == rec["steps_s0"] == 6
        assert rec["fsdp_resumed_s2"] == pytest.approx(rec["fsdp_straight"], rel=FP32)


def test_whole_value_accessors_match_stage0(records):
    import torch

    for rec in h.ranks_of(records, "accessors"):
        # bf16 gradients reduced in another order (per bucket vs DDP's): the dtype's rounding
        torch.testing.assert_close(torch.tensor(rec["grad_s2"]), torch.tensor(rec["grad_s0"]), rtol=2**-6, atol=1e-3)
        torch.testing.assert_close(torch.tensor(rec["fp32_s2"]), torch.tensor(rec["fp32_s0"]), rtol=1e-3, atol=1e-3)
        assert rec["after_set"] == 0.0
    ranks = h.ranks_of(records, "accessors")  # each rank holds its own elements of the parameter, together all of them
    assert sum(r["local_numel_s2"] for r in ranks) == ranks[0]["local_numel_s0"]


def test_optimizer_that_is_not_elementwise_is_refused_by_name(records):
    for rec in h.ranks_of(records, "refused"):
        assert rec["error_text"] and "Adafactor" in rec["error_text"] and "ZeRO-2" in rec["error_text"]
        for text in [*rec["lbfgs"], rec["lbfgs_callable"]]:
            assert text and "LBFGS" in text and "closure" in text, text
        assert rec["sparse"] and "SparseAdam" in rec["sparse"] and "sparse gradients" in rec["sparse"]
        for name, text in zip(("Adafactor", "Rprop", "Adafactor"), rec["on_shards"]):
            assert text and name in text and "sharded parameters" in text, text
        assert rec["stage0"] == [None, None]
