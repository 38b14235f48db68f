"""DeepSpeedEngine API members of the torsh engine, on one in-process gloo rank: ``coalesce_grad_reduction()`` at
ZeRO-1/2/3 (the same weights as the backwards reduced one by one, DeepSpeed's refusals), DeepSpeed's module-cast
helpers called on stand-in objects, and DeepSpeed's RuntimeError for a direct ``loss.backward()`` at stage 0."""

from __future__ import annotations

import re
import types

import pytest

torch = pytest.importorskip("torch")

from torsh.engine.engine import Engine  # noqa: E402

HIDDEN = 8


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    for key, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _config(stage: int, **extra) -> dict:
    return {"train_batch_size": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}, **extra}  # fmt: skip


def _engine(config: dict):
    import torsh

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))
    engine, *_ = torsh.initialize(model=model, config=config)
    return engine


def _weights(engine) -> dict:
    out = {}
    for name, p in engine.module.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = p.detach().float().clone()
    return out


def _train(engine, coalesce: bool, chunks: int = 3) -> dict:
    import contextlib

    torch.manual_seed(1)
    batches = [torch.randn(2, HIDDEN) for _ in range(chunks)]
    with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
        for i, x in enumerate(batches):
            loss = engine(x.to(torch.bfloat16)).float().pow(2).mean()
            engine.set_gradient_accumulation_boundary(i == chunks - 1)
            engine.backward(loss)
    engine.step()
    return _weights(engine)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_coalesced_backwards_step_the_same_weights(one_rank, stage):
    """Three backwards in the block, one reduction at its end: the step moves the weights as when each backward
    was reduced on its own (the same sum of gradients)."""
    reference = _train(_engine(_config(stage)), coalesce=False)
    engine = _engine(_config(stage))
    with engine.coalesce_grad_reduction():  # a block without a backward (here before any forward) reduces nothing
        pass
    coalesced = _train(engine, coalesce=True)
    for name, value in reference.items():
        torch.testing.assert_close(coalesced[name], value, rtol=0, atol=1e-5)
    if stage == 3:  # DeepSpeed's ZeRO-3 optimizer member: no reduced micro-step since the step
        assert engine.optimizer.micro_step_id == 0


def test_coalesce_refusals_and_boundary(one_rank):
    """DeepSpeed's refusals (stage 0, pipeline parallelism, nesting either way with no_sync, step inside the
    block), and the boundary flag set before the block is the one after it."""
    with pytest.raises(NotImplementedError, match="stage 1/2/3, got stage 0"):
        with _engine(_config(0)).coalesce_grad_reduction():
            pass
    engine = _engine(_config(1))
    engine.pipeline_parallelism = True
    with pytest.raises(NotImplementedError, match="pipeline parallelism"):
        with engine.coalesce_grad_reduction():
            pass
    engine.pipeline_parallelism = False
    with engine.no_sync():
        with pytest.raises(AssertionError, match="nested"):
            with engine.coalesce_grad_reduction():
                pass
    engine.set_gradient_accumulation_boundary(False)
    assert engine._is_gradient_accumulation_boundary is False
    with engine.coalesce_grad_reduction():
        with pytest.raises(AssertionError, match="no_sync"):
            engine.step()
        with pytest.raises(AssertionError, match="no_sync"):
            with engine.no_sync():
                pass
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(engine(torch.randn(2, HIDDEN).to(torch.bfloat16)).float().sum())
    assert engine._is_gradient_accumulation_boundary is False
    engine.__dict__["_experts"] = object()  # local MoE experts reduce over their own groups: not coalesced
    with pytest.raises(NotImplementedError, match="expert parallelism"):
        with engine.coalesce_grad_reduction():
            pass
    engine.__dict__["_experts"] = None
    with pytest.raises(ValueError, match="inside"):  # an error in the block: no flush, the settings go back
        with engine.coalesce_grad_reduction():
            engine.backward(engine(torch.randn(2, HIDDEN).to(torch.bfloat16)).float().sum())
            raise ValueError("inside")
    assert not engine._in_no_sync and engine.__dict__["_coalescing"] is None
    bf16_accum = _config(1, data_types={"grad_accum_dtype": "fp32"})  # DeepSpeed's BF16_Optimizer there
    with pytest.raises(NotImplementedError, match="optimizer wrapper"):
        with _engine(bf16_accum).coalesce_grad_reduction():
            pass


def test_direct_backward_raises_at_stage_0_only(one_rank):
    """DeepSpeed's RuntimeError for ``loss.backward()`` on the engine's output at ZeRO stage 0 (nothing would
    reduce the gradients); ``engine.backward`` and ``torch.func`` transforms are not refused, nor is a direct
    backward at stage 1 (DeepSpeed's ZeRO optimizers complete it)."""
    config = _config(0, bf16={"enabled": False})
    engine = _engine(config)
    x = torch.randn(2, HIDDEN)
    with pytest.raises(RuntimeError, match="Direct calls to tensor.backward"):
        engine(x).sum().backward()
    engine.backward(engine(x).sum())
    params = {n: p.detach() for n, p in engine.module.named_parameters()}
    grads = torch.func.grad(lambda p: torch.func.functional_call(engine, {f"module.{k}": v for k, v in p.items()},
                                                                 (x,)).sum())(params)  # fmt: skip
    assert set(grads) == set(params)
    engine(x).sum().detach()  # an output never backpropagated: nothing happens
    weight = engine.module[0].weight
    hooks = getattr(weight, "_backward_hooks", None)
    engine.module.forward = lambda x, _w=weight: (x @ _w.T, _w)  # a model returning its own parameter
    engine(x)
    assert getattr(weight, "_backward_hooks", None) == hooks  # no guard left on the parameter itself
    _engine(_config(1, bf16={"enabled": False}))(x).sum().backward()


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_forward_without_backward_frees_its_activations_at_once(one_rank, stage):
    """The hooks on the forward's outputs hold nothing of its graph: an output dropped without a backward (an
    evaluation pass with grad enabled) frees the tensors the graph saved at once, without the cyclic garbage
    collector (was: hook and grad_fn kept each other, 437 MiB more peak memory over 30 such passes of a 4 x 1024 MLP)."""
    import gc
    import weakref

    engine = _engine(_config(stage, bf16={"enabled": False}))
    saved = []
    engine.module[1].register_forward_hook(lambda m, i, o: saved.append(weakref.ref(o)))  # ReLU's output: saved
    gc.disable()
    try:
        out = engine(torch.randn(2, HIDDEN)).sum()
        assert saved[-1]() is not None
        del out
        assert saved[-1]() is None
    finally:
        gc.enable()


def test_direct_backward_under_fp16_loss_scaling_needs_engine_scale(one_rank):
    """DeepSpeed's rule for a direct backward under a loss scaler: ``loss.backward()`` raises (before any gradient
    is made), ``engine.scale(loss).backward()`` steps the weights ``engine.backward(loss)`` steps."""
    config = _config(1, bf16={"enabled": False}, fp16={"enabled": True, "initial_scale_power": 8})
    x = torch.randn(2, HIDDEN, dtype=torch.float16)
    engine = _engine(config)
    with pytest.raises(RuntimeError, match=r"engine\.scale\(loss\)\.backward\(\)"):
        engine(x).float().pow(2).mean().backward()
    assert all(p.grad is None for p in engine.module.parameters())
    for _ in range(2):
        engine.scale(engine(x).float().pow(2).mean()).backward()
        engine.step()
    reference = _engine(config)
    for _ in range(2):
        reference.backward(reference(x).float().pow(2).mean())
        reference.step()
    mine, theirs = _weights(engine), _weights(reference)
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    assert any(not torch.equal(mine[n], _weights(_engine(config))[n]) for n in mine)  # the steps moved them
    with pytest.raises(AssertionError, match="scalar tensor"):  # DeepSpeed asserts it (also a ValueError)
        engine.scale(engine(x))


def test_zero_optimizers_are_deepspeeds_zero_optimizer_with_needs_scaler(one_rank):
    """DeepSpeed's ZeRO optimizers (stages 1-3) are ``ZeROOptimizer`` instances whose ``needs_scaler()`` says whether
    a direct backward needs ``engine.scale(loss)`` (fp16 with a loss scaler); DeepSpeed's own test checks both
    before calling ``loss.backward()``. At stage 0 the optimizer is not one. ``deepspeed.ZeROOptimizer`` is the same
    class."""
    import torsh.compat.deepspeed as ds
    from torsh.compat.deepspeed.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer
    from torsh.compat.deepspeed.utils import safe_get_full_grad

    assert ds.ZeROOptimizer is ZeROOptimizer and ds.DeepSpeedOptimizer is DeepSpeedOptimizer
    assert issubclass(ZeROOptimizer, DeepSpeedOptimizer)
    assert not isinstance(_engine(_config(0)).optimizer, (ZeROOptimizer, DeepSpeedOptimizer))
    for stage in (1, 2, 3):
        engine = _engine(_config(stage))
        assert isinstance(engine.optimizer, ZeROOptimizer) and isinstance(engine.optimizer, DeepSpeedOptimizer)
        assert engine.optimizer.needs_scaler() is False
        # bf16: a direct backward needs no engine.scale (DeepSpeed's check; its numerics are tested on 2 ranks)
        engine(torch.randn(2, HIDDEN, dtype=torch.bfloat16)).float().sum().backward()
        assert all(safe_get_full_grad(p) is not None for p in engine.module.parameters())
    fp16 = _engine(_config(1, bf16={"enabled": False}, fp16={"enabled": True}))
    assert fp16.optimizer.needs_scaler() is True

    class ScriptWrapper(ZeROOptimizer):  # a subclass keeps the usual check
        pass

    assert not isinstance(fp16.optimizer, ScriptWrapper) and isinstance(ScriptWrapper(), ZeROOptimizer)


def _stand_in(param_dtype=None, buffer_dtype=None, fp16=False, bf16=False):
    config = types.SimpleNamespace(param_dtype=param_dtype, buffer_dtype=buffer_dtype)
    return types.SimpleNamespace(_config=config, fp16_enabled=lambda: fp16, bfloat16_enabled=lambda: bf16)


def test_mixed_precision_helpers_on_stand_ins():
    """DeepSpeed's static helpers, called on the class with stand-in objects as DeepSpeed's tests and some
    scripts do: the dtypes DeepSpeed resolves, its AssertionError for a conflicting param_dtype, its cast."""
    assert Engine._mixed_precision_dtypes(_stand_in(bf16=True)) == (torch.bfloat16, None)
    assert Engine._mixed_precision_dtypes(_stand_in(fp16=True, buffer_dtype="float")) == (torch.float16,
                                                                                            torch.float32)
    assert Engine._mixed_precision_dtypes(_stand_in(buffer_dtype="bfloat16")) == (None, torch.bfloat16)
    Engine._assert_valid_mixed_precision_config(_stand_in(param_dtype="bf16", bf16=True))
    Engine._assert_valid_mixed_precision_config(_stand_in(param_dtype="fp32"))
    for param_dtype, fp16, bf16 in (("fp16", False, True), ("bf16", False, False), ("bf16", True, False)):
        with pytest.raises(AssertionError, match="param_dtype"):
            Engine._assert_valid_mixed_precision_config(_stand_in(param_dtype=param_dtype, fp16=fp16, bf16=bf16))
    with pytest.raises(ValueError, match="not a dtype"):
        Engine._mixed_precision_dtypes(_stand_in(buffer_dtype="fp8"))

    def module():
        m = torch.nn.Sequential(torch.nn.Linear(4, 4))
        m.register_buffer("inv_freq", torch.ones(4))
        m.register_buffer("bias_keep", torch.ones(4, dtype=torch.bfloat16))
        return m

    m = module()
    Engine._cast_module_mixed_precision(types.SimpleNamespace(module=m), torch.bfloat16, None, False)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16} and m.inv_freq.dtype == torch.float32
    m = module()
    Engine._cast_module_mixed_precision(types.SimpleNamespace(module=m), torch.bfloat16, torch.float16, True,
                                        keep_pattern=re.compile("bias_keep"))  # fmt: skip
    assert {p.dtype for p in m.parameters()} == {torch.float32}  # zero.Init owns the parameters' dtype
    assert (m.inv_freq.dtype, m.bias_keep.dtype) == (torch.float16, torch.float32)


def test_zero3_optimizer_is_deepspeeds_stage3_optimizer(one_rank):
    """At ZeRO-3 ``engine.optimizer`` is an instance of ``DeepSpeedZeroOptimizer_Stage3`` with the members scripts
    read (group gradient norms that make the step's norm, the reduced micro-steps); at ZeRO-1 it is not one."""
    from torsh.compat.deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    assert not isinstance(_engine(_config(1)).optimizer, DeepSpeedZeroOptimizer_Stage3)
    engine = _engine(_config(3))
    optimizer = engine.optimizer
    assert isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) and optimizer.micro_step_id == 0
    engine.backward(engine(torch.randn(2, HIDDEN).to(torch.bfloat16)).float().pow(2).mean())
    norms = optimizer._get_norm_groups()
    assert len(norms) == len(optimizer.param_groups) and optimizer.micro_step_id == 1
    engine.step()
    assert optimizer._global_grad_norm == pytest.approx(float(torch.linalg.vector_norm(torch.stack(norms))))
    assert optimizer.micro_step_id == 0
    with pytest.raises(NotImplementedError, match="not supported by torsh"):
        DeepSpeedZeroOptimizer_Stage3()


def test_zero_modules_hold_count_used_parameters_in_backward():
    """DeepSpeed's ZeRO optimizer modules import ``count_used_parameters_in_backward`` (scripts and tests patch it
    there); the drop-in's hold the same function as ``deepspeed.runtime.utils``."""
    from torsh.compat.deepspeed.runtime import utils
    from torsh.compat.deepspeed.runtime.zero import stage3, stage_1_and_2

    assert stage3.count_used_parameters_in_backward is utils.count_used_parameters_in_backward
    assert stage_1_and_2.count_used_parameters_in_backward is utils.count_used_parameters_in_backward


def test_the_pipeline_engine_says_it_is_one_as_deepspeeds():
    from torsh.engine.engine import Engine
    from torsh.engine.pipeline.engine import PipelineEngine

    assert PipelineEngine.pipeline_parallelism is True and Engine.pipeline_parallelism is False
