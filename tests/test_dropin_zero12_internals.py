"""DeepSpeed's ZeRO-1/2 optimizer members over torsh's flat partition (``bit16_groups_flat``,
``parallel_partitioned_bit16_groups``, ``nccl_start_alignment_factor``, ``single_partition_of_fp32_groups``,
``accumulated_grads_in_cpu``, DeepSpeed's 'Flattening param group' line), and DeepSpeed's own
``mp_rank_00_model_states.pt`` in a torsh checkpoint, which real DeepSpeed's ``load_checkpoint`` reads. One
process, one gloo rank."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

HIDDEN = 8


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A one-process gloo group for the test (as DeepSpeed's launcher would leave it), stopped after it."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for key, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def ds_lines():
    """What is logged on DeepSpeed's logger ("DeepSpeed", deepspeed.utils.logger) at INFO during the test."""
    logger = logging.getLogger("DeepSpeed")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def _model(seed: int, frozen: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 3))
    if frozen:
        model[0].requires_grad_(False)
    return model


def _config(stage: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage,
            **zero}, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}  # fmt: skip


def _ours(model: torch.nn.Module, config: dict):
    from torsh.compat import deepspeed as drop_in

    engine, optimizer, _, _ = drop_in.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, optimizer


def _step(engine, gas: int = 1) -> list:
    """``gas`` micro-batches (``engine.step()`` after each, the last one steps); what
    ``accumulated_grads_in_cpu`` held after each backward."""
    seen = []
    for i in range(gas):
        x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        engine.backward(engine(x).float().pow(2).mean())
        grads = getattr(engine.optimizer, "accumulated_grads_in_cpu", None)
        seen.append(None if grads is None else {k: v.clone() for k, v in grads.items()})
        engine.step()
    return seen


def test_members_and_model_states_against_deepspeed(one_rank, ds_lines, tmp_path):
    """The members real DeepSpeed's ZeRO-2 optimizer has, with its values where they are DeepSpeed's by definition;
    a torsh checkpoint's model states load into real DeepSpeed (load_module_only) as torsh's weights."""
    deepspeed = pytest.importorskip("deepspeed")
    logging.getLogger("DeepSpeed").setLevel(logging.INFO)  # importing DeepSpeed set it to WARNING
    engine, opt = _ours(_model(0, frozen=True), _config(2))
    ours_lines = list(ds_lines)
    flat = opt.bit16_groups_flat[0]
    assert flat.dtype == torch.bfloat16 and flat.device.type == "cpu" and flat.grad_fn is None
    params = [p for p in engine.module.parameters() if p.requires_grad]
    assert [list(g) for g in opt.bit16_groups] == [params]
    for p in params:  # the parameters are views of the flat buffer: it is their storage
        assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    parts = opt.parallel_partitioned_bit16_groups[0]
    assert len(parts) == 1 and parts[0].data_ptr() % (2 * opt.nccl_start_alignment_factor) == 0
    assert opt.single_partition_of_fp32_groups[0].dtype == torch.float32 and opt.partition_count == [1]
    assert not hasattr(opt, "accumulated_grads_in_cpu")  # DeepSpeed has it under optimizer offload only
    _step(engine)
    engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    saved = torch.load(tmp_path / "global_step1" / "mp_rank_00_model_states.pt", weights_only=True)
    assert sorted(saved["module"]) == ["2.bias", "2.weight"]  # the frozen layer left out
    assert saved["optimizer"] is None and saved["global_steps"] == 1 and saved["ds_version"].startswith("0.19.8")
    assert saved["dp_world_size"] == saved["mp_world_size"] == 1 and saved["frozen_param_shapes"] is None
    assert [list(s) for s in saved["param_shapes"]] == [["2.weight", "2.bias"]]
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.save_checkpoint(tmp_path, tag="all")
    saved = torch.load(tmp_path / "all" / "mp_rank_00_model_states.pt", weights_only=True)
    assert sorted(saved["module"]) == sorted(weights)  # the frozen layer too, and (ZeRO-2) its fragments
    assert list(saved["frozen_param_shapes"]) == ["0.weight", "0.bias"]
    assert torch.equal(saved["frozen_param_fragments"]["0.weight"], weights["0.weight"])

    model = _model(1, frozen=True)
    theirs, their_opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=_config(2))  # fmt: skip
    their_lines = ds_lines[len(ours_lines):]
    for name in ("nccl_start_alignment_factor", "partition_count"):
        assert getattr(opt, name) == getattr(their_opt, name), name
    assert opt.bit16_groups_flat[0].dtype == their_opt.bit16_groups_flat[0].dtype
    assert [line for line in ours_lines if "Flattening" in line] == [
        line for line in their_lines if "Flattening" in line] == ["Flattening param group 0 on cpu (sufficient memory)"]
    path, client = theirs.load_checkpoint(tmp_path, tag="all", load_module_only=True)
    assert path.endswith("all/mp_rank_00_model_states.pt")
    for name, value in theirs.module.state_dict().items():
        assert torch.equal(value, weights[name]), name
    # and torsh still loads its own checkpoint from the DCP files (the DeepSpeed file beside them is not read)
    again, _ = _ours(_model(2, frozen=True), _config(2))
    again.load_checkpoint(tmp_path, tag="all")
    assert all(torch.equal(v, weights[k]) for k, v in again.module.state_dict().items())
    assert again.global_steps == 1


@pytest.mark.parametrize("stage", [1, 2])
def test_accumulated_grads_in_cpu_are_the_accumulated_partition_gradients(one_rank, stage):
    """Under optimizer offload: this rank's elements of the gradient accumulated since the last step, read live;
    empty after the step; keyed by DeepSpeed's parameter id."""
    config = {**_config(stage, offload_optimizer={"device": "cpu"}), "gradient_accumulation_steps": 2,
              "zero_force_ds_cpu_optimizer": False}  # fmt: skip
    model = _model(0)
    reference = _model(0).to(torch.bfloat16)
    engine, opt = _ours(model, config)
    seen = _step(engine, gas=2)
    assert len(opt.accumulated_grads_in_cpu) == 0 and dict(opt.accumulated_grads_in_cpu) == {}
    for i in range(2):
        x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        (reference(x).float().pow(2).mean() / 2).backward()
        expected = [p.grad.float().reshape(-1) for p in reference.parameters()]
        assert sorted(seen[i]) == [0, 1, 2, 3]
        for pid, grad in seen[i].items():
            assert grad.device.type == "cpu"
            assert torch.allclose(grad.float(), expected[pid], rtol=2e-2, atol=1e-3), (i, pid)
    assert not torch.equal(seen[0][0], seen[1][0])  # the second backward added to the first
    with pytest.raises(KeyError):
        opt.accumulated_grads_in_cpu[4]


def test_several_buckets_have_no_contiguous_partition(one_rank):
    """A group reduced in several buckets: one flat buffer still, but no contiguous partition per rank, which
    reading parallel_partitioned_bit16_groups says, naming reduce_bucket_size."""
    engine, opt = _ours(_model(0), _config(2, reduce_bucket_size=40))
    assert len(engine._shard.partition.buckets) > 1
    flat = opt.bit16_groups_flat[0]
    assert flat.numel() >= sum(p.numel() for p in engine.module.parameters())
    with pytest.raises(NotImplementedError, match="reduce_bucket_size"):
        opt.parallel_partitioned_bit16_groups[0]
    before = [p.detach().clone() for p in engine.module.parameters()]
    _step(engine)
    assert all(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))  # stepped through it


def test_checkpoint_round_trip_keeps_the_optimizer_groups(one_rank, tmp_path):
    """Saving and loading through the partition's whole view leaves each group's keys as they were (a load once
    added the drop-in FusedAdam's defaults to them)."""
    engine, opt = _ours(_model(0), {**_config(2), "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
    _step(engine)
    before = {k: v for k, v in opt.state_dict()["param_groups"][0].items()}
    engine.save_checkpoint(tmp_path)
    engine.load_checkpoint(tmp_path)
    assert opt.state_dict()["param_groups"][0] == before


@pytest.mark.parametrize("stage", [0, 3])
def test_model_states_file_only_where_a_rank_holds_the_whole_model(one_rank, tmp_path, stage):
    """Stage 0: DeepSpeed's file, without the ZeRO entries; stage 3 (FSDP2 shards): none (the DCP files only)."""
    engine, _ = _ours(_model(0), _config(stage))
    engine.save_checkpoint(tmp_path, tag="t")
    file = tmp_path / "t" / "mp_rank_00_model_states.pt"
    if stage == 3:
        assert not file.exists() and (tmp_path / "t" / ".metadata").is_file()
        return
    saved = torch.load(file, weights_only=True)
    assert saved["param_shapes"] is None and saved["shared_params"] is None and saved["optimizer"] is None
    assert all(torch.equal(v, saved["module"][k]) for k, v in engine.module.state_dict().items())


def test_tied_weights_are_recorded_and_merge_as_one_tensor(one_rank, tmp_path):
    """The engine state records the tied parameters (DeepSpeed's shared_params), and so does DeepSpeed's file at
    ZeRO; the merged checkpoint holds the tied weight once, under both names."""
    from torsh.engine.checkpoint.merge import merge_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN))
    model[1].weight = model[0].weight
    engine, _ = _ours(model, _config(2))
    engine.save_checkpoint(tmp_path, tag="t")
    saved = torch.load(tmp_path / "t" / "mp_rank_00_model_states.pt", weights_only=True)
    assert saved["shared_params"] == {"1.weight": "0.weight"}
    merged = merge_state_dict(tmp_path / "t")
    assert merged["1.weight"] is merged["0.weight"] and merged["1.bias"] is not merged["0.bias"]
