"""The parallel degrees: one ``parallelism`` section, its plan (mesh, refusals), ``explain``, and every dialect that
reads or writes them. Torch-free and fast."""

from __future__ import annotations

import json

import pytest

from torsh import adapters, plan
from torsh.cli import main
from torsh.config import TorshConfig
from torsh.errors import ConfigError
from torsh.translate import Fidelity

DS = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}


def _cfg(**sections) -> TorshConfig:
    return TorshConfig.from_dict(sections)


def _note(translation, path):
    return next(n for n in translation.notes if n.source_path == path)


# ---- the section -------------------------------------------------------------------------------------------------


def test_replicas_and_shard_group_are_one_setting_and_both_is_an_error_naming_both():
    with pytest.raises(ConfigError) as exc:
        _cfg(sharding={"stage": 3, "hybrid_shard_size": 2}, parallelism={"dp_replicate": 2})
    [problem] = exc.value.problems
    assert problem.path == "parallelism.dp_replicate" and "sharding.hybrid_shard_size" in problem.reason
    with pytest.raises(ConfigError) as exc:
        _cfg(parallelism={"dp_replicate": 2})  # replicas of shard groups need sharding
    assert exc.value.problems[0].path == "parallelism.dp_replicate"


def test_pipeline_stages_moved_to_parallelism_pp_and_reading_it_says_so():
    with pytest.raises(ConfigError) as exc:
        _cfg(pipeline={"stages": 2})
    [problem] = exc.value.problems
    assert problem.path == "pipeline.stages" and "parallelism.pp" in problem.reason
    assert plan.pipeline_degree(_cfg(parallelism={"pp": 4})) == 4
    assert plan.pipeline_degree(_cfg(parallelism={"pp": "auto"})) == 1


# ---- degrees and the mesh ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sections, world, dims, dp", [
    ({}, 4, (("dp_replicate", 4),), 4),  # DDP: every rank a replica
    ({"sharding": {"stage": 3}}, 4, (("dp_shard", 4),), 4),
    ({"parallelism": {"tp": 2}}, 4, (("dp_shard", 2), ("tp", 2)), 2),
    ({"parallelism": {"tp": 2}, "sharding": {"stage": 3, "hybrid_shard_size": 2}}, 8,
     (("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)), 4),
    ({"parallelism": {"tp": 2, "dp_replicate": 2}, "sharding": {"stage": 2}}, 8,
     (("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)), 4),
    ({"parallelism": {"pp": 2, "tp": 2}}, 8, (("pp", 2), ("dp_shard", 2), ("tp", 2)), 2),
])  # fmt: skip
def test_degrees_lay_out_the_mesh_outermost_first(sections, world, dims, dp):
    laid = plan.degrees(_cfg(**sections), world)
    assert laid.dims == dims and laid.dp == dp


def test_ranks_of_one_tp_group_are_neighbours_and_read_one_batch_shard():
    laid = plan.degrees(_cfg(parallelism={"tp": 2}, sharding={"stage": 3, "hybrid_shard_size": 2}), 8)
    assert [laid.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert laid.coordinates(5) == {"dp_replicate": 1, "dp_shard": 0, "tp": 1}


def test_tp_at_stages_0_and_1_runs_fsdp2_on_the_data_parallel_sub_mesh_without_zero1s_wrapper():
    for stage in (0, 1):
        decided = plan.plan(_cfg(parallelism={"tp": 2}, sharding={"stage": stage}), 4)
        assert (decided.data_parallel, decided.mesh, decided.reshard_after_forward) == ("fsdp2", (2,), False)
        assert decided.tp == 2 and not decided.refused
        assert any("DDP's numerics" in s for s in decided.steps)


def test_refusals_name_the_degree_and_the_alternative():
    problems = {p.path: p.reason for p in plan.refusals(_cfg(parallelism={"tp": 3, "cp": 2}), world_size=8)}
    assert "does not divide the world size 8" in problems["parallelism"] and "lower parallelism." in \
        problems["parallelism"]  # fmt: skip
    assert "parallelism.cp" not in problems  # context parallelism runs (beside data and tensor parallelism)
    with_pp = {p.path: p.reason for p in plan.refusals(_cfg(parallelism={"pp": 2, "cp": 2}), world_size=4)}
    assert "not with pipeline parallelism" in with_pp["parallelism.cp"] and "parallelism.pp" in with_pp
    summed = plan.refusals(_cfg(parallelism={"cp": 2}, gradients={"reduce_op": "sum"}), world_size=2)
    assert [p.path for p in summed] == ["gradients.reduce_op"] and "2 x the whole sequence's" in summed[0].reason
    beside_pipeline = plan.refusals(_cfg(parallelism={"cp": 2}), world_size=2, pipeline=True)
    assert [p.path for p in beside_pipeline] == ["parallelism.cp"]  # a PipelineModule passed to initialize
    pp = plan.refusals(_cfg(parallelism={"pp": 2}), world_size=2)
    assert [p.path for p in pp] == ["parallelism.pp"] and "sharding.stage 3" in pp[0].reason


# ---- explain -----------------------------------------------------------------------------------------------------


def _explain(tmp_path, capsys, config: dict, *args: str) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    assert main(["explain", str(path), *args]) == 0
    return capsys.readouterr().out


def test_explain_shows_the_mesh_what_runs_where_and_the_tp_plan(tmp_path, capsys):
    out = " ".join(_explain(tmp_path, capsys, {**DS, "zero_optimization": {"stage": 3},
                                               "tensor_parallel": {"autotp_size": 2}}, "--world-size", "4").split())
    assert "device mesh (dp_shard, tp) = (dp_shard 2 x tp 2) on 4 rank(s)" in out
    assert "rank 1: dp_shard 0, tp 1 (batch shard 0); rank 2: dp_shard 1, tp 0 (batch shard 1)" in out
    assert "ColwiseParallel on q_proj/k_proj/v_proj" in out and "RowwiseParallel on o_proj" in out
    assert "Batch (2 data-parallel rank(s) of 4): global batch 4 = micro batch 2" in out
    assert "Refused" not in out


def test_explain_reports_what_stays_refused_with_the_alternative(tmp_path, capsys):
    out = " ".join(_explain(tmp_path, capsys, {**DS, "pipeline": {"stages": 2}}, "--world-size", "3").split())
    assert "parallelism: pp 2 = 2 does not divide the world size 3" in out
    assert "parallelism.pp: pipeline parallelism runs only for a deepspeed.pipe.PipelineModule" in out
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"parallelism": {"tp": 2}}))
    assert main(["explain", str(path), "--world-size", "4", "--report", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mesh"] == {"dp_shard": 2, "tp": 2} and data["data_parallel_size"] == 2


# ---- dialects ----------------------------------------------------------------------------------------------------


def test_deepspeed_autotp_and_pipeline_stages_are_the_core_degrees_and_every_tp_key_is_accounted():
    section = {"autotp_size": 4, "tp_overlap_comm": True, "tp": {"tp_size": 4}, "vocab_parallel_lm_head": True,
               "partition_config": {"layer_specs": []}, "preset_model": "llama"}  # fmt: skip
    t = adapters.read({**DS, "tensor_parallel": section, "pipeline": {"stages": 2}}, "deepspeed")
    assert (t.result.parallelism.tp, t.result.parallelism.pp) == (4, 2)
    fidelity = {k: _note(t, f"tensor_parallel.{k}").fidelity for k in section}
    assert fidelity == {"autotp_size": Fidelity.APPROXIMATE, "tp_overlap_comm": Fidelity.IGNORED,
                        "tp": Fidelity.EXACT, "vocab_parallel_lm_head": Fidelity.UNSUPPORTED,
                        "partition_config": Fidelity.UNSUPPORTED, "preset_model": Fidelity.APPROXIMATE}
    written = adapters.write(t.result, "deepspeed").result
    assert written["tensor_parallel"] == section and written["pipeline"] == {"stages": 2}
    with pytest.raises(ConfigError) as exc:  # DeepSpeed raises when tp.tp_size is neither 1 nor autotp_size
        adapters.read({**DS, "tensor_parallel": {"autotp_size": 4, "tp": {"tp_size": 2}}}, "deepspeed")
    assert exc.value.problems[0].path == "tensor_parallel.tp.tp_size"


def test_a_tp_degree_converts_between_every_dialect_that_has_one():
    t = adapters.read({**DS, "zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}}, "deepspeed")
    titan = adapters.write(t.result, "torchtitan").result
    assert titan["parallelism"]["tensor_parallel_degree"] == 2
    assert adapters.read(titan, "torchtitan").result.parallelism.tp == 2
    accel = adapters.write(t.result, "accelerate", version="fsdp2").result
    assert accel["parallelism_config"]["parallelism_config_tp_size"] == 2
    assert adapters.read(accel, "accelerate").result.parallelism.tp == 2
    tune = adapters.write(t.result, "torchtune").result
    assert tune["tensor_parallel_dim"] == 2


def test_hsdp_with_tp_writes_the_replicas_of_the_data_parallel_ranks():
    cfg = _cfg(parallelism={"tp": 2}, sharding={"stage": 3, "hybrid_shard_size": 2}, launch={"world_size": 8})
    titan = adapters.write(cfg, "torchtitan").result["parallelism"]
    assert (titan["data_parallel_replicate_degree"], titan["data_parallel_shard_degree"],
            titan["tensor_parallel_degree"]) == (2, 2, 2)  # fmt: skip
    accel = adapters.write(cfg, "accelerate", version="fsdp2").result["parallelism_config"]
    assert (accel["parallelism_config_dp_replicate_size"], accel["parallelism_config_dp_shard_size"]) == (2, 2)


def test_accelerate_megatron_degrees_are_read_and_its_other_settings_reported():
    t = adapters.read({"distributed_type": "MEGATRON_LM", "num_processes": 4, "megatron_lm_config": {
        "megatron_lm_tp_degree": 2, "megatron_lm_pp_degree": 2, "megatron_lm_num_micro_batches": 2}}, "accelerate")
    assert (t.result.parallelism.tp, t.result.parallelism.pp) == (2, 2)
    assert _note(t, "megatron_lm_config.megatron_lm_num_micro_batches").fidelity is Fidelity.UNSUPPORTED
    t = adapters.read({"distributed_type": "FSDP", "num_processes": 4, "fsdp_config": {"fsdp_version": 2},
                       "parallelism_config": {"parallelism_config_cp_size": 2}}, "accelerate")  # fmt: skip
    assert t.result.parallelism.cp == 2
    assert plan.refusals(t.result, world_size=4) == []


def test_a_degree_a_dialect_cannot_hold_is_noted_not_dropped():
    cfg = _cfg(parallelism={"cp": 2, "tp_plan": {"**.q_proj": "colwise"}})
    notes = {n.source_path: n.fidelity for n in adapters.write(cfg, "deepspeed").notes}
    assert notes["parallelism.cp"] is Fidelity.UNSUPPORTED and notes["parallelism.tp_plan"] is Fidelity.UNSUPPORTED
    notes = {n.source_path: n.fidelity for n in adapters.write(_cfg(parallelism={"pp": 2}), "torchtune").notes}
    assert notes["parallelism.pp"] is Fidelity.UNSUPPORTED
