"""Engine members real DeepSpeed scripts use, with DeepSpeed 0.19.8's behaviour, on 2 gloo ranks: ``destroy()``,
``tput_timer``, ``offload_states()``/``reload_states()``, ``data_parallel_group``, ``state_dict()`` keys with
DeepSpeed's ``module.`` prefix, the data-parallel rank helpers, ``compile()``, ``_config``,
``_consolidated_16bit_state_dict()``, ``get_global_grad_norm()`` as a tensor, and the error naming a member the
engine lacks."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import _engine_harness as h  # noqa: E402

pytestmark = pytest.mark.slow

TARGET = "test_engine_dropin_members:members"


def _train(engine, rank: int, steps: int, start: int = 0) -> list[float]:
    return h.train(engine, rank, start, steps)


def members(rank: int, world_size: int, scenario: dict) -> dict:
    """Every member on one engine of ``scenario['config']``; records what the test compares."""
    import torch
    import torch.distributed as dist

    import torsh

    rec: dict = {}
    engine, opt, _, _ = torsh.initialize(model=h.build_model(0), config=scenario["config"])
    rec["timer_before"] = engine.tput_timer.avg_samples_per_sec()
    rec["norm_before"] = engine.get_global_grad_norm()
    rec["losses"] = _train(engine, rank, 2)
    norm = engine.get_global_grad_norm()  # a tensor, as DeepSpeed's ZeRO optimizers give: scripts call .item()
    rec["norm"] = [type(norm).__name__, norm.dim(), norm.item() > 0]
    ds = engine._config  # DeepSpeed's DeepSpeedConfig, with the batch sizes the engine runs with
    rec["ds_config"] = [ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps,
                        ds.zero_optimization_stage, ds.bfloat16_enabled]
    try:
        state = engine._consolidated_16bit_state_dict()
        rec["consolidated"] = None if state is None else sorted(state)
    except ValueError as exc:
        rec["consolidated"] = str(exc)
    # offload/reload around a step: training continues exactly as without (CPU run: nothing moves)
    engine.offload_states()
    inner = getattr(opt, "optim", opt)
    rec["state_devices"] = sorted({str(v.device) for st in inner.state.values() for v in st.values()
                                   if torch.is_tensor(v)})  # fmt: skip
    engine.reload_states()
    # the same through the optimizer, as OpenRLHF calls DeepSpeed's ZeRO optimizer
    opt.offload_states(include=["optim_states", "hp_params"], device="cpu", pin_memory=True, non_blocking=True)
    opt.reload_states(non_blocking=True)
    rec["losses"] += _train(engine, rank, 2, start=2)
    timer = engine.tput_timer
    rec["timer"] = [timer.global_step_count, timer.micro_step_count, timer.batch_size, timer.start_step,
                    timer.avg_samples_per_sec() > 0, timer.total_elapsed_time > 0]  # fmt: skip
    # the data-parallel group and rank helpers
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t, group=engine.data_parallel_group)
    rec["dp"] = [float(t), engine.get_data_parallel_rank(), engine.get_data_parallel_world_size(),
                 engine.dp_world_size, engine.mp_world_size, engine.get_model_parallel_rank()]  # fmt: skip
    # state_dict keys as DeepSpeed's (module.*); a second engine loads them
    state = engine.state_dict()
    rec["keys"] = sorted(state)
    rec["module_keys"] = sorted(engine.module_state_dict())
    rec["named"] = sorted(n for n, _ in engine.named_parameters())
    other, *_ = torsh.initialize(model=h.build_model(1), config=scenario["config"])
    rec["loaded_before"] = [other.loaded_checkpoint_dp_world_size, other.loaded_checkpoint_mp_world_size]
    engine.save_checkpoint(scenario["dir"], tag="m")
    other.load_checkpoint(scenario["dir"], tag="m")
    rec["loaded_after"] = [other.loaded_checkpoint_dp_world_size, other.loaded_checkpoint_mp_world_size]
    other, *_ = torsh.initialize(model=h.build_model(1), config=scenario["config"])
    other.load_state_dict(state)
    x, y = h.batch(9, rank, 2)
    with torch.no_grad():
        rec["same_after_load"] = float((engine(x) - other(x)).abs().max())
    other.compile(backend="eager", compile_kwargs={"dynamic": False})  # what Accelerate calls with a dynamo backend
    other.compile(backend="eager")  # twice: nothing more happens
    rec["compiled"] = [other.is_compiled, engine.is_compiled, other.module._compiled_call_impl is not None,
                       engine.module._compiled_call_impl is None]  # torch.compile wraps the model's call
    rec["plain"] = [engine.mpu, engine.has_moe_layers, engine.sequence_parallel_size, engine.wall_clock_breakdown()]
    rec["other_losses"] = _train(other, rank, 1, start=4)
    rec["engine_losses"] = _train(engine, rank, 1, start=4)
    # the errors: a DeepSpeed member we lack, a name nobody has; the fall-through to the model still works
    rec["fallthrough"] = type(engine.embed).__name__
    for key, name in (("missing_ds", "flops_profiler_enabled"), ("missing_any", "no_such_member"),
                      ("missing_private", "_no_such_member")):
        try:
            getattr(engine, name)
            rec[key] = "no error"
        except AttributeError as exc:
            rec[key] = str(exc)
    rec["hasattr"] = hasattr(engine, "no_such_member")
    # destroy: twice is fine; forward still runs; backward refuses; DDP's hooks leave the model
    engine.destroy()
    engine.destroy()
    with torch.no_grad():
        rec["forward_after_destroy"] = list(engine(x).shape)
    try:
        engine.backward(h.lm_loss(engine(x), y))
        rec["backward_after_destroy"] = "no error"
    except RuntimeError as exc:
        rec["backward_after_destroy"] = str(exc)
    # after destroy the model trains on its own without DDP's reducer in the way (a second backward would
    # raise from an unfinished DDP reduction if its hooks were still registered)
    model = engine.module
    for _ in range(2):
        h.lm_loss(model(x), y).backward()
    rec["raw_after_destroy"] = "ok"
    other.destroy()
    return rec


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("members")
    stages = {"s0": {}, "s1": {"sharding.stage": 1}, "s3": {"sharding.stage": 3},
              "bf16_s0": {"precision.param_dtype": "bf16"}}  # fmt: skip
    scenarios = [{"name": n, "kind": "call", "target": TARGET, "config": h.base_config(**o), "dir": str(tmp / n)}
                 for n, o in stages.items()]  # fmt: skip
    return h.run(scenarios)


@pytest.mark.parametrize("name", ["s0", "s1", "s3", "bf16_s0"])
def test_engine_members(records, name):
    r0, r1 = (r[name] for r in records)
    assert "error" not in r0, r0.get("traceback")
    assert "error" not in r1, r1.get("traceback")
    assert r0["timer_before"] == float("-inf")
    # 4 optimizer steps; the first 2 are warm-up (DeepSpeed's start_step=2); batch 2 x 2 ranks
    assert r0["timer"] == [4, 4, 4, 2, True, True]
    assert r0["state_devices"] == ["cpu"]
    assert r0["dp"] == [3.0, 0, 2, 2, 1, 0] and r1["dp"][1] == 1
    assert r0["keys"] and all(k.startswith("module.") for k in r0["keys"]), r0["keys"]
    assert "module.embed.weight" in r0["keys"] and "module.gain" in r0["keys"]
    assert r0["module_keys"] == sorted(k.removeprefix("module.") for k in r0["keys"])
    assert r0["named"] == sorted(k for k in r0["keys"] if k != "module.gain")
    assert r0["same_after_load"] == 0.0
    assert r0["loaded_before"] == [None, None] and r0["loaded_after"] == [2, 1]  # DeepSpeed's attributes
    assert r0["other_losses"] == pytest.approx(r0["engine_losses"], rel=1e-6)
    assert r0["fallthrough"].endswith("Embedding")  # FSDPEmbedding at stage 3
    assert "'Engine' (torsh's DeepSpeedEngine) has no attribute 'flops_profiler_enabled'" in r0["missing_ds"]
    assert "DeepSpeedEngine has this member; the torsh engine does not implement it" in r0["missing_ds"]
    assert "nor has the wrapped model (TinyLM)" in r0["missing_any"]
    assert "has no such member either" in r0["missing_any"]
    assert "not in DeepSpeed 0.19.8's public engine API either" in r0["missing_private"]
    assert r0["hasattr"] is False
    assert r0["norm_before"] is None and r0["norm"] == ["Tensor", 0, True]
    stage, bf16 = {"s0": (0, False), "s1": (1, False), "s3": (3, False), "bf16_s0": (0, True)}[name]
    assert r0["ds_config"] == [4, 2, 1, stage, bf16]
    if stage == 3:  # rank 0 gets the whole state, the others None (DeepSpeed's)
        assert r0["consolidated"] == sorted(r0["module_keys"]) and r1["consolidated"] is None
    else:
        assert r0["consolidated"].startswith("consolidated_16bit_state_dict is only applicable")
    assert r0["compiled"] == [True, False, True, True]
    assert r0["plain"] == [None, False, 1, False]
    assert r0["forward_after_destroy"] == [2, h.SEQ, h.VOCAB]
    assert "after engine.destroy()" in r0["backward_after_destroy"]
    assert r0["raw_after_destroy"] == "ok"
