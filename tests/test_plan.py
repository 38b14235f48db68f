"""``torsh.plan``: every refusal of the engine decided from the config and the world size, without torch, and
raised by ``initialize`` before the model is cast, wrapped or sharded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import _one_process as one_process
from torsh import plan
from torsh.config import TorshConfig
from torsh.errors import ConfigError


def _cfg(**sections) -> TorshConfig:
    return TorshConfig.model_validate(sections)


def test_plan_imports_no_torch():
    code = "import sys, torsh.plan; assert 'torch' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "ok\n"


@pytest.mark.parametrize(("sections", "world", "key"), [
    ({"gradients": {"reduce_op": "adasum"}}, 2, "gradients.reduce_op"),
    ({"parallelism": {"tp": 2}, "sharding": {"stage": 3}, "offload": {"optimizer": "nvme", "nvme_path": "/nvme"}},
     2, "offload"),
    ({"sharding": {"stage": 3, "hybrid_shard_size": 2}}, 3, "sharding.hybrid_shard_size"),
    ({"sharding": {"stage": 2}, "compression": {"method": "topk", "ratio": 0.01}}, 2, "compression.method"),
    ({"sharding": {"stage": 3}, "compression": {"method": "fp16"}, "precision": {"reduce_dtype": "bf16"}}, 2,
     "compression.method"),
    ({"parallelism": {"pp": 2}}, 2, "parallelism.pp"),
    ({"parallelism": {"tp": 3}}, 4, "parallelism"),
    ({"parallelism": {"tp": 2}, "sharding": {"stage": 3, "hybrid_shard_size": 4}}, 4, "sharding.hybrid_shard_size"),
    ({"parallelism": {"tp": 2, "dp_replicate": 3}, "sharding": {"stage": 3}}, 4, "parallelism.dp_replicate"),
    ({"parallelism": {"tp": 2}, "sharding": {"stage": 2}, "offload": {"optimizer": "cpu"}}, 2, "offload"),
])  # fmt: skip
def test_each_refusal_names_its_key(sections, world, key):
    problems = plan.refusals(_cfg(**sections), world_size=world)
    assert [p.path for p in problems] == [key]


def test_every_refusal_is_reported_at_once():
    cfg = _cfg(sharding={"stage": 2}, gradients={"reduce_op": "adasum"}, compression={"method": "powersgd"})
    with pytest.raises(ConfigError) as info:
        plan.check(cfg, world_size=2, optimizer_given=False)
    assert [p.path for p in info.value.problems] == ["gradients.reduce_op", "compression.method", "sharding.stage"]


def test_zero_1_and_2_need_an_optimizer_given_or_configured():
    assert plan.refusals(_cfg(sharding={"stage": 1}), world_size=2, optimizer_given=False)
    assert not plan.refusals(_cfg(sharding={"stage": 1}, optimizer={"name": "Adam"}), world_size=2,
                             optimizer_given=False)  # fmt: skip
    assert not plan.refusals(_cfg(sharding={"stage": 3}), world_size=2, optimizer_given=False)
    assert not plan.refusals(_cfg(sharding={"stage": 2}), world_size=2, optimizer_given=True)


def test_what_the_engine_runs_is_not_refused():
    for sections in ({}, {"sharding": {"stage": 3, "hybrid_shard_size": 2}},
                     {"sharding": {"stage": 3}, "compression": {"method": "bf16"}},
                     {"sharding": {"stage": 0}, "compression": {"method": "powersgd"}}):  # fmt: skip
        assert plan.refusals(_cfg(**sections), world_size=4) == []


# The configs torsh.initialize must refuse (with the keys it names), and the configs it must run with a bf16 reduction:
# all of them go through one Python process (importing torch once), each case on a fresh process group.
REFUSED = [
    ({"batch": {"micro_batch_size": 2}, "precision": {"param_dtype": "bf16", "reduce_dtype": "bf16"},
      "sharding": {"stage": 3}, "compression": {"method": "fp16"}}, ["compression.method"]),
    ({"batch": {"micro_batch_size": 2}, "precision": {"param_dtype": "bf16"}, "sharding": {"stage": 3},
      "gradients": {"reduce_op": "adasum"}}, ["gradients.reduce_op"]),
    ({"batch": {"micro_batch_size": 2}, "precision": {"param_dtype": "bf16"}, "sharding": {"stage": 1}},
     ["sharding.stage"]),
]  # fmt: skip
REDUCED_IN_BF16 = [
    {"batch": {"micro_batch_size": 2}, "sharding": {"stage": 3}, "compression": {"method": "bf16"}},
    # torch.autocast: the parameters stay fp32, and the reduction still runs in the dtype the config asks for
    {"batch": {"micro_batch_size": 2}, "sharding": {"stage": 3},
     "precision": {"param_dtype": "bf16", "autocast": True, "reduce_dtype": "bf16"}},
    {"batch": {"micro_batch_size": 2}, "sharding": {"stage": 3}, "precision": {"param_dtype": "bf16", "autocast": True},
     "compression": {"method": "bf16"}},
]  # fmt: skip

CASES = """
import torch, torsh
from torsh.errors import ConfigError
from _one_process import run_cases


def refuse(config):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    before = [(id(p), p.dtype) for p in model.parameters()]
    try:
        torsh.initialize(model=model, config=config)
        return {"refused": None}
    except ConfigError as exc:
        after = [(id(p), p.dtype) for p in model.parameters()]
        return {"refused": [p.path for p in exc.problems], "untouched": after == before,
                "wrapped": any(type(p).__name__ == "DTensor" for p in model.parameters())}


def runs(config):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine, *_ = torsh.initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    policy = engine.wrapped._get_fsdp_state()._mp_policy
    return {"reduce_dtype": str(policy.reduce_dtype), "param_dtype": str(policy.param_dtype)}


run_cases(lambda kind, config: {"refuse": refuse, "runs": runs}[kind](config))
"""


@pytest.fixture(scope="module")
def initialize_records() -> dict[str, dict]:
    """One process runs torsh.initialize on every case of REFUSED and REDUCED_IN_BF16; ``{case: record}``."""
    pytest.importorskip("torch")
    cases = [("refuse", config) for config, _ in REFUSED] + [("runs", config) for config in REDUCED_IN_BF16]
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("TORCHELASTIC_")}
    records = one_process.records(CASES, cases, env=env, timeout=240)
    return {_case(kind, config): record for (kind, config), record in zip(cases, records)}


def _case(kind: str, config: dict) -> str:
    return kind + json.dumps(config, sort_keys=True)


def _record(records: dict[str, dict], kind: str, config: dict) -> dict:
    record = records[_case(kind, config)]
    assert "error" not in record, record.get("traceback")
    return record


@pytest.mark.slow
@pytest.mark.parametrize(("config", "keys"), REFUSED)
def test_initialize_refuses_before_the_model_is_touched(initialize_records, config, keys):
    record = _record(initialize_records, "refuse", config)
    assert record["refused"] is not None and set(keys) <= set(record["refused"]), record
    assert record["untouched"] and not record["wrapped"]


def test_explain_lists_what_initialize_would_refuse(tmp_path, capsys):
    from torsh.cli import main

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"sharding": {"stage": 3}, "gradients": {"reduce_op": "adasum"}}))
    assert main(["explain", str(path), "--report", "json"]) == 0
    assert [r.split(":")[0] for r in json.loads(capsys.readouterr().out)["refused"]] == ["gradients.reduce_op"]
    assert main(["explain", str(path)]) == 0
    assert "Refused by torsh.initialize" in capsys.readouterr().out


@pytest.mark.parametrize(("sections", "world", "expected"), [
    ({}, 2, {"data_parallel": "ddp", "mesh": None, "reduce_dtype": "fp32"}),
    ({"sharding": {"stage": 1}, "precision": {"param_dtype": "bf16"}, "offload": {"optimizer": "cpu"}}, 2,
     {"data_parallel": "zero1", "masters_on_cpu": True,
      "fsdp_cpu_offload": False, "reduce_dtype": "bf16", "optimizer_on_cpu": True}),
    ({"sharding": {"stage": 2}, "offload": {"optimizer": "cpu"}}, 4,
     {"data_parallel": "zero2", "mesh": None, "reshard_after_forward": None, "fsdp_mixed_precision": False,
      "fsdp_cpu_offload": False, "masters_on_cpu": True}),
    ({"sharding": {"stage": 2, "hybrid_shard_size": 2}}, 4, {"data_parallel": "hsdp", "mesh": (2, 2),
                                                              "reshard_after_forward": False}),
    ({"sharding": {"stage": 3, "hybrid_shard_size": 2}}, 4, {"data_parallel": "hsdp", "mesh": (2, 2),
                                                              "reshard_after_forward": True}),
    ({"sharding": {"stage": 3, "hybrid_shard_size": 4}}, 4, {"data_parallel": "fsdp2", "mesh": (4,)}),
    ({"sharding": {"stage": 3}, "compression": {"method": "bf16"}}, 2,
     {"compression": "reduce_dtype", "reduce_dtype": "bf16", "fsdp_mixed_precision": True}),
    ({"sharding": {"stage": 0}, "compression": {"method": "powersgd"}}, 2, {"compression": "comm_hook"}),
    ({"sharding": {"stage": 3}, "offload": {"optimizer": "cpu"}}, 2,
     {"fsdp_cpu_offload": True, "masters_on_cpu": False, "optimizer_on_cpu": True}),
    ({"precision": {"param_dtype": "fp16", "loss_scaling": {"mode": "dynamic"}}}, 2,
     {"loss_scaler": True, "reduce_dtype": "fp16"}),
    # the engine scales whenever scaling is set, as a torch script with GradScaler and bf16 autocast does
    ({"precision": {"param_dtype": "bf16", "loss_scaling": {"mode": "dynamic"}}}, 2, {"loss_scaler": True}),
    ({"precision": {"param_dtype": "bf16"}}, 2, {"loss_scaler": False}),
    ({"precision": {"param_dtype": "bf16", "autocast": True}}, 2, {"autocast": True, "reduce_dtype": "fp32",
                                                                   "loss_scaler": False}),
])  # fmt: skip
def test_the_plan_decides_each_step(sections, world, expected):
    decided = plan.plan(_cfg(**sections), world)
    assert {k: getattr(decided, k) for k in expected} == expected
    assert decided.refused == ()


def test_the_step_policy_carries_what_the_engine_steps_with():
    cfg = _cfg(gradients={"clip_max_norm": 1.5}, precision={"param_dtype": "fp16", "skip_step_on_nonfinite": True,
                                                            "loss_scaling": {"mode": "static", "static_scale": 128}},
               monitoring={"steps_per_print": 7}, ddp={"static_graph": True})
    step = plan.plan(cfg, 2).step
    assert (step.clip_max_norm, step.loss_scaling, step.skip_step_on_nonfinite, step.steps_per_print) == (
        1.5, True, True, 7)
    assert (step.probe_unused, step.finds_unused) == (False, True)
    assert plan.plan(_cfg(compression={"method": "powersgd"}), 2).step.probe_unused is False
    assert plan.plan(_cfg(), 2).step.probe_unused is True


def test_refusals_are_part_of_the_plan_and_raised_by_check():
    decided = plan.plan(_cfg(sharding={"stage": 3, "hybrid_shard_size": 2}), 3)
    assert [p.path for p in decided.refused] == ["sharding.hybrid_shard_size"] and decided.mesh is None
    with pytest.raises(ConfigError):
        decided.check()


@pytest.mark.parametrize(("sections", "world", "says", "not_says"), [
    # the reduce dtype FSDP2 runs with, a bf16 "compression" folded in (it said nothing of it before the plan)
    ({"sharding": {"stage": 3}, "compression": {"method": "bf16"}}, 2,
     "MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=bf16)", "communication hook"),
    # a shard group as large as the world is one mesh dimension, as the engine builds it
    ({"sharding": {"stage": 3, "hybrid_shard_size": 2}}, 2, "sharded over all data-parallel ranks", "HSDP"),
    # ZeRO-1 offload is CPU master weights, not FSDP2's CPUOffloadPolicy
    ({"sharding": {"stage": 1}, "precision": {"param_dtype": "bf16"}, "offload": {"optimizer": "cpu"}}, 2,
     "offload (optimizer -> cpu): the fp32 master weights, their gradients and the optimizer step on the CPU",
     "CPUOffloadPolicy"),
    # the modules activation checkpointing wraps: sharding.wrap's, not the units grouped from DeepSpeed's buckets
    ({"sharding": {"stage": 3, "wrap": {"module_classes": ["Block"]}}, "activation_checkpointing": {"enabled": True}},
     2, "activation checkpointing of each Block", "each sharding unit"),
    ({"sharding": {"stage": 3}, "offload": {"optimizer": "cpu"}}, 2, "CPUOffloadPolicy(pin_memory=True); it keeps "
     "the sharded parameters and gradients on the CPU too", None),
])  # fmt: skip
def test_explain_prints_the_plan_the_engine_runs(tmp_path, capsys, sections, world, says, not_says):
    from torsh.cli import main

    path = tmp_path / "c.json"
    path.write_text(json.dumps(sections))
    assert main(["explain", str(path), "--world-size", str(world), "--report", "json"]) == 0
    steps = json.loads(capsys.readouterr().out)["engine"]
    assert steps == list(plan.plan(_cfg(**sections), world).steps)
    assert any(says in s for s in steps), steps
    assert not_says is None or not any(not_says in s for s in steps), steps


@pytest.mark.slow
@pytest.mark.parametrize("config", REDUCED_IN_BF16)
def test_the_engine_runs_the_reduce_dtype_explain_prints(initialize_records, config):
    decided = plan.plan(_cfg(**config), 1)
    assert (decided.reduce_dtype, decided.fsdp_mixed_precision) == ("bf16", True)
    assert any("reduce_dtype=bf16" in step for step in decided.steps), decided.steps
    assert _record(initialize_records, "runs", config)["reduce_dtype"] == "torch.bfloat16"
