"""Drop-in modules: activation offload, checkpointing globals, DeepSpeedCPUAdam's sub-group step, checkpoint reshaping
helpers and the fp32 converter's tied weights; compared with DeepSpeed 0.19.8 where that is cheap."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from torsh.compat.deepspeed.runtime.activation_checkpointing import checkpointing
from torsh.compat.deepspeed.runtime.activation_checkpointing import offload_activations as oa


# ---- activation offload ----------------------------------------------------------------------------------------
class _PretendAccelerator:
    """CPU tensors count as on an accelerator with streams, so the offload path runs on a CPU-only machine."""

    def __init__(self):
        self.pinned = 0

    def is_synchronized_device(self):
        return False

    def on_accelerator(self, tensor):
        return True

    def pin_memory(self, tensor, align_bytes=1):
        self.pinned += 1
        return tensor


@pytest.fixture
def pretend(monkeypatch):
    accelerator = _PretendAccelerator()
    monkeypatch.setattr(oa, "get_accelerator", lambda: accelerator)
    return accelerator


def _chain(layers, x, manager=None):
    h = x
    for layer in layers:
        if manager is not None:
            manager.mark(h)
        h = checkpoint(layer, h, use_reentrant=False)
    return h.square().sum()


@pytest.mark.parametrize("keep_last_count", [0, 1, 2])
def test_offloaded_inputs_give_the_same_gradients_and_stay_newest_on_device(pretend, keep_last_count):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
    x = torch.randn(3, 8, requires_grad=True)
    _chain(layers, x).backward()
    expected = [x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad(set_to_none=True)
    x.grad = None
    manager = oa.get_checkpoint_hidden_states_offloading_ctx_manager(min_offload_bytes=0,
                                                                     keep_last_count=keep_last_count)
    for _ in range(2):  # the second step takes its host buffers from the pool
        layers.zero_grad(set_to_none=True)
        x.grad = None
        with manager:
            loss = _chain(layers, x, manager)
            assert list(manager._keep_last) == list(range(5 - keep_last_count, 5))[:keep_last_count]
            assert all(buffer.device.type == "cpu" for buffer, *_ in manager._tracker.values())
            loss.backward()
        got = [x.grad] + [p.grad for p in layers.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        stats = manager.stats
        assert (stats.marked_tensors, stats.offloaded_tensors, stats.restored_tensors, stats.kept_last_tensors) == (
            4, 4 - keep_last_count, 4 - keep_last_count, keep_last_count)
    assert pretend.pinned == 4 - keep_last_count  # pinned once; the pool served the second step
    assert manager._cpu_buffer_pool_count == 4 - keep_last_count


def test_offload_restores_strided_views_and_serves_a_second_backward(pretend):
    base = torch.randn(6, 8)
    x = base[:, ::2].detach().requires_grad_(True)
    manager = oa.CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=0, use_pin_memory=False)
    with manager:
        manager.mark(x)
        loss = checkpoint(lambda t: t.sin().square(), x, use_reentrant=False).sum()
        buffer = next(iter(manager._tracker.values()))[0]
        assert buffer.is_contiguous() and buffer.shape == x.shape and pretend.pinned == 0
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        x.grad = None
        loss.backward()
    assert torch.allclose(x.grad, first) and torch.allclose(first, 2 * x.sin() * x.cos())
    assert manager.stats.restored_tensors == 1


def test_offload_leaves_small_parameter_and_overlapping_tensors_and_cpu_ones():
    manager = oa.CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=0)
    x = torch.randn(4, 8, requires_grad=True)
    with manager:  # on the CPU accelerator nothing moves
        manager.mark(x)
        checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
    assert (manager.stats.marked_tensors, manager.stats.skipped_marked_tensors, manager.stats.offloaded_tensors) == (
        1, 1, 0)


@pytest.mark.parametrize("tensor", [torch.nn.Parameter(torch.randn(4, 8)), torch.randn(4, 8).expand(2, 4, 8),
                                    torch.randn(2)])  # fmt: skip
def test_offload_skips_what_it_cannot_or_need_not_move(pretend, tensor):
    manager = oa.CheckpointHiddenStatesOffload(min_offload_bytes=16, keep_last_count=0)
    assert manager._stays(tensor)


def test_offload_options_are_checked_and_the_manager_is_not_reentrant():
    with pytest.raises(ValueError, match="keep_last_count must be >= 0, got -1"):
        oa.CheckpointHiddenStatesOffload(keep_last_count=-1)
    manager = oa.CheckpointHiddenStatesOffload()
    with manager:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            manager.__enter__()


def test_offload_marks_gradient_checkpointing_layers_only_inside_the_block():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GradientCheckpointingLayer"):
        pytest.skip("transformers has no GradientCheckpointingLayer")
    from functools import partial

    layer_cls = transformers.GradientCheckpointingLayer
    original = layer_cls.__call__

    class Layer(layer_cls):
        def forward(self, hidden_states):
            return hidden_states.sin()

    layer = Layer()
    layer.gradient_checkpointing, layer._gradient_checkpointing_func = True, partial(checkpoint, use_reentrant=False)
    outer, inner = oa.CheckpointHiddenStatesOffload(), oa.CheckpointHiddenStatesOffload()
    with outer:
        with inner:
            layer(torch.randn(2, 4, requires_grad=True))
        assert layer_cls.__call__ is not original
    assert layer_cls.__call__ is original
    assert (outer.stats.marked_tensors, inner.stats.marked_tensors) == (0, 1)  # the innermost manager marks
    with pytest.raises(ValueError, match="boom"), outer:
        raise ValueError("boom")
    assert layer_cls.__call__ is original


def test_offload_counts_match_deepspeed_on_the_cpu():
    deepspeed_oa = pytest.importorskip("deepspeed.runtime.activation_checkpointing.offload_activations")

    def run(module):
        manager = module.CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0)
        x = torch.randn(4, 8, requires_grad=True)
        with manager:
            manager.mark(x)
            checkpoint(torch.nn.Linear(8, 8), x, use_reentrant=False).square().sum().backward()
        return manager.stats.__dict__

    assert run(oa) == run(deepspeed_oa)


# ---- deepspeed.checkpointing's module globals ------------------------------------------------------------------
def test_checkpointing_configure_sets_deepspeeds_globals_and_checks_contiguous_needs():
    saved = {name: getattr(checkpointing, name) for name in checkpointing._GLOBALS.values()}
    try:
        checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"partition_activations": True,
                                                                                    "number_checkpoints": 3}})
        assert checkpointing.PARTITION_ACTIVATIONS is True and checkpointing.num_layers == 3
        assert checkpointing.is_configured() and checkpointing.deepspeed_checkpointing_enabled
        checkpointing.configure(None, checkpoint_in_cpu=True)  # each call starts from the defaults
        assert checkpointing.CPU_CHECKPOINT and not checkpointing.PARTITION_ACTIVATIONS
        assert checkpointing.num_layers is None
        with pytest.raises(AssertionError, match="number of layers"):
            checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
        with pytest.raises(ValueError, match="needs partition_activations"):
            checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    finally:
        for name, value in saved.items():
            setattr(checkpointing, name, value)


# ---- DeepSpeedCPUAdam ------------------------------------------------------------------------------------------
def _cpu_adam():
    from torsh.compat.deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam


def test_cpu_adam_steps_bf16_parameters_in_fp32_with_fp32_moments():
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64).bfloat16())
    reference = torch.nn.Parameter(param.detach().double())
    optimizer = _cpu_adam()([param], lr=1e-2, weight_decay=0.1)
    torch_adamw = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        grad = torch.randn(64).bfloat16()
        param.grad, reference.grad = grad, grad.double()
        optimizer.step()
        torch_adamw.step()
        reference.data.copy_(param.detach().double())  # the reference continues from the bf16-rounded parameter
    state = optimizer.state[param]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32 and int(state["step"]) == 3
    assert torch.allclose(state["exp_avg"].double(), torch_adamw.state[reference]["exp_avg"], atol=1e-6)
    kept = _cpu_adam()([torch.nn.Parameter(torch.randn(4).bfloat16())], fp32_optimizer_states=False)
    kept.param_groups[0]["params"][0].grad = torch.randn(4).bfloat16()
    kept.step()
    assert next(iter(kept.state.values()))["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpu_adam_rollback_subgroup_undoes_step_subgroup(adamw_mode):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(32))
    optimizer = _cpu_adam()([param], lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
    for _ in range(2):
        param.grad = torch.randn(32)
        optimizer.step_subgroup(7)
    before = param.detach().clone(), *(optimizer.state[7][k].clone() for k in ("exp_avg", "exp_avg_sq"))
    param.grad = torch.randn(32)
    optimizer.step_subgroup(7)
    assert int(optimizer.state[7]["step"]) == 3 and 7 in optimizer.state and param not in optimizer.state
    optimizer.rollback_subgroup(7)
    after = param.detach(), optimizer.state[7]["exp_avg"], optimizer.state[7]["exp_avg_sq"]
    assert int(optimizer.state[7]["step"]) == 2
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(after, before))


def test_cpu_adam_subgroup_errors_name_the_sub_group():
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    optimizer = _cpu_adam()(params)
    with pytest.raises(RuntimeError, match="sub_group_id 3 as it has not been initialized"):
        optimizer.rollback_subgroup(3)
    params[0].grad = params[1].grad = torch.randn(4)
    with pytest.raises(ValueError, match="2 parameters have a gradient"):
        optimizer.step_subgroup(0)
    params[1].grad = None
    optimizer.step_subgroup(0)
    optimizer.rollback_subgroup(0)
    with pytest.raises(RuntimeError, match="Cannot rollback sub_group_id 0: step count is 0"):
        optimizer.rollback_subgroup(0)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        _cpu_adam()(params, amsgrad=True)


def test_cpu_adam_runs_step_hooks_once_and_matches_torch_adamw_in_fp32():
    torch.manual_seed(0)
    param, reference = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    reference.data.copy_(param.detach())
    optimizer, torch_adamw = _cpu_adam()([param]), torch.optim.AdamW([reference], weight_decay=0)
    calls = []
    optimizer.register_step_post_hook(lambda *args: calls.append(1))
    param.grad = reference.grad = torch.randn(8)
    optimizer.step()
    torch_adamw.step()
    assert calls == [1] and torch.equal(param.detach(), reference.detach())


# ---- deepspeed.checkpoint's readers of Megatron-DeepSpeed checkpoint folders --------------------------------------
SHAPES = [((2, 2, 2), (1, 1, 1)), ((2, 2, 2), (1, 2, 1)), ((2, 2, 2), (2, 1, 2)), ((4, 2, 3), (2, 1, 3)),
          ((2, 4, 4), (1, 2, 2)), ((3, 1, 2), (1, 1, 1))]  # fmt: skip


def _maps(module, src, tgt):
    return [{(i, j): m.get_data(i, j) for i in range(m.pp_degree) for j in range(m.tp_degree)}
            for m in module.model_3d_desc(*src).reshape(module.model_3d_desc(*tgt))]  # fmt: skip


@pytest.mark.parametrize("src, tgt", SHAPES)
def test_checkpoint_reshape_maps_match_deepspeed(src, tgt):
    from torsh.compat.deepspeed import checkpoint as ours

    theirs = pytest.importorskip("deepspeed.checkpoint")
    assert _maps(ours, src, tgt) == _maps(theirs, src, tgt)


def test_checkpoint_reshape_refuses_growing_and_uneven_degrees():
    from torsh.compat.deepspeed.checkpoint import model_3d_desc, reshape_meg_2d_parallel

    ok, errors = model_3d_desc(1, 2, 2).can_reshape(model_3d_desc(2, 1, 2))
    assert not ok and errors == ["Expansion reshape not supported - PP: 1 ---> 2"]
    with pytest.raises(ValueError, match="PP: 1 ---> 2"):
        model_3d_desc(1, 2, 2).reshape(model_3d_desc(2, 1, 2))
    with pytest.raises(ValueError, match="cannot split 3 items into 2 equal parts"):
        reshape_meg_2d_parallel(1, 3, 1, 2)


def _write_megatron_folder(folder, dims=None):
    """A pipeline 2 x tensor 1 x data 2 checkpoint with padded bf16 ZeRO files (two steps of a 3-element group)."""
    from torsh.compat.deepspeed.checkpoint import constants as c

    for mp in range(2):
        state = {c.PARAM_SHAPES: [{f"w{mp}": torch.Size([3])}], "iteration": 7, "args": {"mp": mp}}
        if dims:
            state[c.CHECKPOINT_PARALLEL_DIMS] = dims
        torch.save(state, folder / f"mp_rank_{mp:02d}_model_states.pt")
        for dp in range(2):
            flat = torch.arange(4.0) + 10 * mp + 100 * dp  # 3 values and 1 of padding
            optimizer = {c.GROUP_PADDINGS: [1], c.PARTITION_COUNT: [2],
                         c.BASE_OPTIMIZER_STATE: {"state": {0: {"exp_avg": flat, "step": 3}}}}
            name = f"bf16_zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"
            torch.save({c.OPTIMIZER_STATE_DICT: optimizer}, folder / name)


def _describe(module, folder):
    checkpoint = module.DeepSpeedCheckpoint(str(folder), pp_degree=1, dp_degree=1)
    state = checkpoint.get_zero_checkpoint_state(0, 0, 0)["optimizer_state_dict"]
    return ((checkpoint.pp_degree, checkpoint.tp_degree, checkpoint.dp_degree, checkpoint.original_world_size),
            checkpoint.get_iteration(), checkpoint.get_args(), [os.path.basename(p) for p in checkpoint.mp_rank_files],
            checkpoint.get_2d_parallel_files(0, 0) == checkpoint.mp_rank_files, state["partition_count"],
            state["group_paddings"], state["base_optimizer_state"]["state"][0]["exp_avg"].tolist())  # fmt: skip


@pytest.mark.parametrize("dims", [None, {"pp_degree": 2, "tp_degree": 1}])
def test_deepspeed_checkpoint_reads_a_folder_as_deepspeed_does(tmp_path, dims):
    from torsh.compat.deepspeed import checkpoint as ours

    theirs = pytest.importorskip("deepspeed.checkpoint")
    _write_megatron_folder(tmp_path, dims)
    if dims is None:  # counted from the files: two model-state files are two tensor ranks
        assert ours.get_model_3d_descriptor(str(tmp_path)).get_desc() == "PP,TP,DP = (1, 2, 2)"
        return
    described = _describe(ours, tmp_path)
    assert described == _describe(theirs, tmp_path)
    assert described[0] == (1, 1, 1, 4) and described[-1] == [0, 1, 2, 100, 101, 102, 10, 11, 12, 110, 111, 112]


def test_checkpoint_parallel_metadata_reads_the_mpu_spellings():
    from types import SimpleNamespace

    from torsh.compat.deepspeed.checkpoint.utils import checkpoint_parallel_metadata

    megatron = SimpleNamespace(get_pipeline_model_parallel_world_size=lambda: 4,
                               get_tensor_model_parallel_world_size=lambda: 2)
    expected = {"checkpoint_parallel_dimensions": {"pp_degree": 4, "tp_degree": 2}}
    assert checkpoint_parallel_metadata(megatron) == expected
    assert checkpoint_parallel_metadata(None)["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": 1}
    from torsh.compat.deepspeed.runtime.engine import _checkpoint_parallel_metadata  # where DeepSpeed's tests import it

    assert _checkpoint_parallel_metadata is checkpoint_parallel_metadata


# ---- zero_to_fp32: tied weights stay one tensor -------------------------------------------------------------------
class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1, self.layer2 = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.layer1.weight = self.layer2.weight


def _tied_checkpoint(root, shared_params):
    from torsh.engine.checkpoint.save_load import save_checkpoint

    model = _Tied()
    save_checkpoint(root, "t", model=model, optimizer=torch.optim.AdamW(model.parameters()), lr_scheduler=None,
                    loss_scaler=None, engine_state={"global_steps": 1, "shared_params": shared_params},
                    client_state={}, save_latest=True)  # fmt: skip
    return model


@pytest.mark.parametrize("dtype", [None, "fp16"])
def test_zero_to_fp32_keeps_a_recorded_tied_weight_as_one_tensor(tmp_path, dtype):
    from torsh.compat.deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    model = _tied_checkpoint(tmp_path / "ckpt", {"layer1.weight": "layer2.weight"})
    convert_zero_checkpoint_to_state_dict(tmp_path / "ckpt", tmp_path / "out", dtype=dtype)
    state = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert state["layer1.weight"] is state["layer2.weight"] and state["layer1.bias"] is not state["layer2.bias"]
    assert torch.equal(state["layer1.weight"].float(), model.layer2.weight.detach().half().float() if dtype
                       else model.layer2.weight.detach())  # fmt: skip
    _Tied().load_state_dict(state, strict=True)


def test_merge_refuses_a_tie_record_that_the_values_contradict(tmp_path):
    from torsh.engine.checkpoint.merge import merge_state_dict
    from torsh.errors import ConfigError

    _tied_checkpoint(tmp_path / "ckpt", {"layer1.bias": "layer2.bias"})  # the biases are not tied
    with pytest.raises(ConfigError, match="records layer1.bias as tied to layer2.bias"):
        merge_state_dict(tmp_path / "ckpt" / "t")
    _tied_checkpoint(tmp_path / "old", {})  # nothing recorded: the names stay separate tensors
    state = merge_state_dict(tmp_path / "old" / "t")
    assert state["layer1.weight"] is not state["layer2.weight"]


def test_checkpoint_readers_run_no_code_from_the_files(tmp_path):
    """DeepSpeed's readers unpickle with weights_only=False; torsh's read the files as its checkpoint loader does:
    a pickle that would call a function is refused, naming the file; Megatron's saved arguments still read."""
    import argparse
    import pickle

    from torsh.compat.deepspeed.checkpoint.deepspeed_checkpoint import _load
    from torsh.engine.checkpoint.io import CheckpointError

    class _Payload:
        def __reduce__(self):
            return (print, ("ran",))

    bad = tmp_path / "mp_rank_00_model_states.pt"
    bad.write_bytes(pickle.dumps({"module": _Payload()}))
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt"):
        _load(bad)
    good = tmp_path / "layer_01-model_00-model_states.pt"
    torch.save({"args": argparse.Namespace(tensor_model_parallel_size=2), "w": torch.ones(2)}, good)
    assert _load(good)["args"].tensor_model_parallel_size == 2
