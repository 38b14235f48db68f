"""Tensor parallelism in the engine, each run compared with the same model trained on one rank.

Two launches, one per layout (``engine_workers/tp_worker.py``), each shared by every check of its layout: tp 2 on
2 gloo ranks, and dp 2 x tp 2 on 4. The reference is the same model from the same weights, trained by a plain
torch loop on one rank on every data-parallel rank's batch at once; fp32 losses must agree within 1e-5 relative
per step, and the final weights, gathered from their DTensor shards, within fp32 rounding.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "engine_workers" / "tp_worker.py"
TIMEOUT_S = 600
OPTIMIZER = {"name": "AdamW", "lr": 1e-2, "weight_decay": 0.0}


def _native(**sections) -> dict:
    return {"batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1}, "optimizer": OPTIMIZER, **sections}


TP2 = [
    {"name": "native_stage0", "tp": 2, "config": _native(parallelism={"tp": 2})},
    # DeepSpeed's AutoTP config as a DeepSpeed script has it: ZeRO-1, clipping at DeepSpeed's default 1.0
    {"name": "deepspeed_autotp", "tp": 2, "clip": 1.0, "config": {
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}}}},
    # deepspeed.tp_model_init records the degree a config without tensor_parallel leaves out
    {"name": "tp_model_init", "tp": 2, "tp_model_init": True, "config": {
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}}}},
    # tied input and output embeddings stay one parameter, replicated over the tp ranks
    {"name": "tied_embeddings", "tp": 2, "tied": True, "config": _native(parallelism={"tp": 2})},
    # a plan of the user's own: only the feed-forward projections are split
    {"name": "own_plan", "tp": 2, "config": _native(parallelism={"tp": 2, "tp_plan": {
        "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}})},
]  # fmt: skip
DP2_TP2 = [
    {"name": "zero3", "tp": 2, "config": _native(parallelism={"tp": 2}, sharding={"stage": 3})},
    {"name": "zero2", "tp": 2, "config": _native(parallelism={"tp": 2}, sharding={"stage": 2})},
]


def _launch(tmp: Path, world: int, scenarios: list[dict]) -> list[dict]:
    spec = tmp / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_", "RANK", "LOCAL_"))}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp), str(world), str(spec)], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("tp2"), 2, TP2)


@pytest.fixture(scope="module")
def dp2_tp2(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("dp2tp2"), 4, DP2_TP2)


def _records(ranks: list[dict], name: str) -> list[dict]:
    for rank in ranks:
        assert "error" not in rank[name], rank[name].get("traceback")
    return [rank[name] for rank in ranks]


def _same_as_one_rank(ranks: list[dict], name: str, tp: int) -> None:
    recs = _records(ranks, name)
    ref = recs[0]
    dp = len(recs) // tp
    # the engine's loss on a rank is its data-parallel rank's mean; the reference's the mean over all of them
    for step, expected in enumerate(ref["reference"]):
        per_dp = [recs[d * tp]["losses"][step] for d in range(dp)]
        for d in range(dp):  # every rank of one tp group computes the same loss
            assert len({recs[d * tp + t]["losses"][step] for t in range(tp)}) == 1, [r["losses"] for r in recs]
        assert math.isclose(sum(per_dp) / dp, expected, rel_tol=1e-5), (step, per_dp, expected)
    assert ref["changed"] > 1e-3  # the weights moved
    assert ref["weight_diff"] <= 1e-5 * max(1.0, ref["weight_scale"]), ref


@pytest.mark.parametrize("name", [s["name"] for s in TP2])
def test_tp2_on_two_ranks_trains_as_one_rank(tp2, name):
    _same_as_one_rank(tp2, name, tp=2)


def test_tp2_splits_the_planned_layers_and_replicates_the_rest(tp2):
    placements = _records(tp2, "native_stage0")[0]["placements"]
    # after FSDP2 every parameter is on the (dp_shard, tp) mesh: two placements each
    assert all(len(p) == 2 for p in placements.values()), placements
    assert placements["layers.0.self_attn.q_proj.weight"][1] == "S(0)"  # colwise: output features
    assert placements["layers.0.mlp.down_proj.weight"][1] == "S(1)"  # rowwise: input features
    assert placements["embed_tokens.weight"][1] == "R" and placements["lm_head.weight"][1] == "R"
    own = _records(tp2, "own_plan")[0]["placements"]
    assert own["layers.0.self_attn.q_proj.weight"][1] == "R"  # not in the user's plan
    assert own["layers.1.mlp.up_proj.weight"][1] == "S(0)"


def test_tp2_keeps_a_tied_embedding_one_parameter(tp2):
    assert all(rec["tied"] for rec in _records(tp2, "tied_embeddings"))
    assert not _records(tp2, "native_stage0")[0]["tied"]


def test_tp_model_init_fills_a_missing_degree_and_a_different_one_is_an_error():
    import torch

    import torsh
    from torsh.config import TorshConfig
    from torsh.engine.initialize import _with_tp_model_init
    from torsh.errors import ConfigError

    model = torsh.tp_model_init(torch.nn.Linear(2, 2), tp_size=4, dtype=torch.bfloat16)
    assert _with_tp_model_init(TorshConfig(), model).parallelism.tp == 4
    with pytest.raises(ConfigError) as exc:
        _with_tp_model_init(TorshConfig.from_dict({"parallelism": {"tp": 2}}), model)
    assert exc.value.problems[0].path == "tensor_parallel.autotp_size"
    assert _with_tp_model_init(TorshConfig(), torch.nn.Linear(2, 2)).parallelism.tp == 1


def test_tp2_batch_is_split_over_the_data_parallel_ranks_only(tp2):
    rec = _records(tp2, "deepspeed_autotp")[0]
    assert rec["dp_world_size"] == 1 and rec["train_batch_size"] == 2  # micro 2 x 1 data-parallel rank


def test_tp2_engine_reports_the_data_and_tensor_parallel_degrees(tp2):
    """DeepSpeed's members a script sizes its batches and groups with: the data-parallel ranks are the world over
    the tensor-parallel degree, and each rank's tensor-parallel index is its place in its tp group."""
    records = _records(tp2, "deepspeed_autotp")
    # [dp_world_size, mp_world_size, get_data_parallel_world_size, get_data_parallel_rank,
    #  get_tensor_parallel_rank, size of data_parallel_group, rank in it]
    assert [r["engine_degrees"] for r in records] == [[1, 2, 1, 0, 0, 1, 0], [1, 2, 1, 0, 1, 1, 0]]


@pytest.mark.parametrize("name", [s["name"] for s in DP2_TP2])
def test_dp2_x_tp2_on_four_ranks_trains_as_one_rank(dp2_tp2, name):
    _same_as_one_rank(dp2_tp2, name, tp=2)


def test_dp2_x_tp2_shards_over_dp_and_splits_over_tp(dp2_tp2):
    records = _records(dp2_tp2, "zero3")
    rec = records[0]
    assert rec["train_batch_size"] == 4  # micro 2 x 2 data-parallel ranks
    # ranks (0, 1) and (2, 3) are tp groups; (0, 2) and (1, 3) data-parallel groups
    assert [r["engine_degrees"] for r in records] == [[2, 2, 2, d, t, 2, d] for d in (0, 1) for t in (0, 1)]
    placements = rec["placements"]
    assert placements["layers.0.self_attn.o_proj.weight"] == ["S(0)", "S(1)"]
    assert placements["norm.weight"] == ["S(0)", "R"]
