"""A DeepSpeed training loop, unchanged, under ``torsh.initialize`` on 2 gloo ranks: every stage, precision,
gradient accumulation and clipping setting trains, and the stages agree with each other."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

import _engine_harness as h  # noqa: E402

pytestmark = pytest.mark.slow

FP32 = {
    "s0": {}, "s1": {"sharding.stage": 1}, "s2": {"sharding.stage": 2}, "s3": {"sharding.stage": 3},
    "s3_offload": {"sharding.stage": 3, "offload.params": "cpu", "offload.optimizer": "cpu"},
    "hsdp": {"sharding.stage": 3, "sharding.hybrid_shard_size": 1},
    "s3_ac": {"sharding.stage": 3, "activation_checkpointing.enabled": True},
    "s3_prefetch": {"sharding.stage": 3, "sharding.forward_prefetch": True, "sharding.wrap.module_classes": ["Block"]},
    "s2_ac_blocks": {"sharding.stage": 2, "activation_checkpointing.enabled": True,
                     "activation_checkpointing.modules": ["Block"], "sharding.wrap.module_classes": ["Block"]},
    "s0_ac_cpu": {"activation_checkpointing.enabled": True, "activation_checkpointing.cpu_offload": True},
    "s0_clip": {"gradients.clip_max_norm": 0.5}, "s3_clip": {"sharding.stage": 3, "gradients.clip_max_norm": 0.5},
    "s0_gas4": {"batch.gradient_accumulation_steps": 4}, "s2_gas4": {"sharding.stage": 2,
                                                                    "batch.gradient_accumulation_steps": 4},
    "s3_gas4": {"sharding.stage": 3, "batch.gradient_accumulation_steps": 4},
    "s0_sum": {"gradients.reduce_op": "sum"}, "s3_sum": {"sharding.stage": 3, "gradients.reduce_op": "sum"},
    "s0_predivide": {"gradients.predivide_factor": 2.0}, "s0_prescale": {"gradients.prescale": True},
}  # fmt: skip
BF16 = {
    f"bf16_s{stage}": {"sharding.stage": stage, "precision.param_dtype": "bf16",
                       "precision.skip_step_on_nonfinite": True} for stage in (0, 1, 2, 3)
}  # fmt: skip
BF16["bf16_s3_gas4_clip"] = {**BF16["bf16_s3"], "batch.gradient_accumulation_steps": 4, "gradients.clip_max_norm": 0.5}
BF16["bf16_s0_gas4_clip"] = {**BF16["bf16_s0"], "batch.gradient_accumulation_steps": 4, "gradients.clip_max_norm": 0.5}
BF16["bf16_s0_accum_fp32"] = {**BF16["bf16_s0_gas4_clip"], "precision.grad_accum_dtype": "fp32",
                              "precision.reduce_dtype": "fp32"}  # fmt: skip
BF16["bf16_s2_gas4_accum_fp32"] = {**BF16["bf16_s2"], "batch.gradient_accumulation_steps": 4,
                                  "precision.grad_accum_dtype": "fp32"}  # fmt: skip
FP16 = {
    f"fp16_s{stage}": {"sharding.stage": stage, "precision.param_dtype": "fp16",
                       "precision.loss_scaling.mode": "dynamic", "precision.loss_scaling.initial_scale": 1024.0}
    for stage in (0, 3)
}  # fmt: skip

SCENARIOS = [{"name": n, "config": h.base_config(**o), "micro_steps": 8 if "gas4" in n else 4}
             for n, o in {**FP32, **BF16, **FP16}.items()]  # fmt: skip
SAVE_16BIT = ("s3", "bf16_s3", "bf16_s0")
SCENARIOS += [
    # an optimizer built on the model before initialize (before fully_shard) is rebuilt and trains
    {"name": "s3_client", "config": {"batch": {"micro_batch_size": 2}, "sharding": {"stage": 3}},
     "client_optimizer": {"lr": 1e-2, "weight_decay": 0.0}},
    {"name": "s1_client", "config": {"batch": {"micro_batch_size": 2}, "sharding": {"stage": 1}},
     "client_optimizer": {"lr": 1e-2, "weight_decay": 0.0}},
    {"name": "warmup", "micro_steps": 8, "config": h.base_config(**{
        "batch.gradient_accumulation_steps": 2,
        "scheduler": {"name": "WarmupLR", "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 2,
                      "warmup_type": "linear"}})},
    {"name": "steplr", "micro_steps": 8, "config": h.base_config(**{
        "sharding.stage": 3, "batch.gradient_accumulation_steps": 2,
        "scheduler": {"name": "StepLR", "kwargs": {"step_size": 1, "gamma": 0.5}}})},
    {"name": "norm_s0", "kind": "first_norm", "config": h.base_config()},
    {"name": "norm_s2", "kind": "first_norm", "config": h.base_config(**{"sharding.stage": 2})},
    {"name": "norm_s3", "kind": "first_norm", "config": h.base_config(**{"sharding.stage": 3})},
    {"name": "norm_s3_off", "kind": "first_norm", "config": h.base_config(**{"sharding.stage": 3,
                                                                             "offload.params": "cpu"})},
    {"name": "accelerate_s0", "kind": "accelerate", "gas": 4,
     "config": h.base_config(**{"batch.gradient_accumulation_steps": 4})},
    {"name": "accelerate_s3", "kind": "accelerate", "gas": 4,
     "config": h.base_config(**{"sharding.stage": 3, "batch.gradient_accumulation_steps": 4})},
    {"name": "nosync_s0", "kind": "nosync", "config": h.base_config(**{"batch.gradient_accumulation_steps": 4})},
    {"name": "nosync_s1", "kind": "nosync", "config": h.base_config(**{"sharding.stage": 1,
                                                                       "batch.gradient_accumulation_steps": 4})},
    {"name": "data", "kind": "dataloader", "config": h.base_config(**{"data.drop_last": True})},
]
SCENARIOS += [
    {"name": "compress_fp16_s0", "config": h.base_config(**{"compression.method": "fp16"})},
    {"name": "compress_powersgd_s1", "config": h.base_config(**{"sharding.stage": 1,
                                                                "compression.method": "powersgd"})},
    {"name": "compress_bf16_s3", "config": h.base_config(**{"sharding.stage": 3, "compression.method": "bf16"})},
]
# The worked trace of the reference (DeepSpeed's ZeRO scaler, window 3, hysteresis 2), overflows at 7-9 and 14.
ZERO_TRACE = [65536, 65536, 65536, 131072, 131072, 131072, 262144, 262144, 131072, 65536, 65536, 65536, 65536,
              131072, 131072]  # fmt: skip
SCENARIOS += [{"name": f"fp16_trace_s{stage}", "kind": "overflow", "bad": [7, 8, 9, 14], "steps": 15,
               "config": h.base_config(**{
                   "sharding.stage": stage, "precision.param_dtype": "fp16",
                   "precision.loss_scaling": {"mode": "dynamic", "initial_scale": 65536.0, "growth_interval": 3,
                                              "hysteresis": 2, "semantics": "deepspeed_zero"}})}
              for stage in (1, 3)]  # fmt: skip
DEEPSPEED_SCHEDULERS = {
    "WarmupLR": {"warmup_max_lr": 0.01, "warmup_num_steps": 3},
    "WarmupDecayLR": {"total_num_steps": 4, "warmup_max_lr": 0.01, "warmup_num_steps": 2},
    "WarmupCosineLR": {"total_num_steps": 4, "warmup_num_steps": 2},
    "OneCycle": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 2},
    "LRRangeTest": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 1},
}
SCENARIOS += [{"name": f"sched_{n}", "micro_steps": 8, "config": h.base_config(**{
    "sharding.stage": 3, "batch.gradient_accumulation_steps": 2, "scheduler": {"name": n, **params}})}
    for n, params in DEEPSPEED_SCHEDULERS.items()]  # fmt: skip
STEPLR = {"name": "StepLR", "kwargs": {"step_size": 1, "gamma": 0.5}}
SCENARIOS += [
    # fp16: the overflow at micro-step 1 skips that step and halves the scale (stage-0 rule: no hysteresis)
    {"name": "fp16_overflow_s0", "kind": "overflow", "bad": 1, "config": h.base_config(**{
        "precision.param_dtype": "fp16", "precision.loss_scaling.mode": "dynamic",
        "precision.loss_scaling.initial_scale": 1024.0, "precision.loss_scaling.semantics": "deepspeed_stage0",
        "scheduler": STEPLR})},
    {"name": "fp16_overflow_s3", "kind": "overflow", "bad": 1, "config": h.base_config(**{
        "sharding.stage": 3, "precision.param_dtype": "fp16", "precision.loss_scaling.mode": "dynamic",
        "precision.loss_scaling.initial_scale": 1024.0, "precision.loss_scaling.semantics": "deepspeed_stage0",
        "scheduler": STEPLR})},
    # bf16: DeepSpeed's check_grad_overflow skips the step on a non-finite gradient norm
    {"name": "bf16_nonfinite_s2", "kind": "overflow", "bad": 2, "config": h.base_config(**{
        "sharding.stage": 2, "precision.param_dtype": "bf16", "precision.skip_step_on_nonfinite": True,
        "scheduler": STEPLR})},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("16bit")
    scenarios = [{**s, "save_16bit": str(out / s["name"])} if s["name"] in SAVE_16BIT else s for s in SCENARIOS]
    ranks = h.run(scenarios)
    errors = {name: rec["traceback"] for r in ranks for name, rec in r.items() if "error" in rec}
    return ranks, errors


def _rec(runs, name, rank=0):
    ranks, errors = runs
    assert name not in errors, errors[name]
    return ranks[rank][name]


def _close(a, b, rel):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert math.isclose(x, y, rel_tol=rel, abs_tol=rel), (a, b)


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS if s.get("kind", "loop") == "loop"])
def test_deepspeed_loop_trains(runs, name):
    for rank in (0, 1):
        rec = _rec(runs, name, rank)
        gas = rec["gas"]
        assert all(math.isfinite(x) for x in rec["losses"])
        assert rec["changed"] > 0, "the weights did not move"
        assert rec["micro_steps"] == len(rec["losses"])
        assert rec["global_steps"] == len(rec["losses"]) // gas
        assert rec["train_batch_size"] == 2 * gas * 2  # micro batch x gas x world size
        assert rec["global_samples"] == rec["global_steps"] * rec["train_batch_size"]
        assert rec["boundaries"] == [(i + 1) % gas == 0 for i in range(len(rec["losses"]))]
        _close(rec["returned"], [x / gas for x in rec["losses"]], 1e-6)  # backward returns loss / gas
        assert rec["train_returns"] is None and rec["eval_returns"] is None and rec["eval_mode"]
        assert rec["world_size"] == 2 and rec["global_rank"] == rank == rec["local_rank"]


@pytest.mark.parametrize("name", ["s1", "s2", "s3", "s3_offload", "hsdp", "s3_ac", "s3_prefetch", "s2_ac_blocks",
                                  "s0_ac_cpu", "s3_client", "s1_client", "s0_predivide", "s0_prescale"])
def test_stages_match_stage0_in_fp32(runs, name):
    for rank in (0, 1):
        _close(_rec(runs, name, rank)["losses"], _rec(runs, "s0", rank)["losses"], 1e-5)
        _close(_rec(runs, name, rank)["norms"], _rec(runs, "s0", rank)["norms"], 1e-5)


@pytest.mark.parametrize("a,b", [("s3_clip", "s0_clip"), ("s3_gas4", "s0_gas4"), ("s2_gas4", "s0_gas4")])
def test_clipping_and_accumulation_match_across_stages(runs, a, b):
    _close(_rec(runs, a)["losses"], _rec(runs, b)["losses"], 1e-5)


def test_forward_prefetch_makes_each_unit_gather_the_next(runs):
    # every Block but the last issues the next Block's all-gather; without the setting no unit prefetches
    assert _rec(runs, "s3_prefetch")["forward_prefetch"] == [["Block"]]
    assert _rec(runs, "s3")["forward_prefetch"] == []


def test_clipping_changes_the_update(runs):
    # norms are ~0.8 > 0.5, so every step is clipped and later losses differ from the unclipped run
    assert _rec(runs, "s0_clip")["losses"][-1] != pytest.approx(_rec(runs, "s0")["losses"][-1], rel=1e-6)
    assert _rec(runs, "s0_clip")["norms"][0] == pytest.approx(_rec(runs, "s0")["norms"][0], rel=1e-6)


def test_bf16_keeps_fp32_master_weights_and_optimizer_state(runs):
    for stage in (0, 1, 2, 3):
        rec = _rec(runs, f"bf16_s{stage}")
        assert rec["bf16"] and not rec["fp16"]
        assert rec["state_dtypes"] == ["torch.float32"], rec["state_dtypes"]
        # DeepSpeed casts the module's parameters at stages 0-2; FSDP2 (stage 3) shards fp32 and casts for compute
        assert rec["param_dtypes"] == (["torch.bfloat16"] if stage < 3 else ["torch.float32"])
        assert rec["buffer_dtypes"] == ["torch.float32"]  # buffers are not cast with the parameters
        _close(rec["losses"], _rec(runs, "s0")["losses"], 2e-2)


def test_fp16_dynamic_loss_scaling_trains(runs):
    for name in ("fp16_s0", "fp16_s3"):
        rec = _rec(runs, name)
        assert rec["fp16"] and rec["state_dtypes"] == ["torch.float32"]
        assert rec["loss_scale"] >= 1.0
        _close(rec["losses"], _rec(runs, "s0")["losses"], 2e-2)


def test_get_global_grad_norm_is_the_unsharded_norm(runs):
    for name in ("norm_s0", "norm_s2", "norm_s3", "norm_s3_off"):
        for rank in (0, 1):
            rec = _rec(runs, name, rank)
            assert rec["engine"] == pytest.approx(rec["reference"], rel=1e-5)


def test_optimizer_passed_before_sharding_is_rebuilt(runs):
    assert _rec(runs, "s3_client")["optimizer"] == "AdamW"
    # ZeRO-1: the script's (or the configured) class itself, over this rank's flat fp32 partition
    assert _rec(runs, "s1_client")["optimizer"] == "AdamW"
    assert _rec(runs, "s1")["optimizer"] == "AdamW"


def test_scheduler_steps_once_per_optimizer_step(runs):
    # linear WarmupLR, W = 2: the lr after update k is DeepSpeed's value for iteration k-1 (0, 0.5, 1, 1 x max)
    assert _rec(runs, "warmup")["lrs"] == pytest.approx([0.0, 0.005, 0.01, 0.01])
    assert _rec(runs, "steplr")["lrs"] == pytest.approx([0.005, 0.0025, 0.00125, 0.000625])


def test_accelerate_calling_order_matches_the_counter_loop(runs):
    for stage in (0, 3):
        rec = _rec(runs, f"accelerate_s{stage}")
        assert rec["global_steps"] == 2
        _close(rec["losses"], _rec(runs, f"s{stage}_gas4")["losses"], 1e-5)


def test_training_data_becomes_a_distributed_dataloader(runs):
    r0, r1 = _rec(runs, "data", 0), _rec(runs, "data", 1)
    assert r0["sampler"] == "DistributedSampler"
    assert r0["len"] == 5  # 21 samples -> 11 per rank -> 5 full micro-batches of 2 (drop_last)
    assert all(len(b) == 2 for b in r0["batches"])
    assert r0["batches"] == r0["again"]  # never set_epoch: the same order every epoch, as DeepSpeed
    seen = {v for b in r0["batches"] + r1["batches"] for v in b}
    assert len(seen) == 20


@pytest.mark.parametrize("name", ["fp16_overflow_s0", "fp16_overflow_s3"])
def test_fp16_overflow_skips_the_step_and_backs_off(runs, name):
    rec = _rec(runs, name)
    assert rec["applied"] == [True, False, True, True]
    assert rec["overflow"] == [False, True, False, False]  # engine.optimizer.overflow, as DeepSpeed's optimizers
    assert rec["unchanged"] == [False, True, False, False]  # the skipped step leaves the weights alone
    assert rec["skipped"] == [0, 1, 1, 1] and rec["global_steps"] == 4  # counted, as DeepSpeed counts it
    assert rec["scales"] == [1024.0, 512.0, 512.0, 512.0]
    assert rec["lrs"] == pytest.approx([0.005, 0.005, 0.0025, 0.00125])  # no scheduler step on the skip


def test_bf16_nonfinite_gradient_skips_the_step(runs):
    rec = _rec(runs, "bf16_nonfinite_s2")
    assert rec["applied"] == [True, True, False, True] and rec["unchanged"][2]
    assert rec["overflow"] == [False, False, True, False]
    assert rec["skipped"][-1] == 1 and rec["scales"] == [1.0] * 4
    assert rec["lrs"] == pytest.approx([0.005, 0.0025, 0.0025, 0.00125])


def test_reduce_op_sum_adds_the_ranks_gradients(runs):
    # world size 2: the summed gradient is twice the mean, so its norm is too (first step, same weights)
    for name in ("s0_sum", "s3_sum"):
        assert _rec(runs, name)["norms"][0] == pytest.approx(2 * _rec(runs, "s0")["norms"][0], rel=1e-5)
        assert _rec(runs, name)["losses"][0] == _rec(runs, "s0")["losses"][0]


def test_no_sync_accumulates_like_the_counter(runs):
    # stage 1 steps as stage 0 does (no_sync is refused at stages 2/3, as DeepSpeed refuses it)
    for name in ("nosync_s0", "nosync_s1"):
        rec = _rec(runs, name)
        assert rec["refused"] is True and rec["global_steps"] == 2
        _close(rec["losses"], _rec(runs, "s0_gas4")["losses"], 1e-5)


def test_compressed_reduction_trains_close_to_dense(runs):
    for name in ("compress_fp16_s0", "compress_powersgd_s1", "compress_bf16_s3"):
        rec = _rec(runs, name)
        assert rec["changed"] > 0
        assert rec["losses"][0] == _rec(runs, "s0")["losses"][0]  # same start; the updates then differ slightly
        _close(rec["losses"], _rec(runs, "s0")["losses"], 5e-2)


@pytest.mark.parametrize("name", list(DEEPSPEED_SCHEDULERS))
def test_every_deepspeed_scheduler_steps_once_per_optimizer_step(runs, name):
    """The engine's lr after each optimizer step is the schedule's value after as many scheduler steps."""
    import torch

    from torsh.config import TorshConfig
    from torsh.engine.schedulers import build_scheduler

    cfg = TorshConfig.from_dict(h.base_config(scheduler={"name": name, **DEEPSPEED_SCHEDULERS[name]}))
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimizer.lr)
    schedule = build_scheduler(cfg.scheduler, opt)
    expected = []
    for _ in range(4):
        schedule.step()
        expected.append(opt.param_groups[0]["lr"])
    rec = _rec(runs, f"sched_{name}")
    assert rec["lrs"] == pytest.approx(expected)
    assert rec["changed"] > 0 and rec["global_steps"] == 4


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_loss_scale_follows_deepspeeds_trace(runs, stage):
    rec = _rec(runs, f"fp16_trace_s{stage}")
    assert rec["scales"] == ZERO_TRACE
    assert [not a for a in rec["applied"]] == [i in (7, 8, 9, 14) for i in range(15)]
    assert rec["skipped"][-1] == 4 and rec["global_steps"] == 15


def test_activation_checkpointing_recomputes_the_blocks(runs):
    plain = _rec(runs, "s3")["block_calls"]
    assert plain == 2 * 4  # two blocks, four micro-steps
    for name in ("s3_ac", "s2_ac_blocks", "s0_ac_cpu"):
        assert _rec(runs, name)["block_calls"] == 2 * plain, name  # forward, and again in backward


@pytest.mark.parametrize("name,dtype", [("s3", "torch.float32"), ("bf16_s3", "torch.bfloat16"),
                                        ("bf16_s0", "torch.bfloat16")])
def test_save_16bit_model_writes_full_weights(runs, name, dtype):
    # ZeRO-3 users got empty weights without stage3_gather_16bit_weights_on_model_save; here they are full
    rec = _rec(runs, name)
    expected = {k: [shape, dtype if k != "gain" else "torch.float32"] for k, (shape, _) in rec["expected_16bit"].items()}
    assert rec["saved_16bit"] == expected


def test_deepspeed_io_builds_a_distributed_loader(runs):
    assert _rec(runs, "s0")["io"] == [3, "DistributedSampler"]  # 10 samples, 5 per rank, micro batch 2
