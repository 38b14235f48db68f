"""``torsh.plan``: every refusal of the engine decided from the config and the world size, without torch, and
raised by ``initialize`` before the model is cast, wrapped or sharded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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
    ({"sharding": {"stage": 3}, "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": "/nvme"}}, 2,
     "offload"),
    ({"sharding": {"stage": 3, "hybrid_shard_size": 2}}, 3, "sharding.hybrid_shard_size"),
    ({"sharding": {"stage": 2}, "compression": {"method": "topk", "ratio": 0.01}}, 2, "compression.method"),
    ({"sharding": {"stage": 3}, "compression": {"method": "fp16"}, "precision": {"reduce_dtype": "bf16"}}, 2,
     "compression.method"),
    ({"pipeline": {"stages": 2}}, 2, "pipeline.stages"),
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


PROBE = """
import json, sys
import torch, torsh
from torsh.errors import ConfigError
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
before = [(id(p), p.dtype) for p in model.parameters()]
try:
    torsh.initialize(model=model, config=json.loads(sys.argv[1]))
    print(json.dumps({"refused": None}))
except ConfigError as exc:
    after = [(id(p), p.dtype) for p in model.parameters()]
    print(json.dumps({"refused": [p.path for p in exc.problems], "untouched": after == before,
                      "wrapped": any(type(p).__name__ == "DTensor" for p in model.parameters())}))
"""


@pytest.mark.parametrize(("config", "keys"), [
    ({"batch": {"micro_batch_size": 2}, "precision": {"param_dtype": "bf16", "reduce_dtype": "bf16"},
      "sharding": {"stage": 3}, "compression": {"method": "fp16"}}, ["compression.method"]),
    ({"batch": {"micro_batch_size": 2}, "precision": {"param_dtype": "bf16"}, "sharding": {"stage": 3},
      "gradients": {"reduce_op": "adasum"}}, ["gradients.reduce_op"]),
    ({"batch": {"micro_batch_size": 2}, "precision": {"param_dtype": "bf16"}, "sharding": {"stage": 1}},
     ["sharding.stage"]),
])  # fmt: skip
def test_initialize_refuses_before_the_model_is_touched(config, keys):
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("TORCHELASTIC_")}
    env["MASTER_PORT"] = str(29600 + os.getpid() % 1000)
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(config)], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
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
