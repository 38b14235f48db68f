"""Context parallelism in the engine (``parallelism.cp``; Accelerate's ``parallelism_config_cp_size``).

Torch's own ``context_parallel`` does not run on a CPU (torch 2.13 raises NotImplementedError for the CPU attention
kernel), and DeepSpeed has no context parallelism, so each run is compared with the same model trained on one rank
on the whole sequences (``engine_workers/tp_worker.py``): every rank of a context-parallel group reads the batch of
its data-parallel index and trains, inside ``engine.context_parallel(buffers=[tokens, targets])``, on its part of
the sequences. Its loss is the mean over its part; the mean over the group's ranks is the whole sequence's (every
part counts as many tokens), and must agree with the one-rank loss within 1e-5 relative at every step, the final
weights within fp32 rounding. Then the context itself, the plan and ``explain``, and the Accelerate reader.
"""

from __future__ import annotations

import math

import pytest

from torsh.config import TorshConfig
from torsh.errors import ConfigError

OPTIMIZER = {"name": "AdamW", "lr": 1e-2, "weight_decay": 0.0}


def _native(gas: int = 1, **sections) -> dict:
    return {"batch": {"micro_batch_size": 2, "gradient_accumulation_steps": gas}, "optimizer": OPTIMIZER, **sections}


def _cp2(tmp) -> list[dict]:
    return [
        {"name": "stage0", "cp": 2, "seq": 8, "dataloader": True, "config": _native(parallelism={"cp": 2})},
        {"name": "stage1_resumed", "cp": 2, "seq": 8, "resume_at": 2, "save_dir": str(tmp / "ck1"), "final_save": True,
         "config": _native(parallelism={"cp": 2}, sharding={"stage": 1})},
        {"name": "stage2_resumed", "cp": 2, "seq": 8, "resume_at": 2, "save_dir": str(tmp / "ck2"),
         "config": _native(parallelism={"cp": 2}, sharding={"stage": 2})},
        # activation checkpointing, and engine.backward after the block: the recomputation attends as the forward
        {"name": "stage3_checkpointed_resumed", "cp": 2, "seq": 8, "resume_at": 2, "save_dir": str(tmp / "ck3"),
         "final_save": True, "backward_outside": True, "config": _native(parallelism={"cp": 2}, sharding={"stage": 3},
                                                     activation_checkpointing={"enabled": True, "modules": ["Layer"]})},
        # the script's own loss.backward() after the block, with activation checkpointing
        {"name": "stage2_checkpointed_direct_after", "cp": 2, "seq": 8, "direct": True, "backward_outside": True,
         "config": _native(parallelism={"cp": 2}, sharding={"stage": 2},
                           activation_checkpointing={"enabled": True, "modules": ["Layer"]})},
        # a Hugging Face Llama (SDPA, grouped key/value heads, rotary positions from the split position ids)
        {"name": "hf_llama_stage3", "cp": 2, "seq": 16, "model": "llama",
         "config": _native(parallelism={"cp": 2}, sharding={"stage": 3})},
        # transformers' reentrant checkpointing, and the script's own loss.backward() after the block
        {"name": "hf_llama_checkpointed_direct_after", "cp": 2, "seq": 16, "model": "llama", "hf_checkpointing": True,
         "direct": True, "backward_outside": True, "config": _native(parallelism={"cp": 2}, sharding={"stage": 1})},
        # attention through `from torch.nn.functional import scaled_dot_product_attention`, reentrant checkpointing,
        # backward inside and after the block
        {"name": "by_name_checkpointed", "cp": 2, "seq": 8, "model": "by_name",
         "config": _native(parallelism={"cp": 2}, sharding={"stage": 1})},
        {"name": "by_name_checkpointed_after", "cp": 2, "seq": 8, "model": "by_name", "backward_outside": True,
         "config": _native(parallelism={"cp": 2}, sharding={"stage": 2})},
        {"name": "by_name_checkpointed_direct_after", "cp": 2, "seq": 8, "model": "by_name", "direct": True,
         "backward_outside": True, "config": _native(parallelism={"cp": 2}, sharding={"stage": 3})},
        # an evaluation forward of whole sequences between the block and engine.backward (reentrant checkpoints)
        {"name": "by_name_eval_between", "cp": 2, "seq": 8, "model": "by_name", "backward_outside": True,
         "eval_between": True, "config": _native(parallelism={"cp": 2}, sharding={"stage": 1})},
        # clipping: a gradient of the wrong scale (summed over the parts instead of averaged) changes the losses
        {"name": "stage2_clipped", "cp": 2, "seq": 8, "clip": 0.05,
         "config": _native(parallelism={"cp": 2}, sharding={"stage": 2}, gradients={"clip_max_norm": 0.05})},
        # the script's own loss.backward() inside the block, with gradient accumulation and a longer sequence
        {"name": "stage3_direct_accumulated", "cp": 2, "seq": 12, "gas": 2, "direct": True, "steps": 6,
         "config": _native(gas=2, parallelism={"cp": 2}, sharding={"stage": 3},
                           activation_checkpointing={"enabled": True, "modules": ["Layer"]})},
    ]  # fmt: skip


def _four(tmp) -> list[dict]:
    return [
        {"name": "dp2_cp2_stage3", "cp": 2, "seq": 8, "dataloader": True, "final_save": True,
         "save_dir": str(tmp / "ck3"),
         "config": _native(parallelism={"cp": 2}, sharding={"stage": 3})},
        {"name": "dp2_cp2_hsdp", "cp": 2, "seq": 8,
         "config": _native(parallelism={"cp": 2, "dp_replicate": 2}, sharding={"stage": 3})},
        {"name": "dp2_cp2_stage1_resumed", "cp": 2, "seq": 8, "resume_at": 2, "save_dir": str(tmp / "ck"),
         "config": _native(parallelism={"cp": 2}, sharding={"stage": 1})},
        {"name": "tp2_cp2_stage2", "tp": 2, "cp": 2, "seq": 8,
         "config": _native(parallelism={"cp": 2, "tp": 2}, sharding={"stage": 2})},
        {"name": "cp4_stage3", "cp": 4, "seq": 16, "config": _native(parallelism={"cp": 4}, sharding={"stage": 3})},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def cp2(tmp_path_factory):
    from test_tensor_parallel_engine import _launch

    tmp = tmp_path_factory.mktemp("cp2")
    return _launch(tmp, 2, _cp2(tmp))


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    from test_tensor_parallel_engine import _launch

    tmp = tmp_path_factory.mktemp("cp4")
    return _launch(tmp, 4, _four(tmp))


def _same_as_one_rank(ranks: list[dict], name: str, peers: int) -> None:
    """``peers`` consecutive ranks (the context- and tensor-parallel ranks of one data-parallel index) share a
    batch: their mean loss is that batch's, and the data-parallel indices' mean the one-rank loss."""
    from test_tensor_parallel_engine import _records

    recs = _records(ranks, name)
    ref, dp = recs[0], len(recs) // peers
    for step, expected in enumerate(ref["reference"]):
        per_dp = [sum(recs[d * peers + i]["losses"][step] for i in range(peers)) / peers for d in range(dp)]
        assert math.isclose(sum(per_dp) / dp, expected, rel_tol=1e-5), (step, per_dp, expected)
    assert ref["changed"] > 1e-3  # the weights moved
    assert ref["weight_diff"] <= 1e-5 * max(1.0, ref["weight_scale"]), ref
    if "saved_diff" in ref:  # the final checkpoint, consolidated as DeepSpeed's zero_to_fp32 does
        assert ref["saved_names"] and ref["saved_diff"] <= 1e-5 * max(1.0, ref["weight_scale"]), ref


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stage0", "stage1_resumed", "stage2_resumed", "stage3_checkpointed_resumed",
                                  "stage2_checkpointed_direct_after", "hf_llama_stage3",
                                  "hf_llama_checkpointed_direct_after", "by_name_checkpointed",
                                  "by_name_checkpointed_after", "by_name_checkpointed_direct_after",
                                  "by_name_eval_between", "stage2_clipped",
                                  "stage3_direct_accumulated"])  # fmt: skip
def test_cp2_on_two_ranks_trains_as_one_rank(cp2, name):
    _same_as_one_rank(cp2, name, peers=2)


@pytest.mark.slow
def test_cp2_ranks_hold_parts_of_one_sequence_and_share_its_batch(cp2):
    from test_tensor_parallel_engine import _records

    records = _records(cp2, "stage0")
    assert [r["cp_shape"] for r in records] == [[2, 4], [2, 4]]  # each rank: half of the 8 tokens
    assert records[0]["losses"] != records[1]["losses"]  # different parts of the same sequences
    # [dp_world_size, mp_world_size, get_data_parallel_world_size, get_data_parallel_rank,
    #  get_tensor_parallel_rank, size of data_parallel_group, rank in it]: one data-parallel rank
    assert [r["engine_degrees"] for r in records] == [[1, 1, 1, 0, 0, 1, 0]] * 2
    assert records[0]["train_batch_size"] == 2
    assert records[0]["first_batch"] == records[1]["first_batch"]  # the engine's dataloader: one batch shard


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp2_cp2_stage3", "dp2_cp2_hsdp", "dp2_cp2_stage1_resumed", "tp2_cp2_stage2",
                                  "cp4_stage3"])  # fmt: skip
def test_four_ranks_with_context_parallelism_train_as_one_rank(four, name):
    _same_as_one_rank(four, name, peers=2 if name.startswith("dp2") else 4)


@pytest.mark.slow
def test_dp2_x_cp2_splits_the_batch_over_the_data_parallel_ranks_only(four):
    from test_tensor_parallel_engine import _records

    records = _records(four, "dp2_cp2_stage3")
    assert records[0]["train_batch_size"] == 4  # micro 2 x 2 data-parallel ranks
    assert [r["engine_degrees"] for r in records] == [[2, 1, 2, d, 0, 2, d] for d in (0, 1) for _ in (0, 1)]
    batches = [r["first_batch"] for r in records]  # the engine's dataloader: ranks (0, 1) and (2, 3) share a shard
    assert batches[0] == batches[1] and batches[2] == batches[3] and batches[0] != batches[2]
    tp = _records(four, "tp2_cp2_stage2")
    assert [r["engine_degrees"][:5] for r in tp] == [[1, 2, 1, 0, t] for _ in (0, 1) for t in (0, 1)]


def _one_rank_given_a_mask(rank: int, world: int, scenario: dict) -> dict:
    import torch

    from torsh.engine.parallel.context import SplitAttention, build_context_groups
    from torsh.plan import degrees

    groups = build_context_groups(degrees(TorshConfig.from_dict({"parallelism": {"cp": 2}}), world))
    q = torch.randn(1, 2, 4, 8)
    if scenario["name"] == "mask":
        SplitAttention(groups).attend(q, q, q, attn_mask=torch.ones(4, 8, dtype=torch.bool) if rank == 0 else None)
    else:  # parts of different lengths: the ranks were given different batches
        q = torch.randn(1, 2, 4 + 2 * rank, 8)
        SplitAttention(groups).attend(q, q, q, is_causal=True)
    return {}


@pytest.mark.slow
def test_a_refusal_on_one_rank_is_raised_on_every_rank_of_the_group(tmp_path):
    """Whether a call can be split may depend on the data (a Hugging Face model builds a mask for one rank's part
    and not for another's): the ranks agree before the gather, so the others raise instead of waiting in it."""
    import json

    import _engine_harness

    _engine_harness.spawn([{"name": "mask"}, {"name": "lengths"}], 2, str(tmp_path), runner=_one_rank_given_a_mask)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    errors = [r["mask"]["error"] for r in records]
    assert errors[0].startswith("ConfigError") and "attn_mask" in errors[0]
    assert errors[1].startswith("ConfigError") and "on rank 0: scaled_dot_product_attention was given an attn_mask" in errors[1]
    for record in records:
        assert "parts of different lengths: every rank of a group must be given the same batch" in record["lengths"]["error"]


def _misuse(rank: int, world: int, scenario: dict) -> dict:
    import sys
    from pathlib import Path

    import torch

    import torsh

    sys.path.insert(0, str(Path(__file__).parent / "engine_workers"))
    from tp_worker import batch, build_model, lm_loss

    config = {"batch": {"micro_batch_size": 2}, "optimizer": OPTIMIZER, "parallelism": {"cp": 2}}
    engine, *_ = torsh.initialize(model=build_model(), config=config)
    x, y = batch(0, rank if scenario["name"] == "different_batches" else 0, 8)
    if scenario["name"] == "nested":
        with engine.context_parallel(buffers=[x, y]), engine.context_parallel(buffers=[x, y]):
            pass
    with engine.context_parallel(buffers=[x, y]):  # restored on leaving: the default
        loss = lm_loss(engine(x), y)
    engine.backward(loss)
    return {}


@pytest.mark.slow
def test_misuses_of_the_block_are_refused_on_every_rank(tmp_path):
    """A backward after a block that restored its buffers (autograd keeps them: they are whole again), ranks of a
    group given different batches (a sampler over the global ranks: each would hold part of another sequence), and
    a block inside another: ConfigErrors naming the key, on both ranks, where they were wrong gradients or a
    crash in torch."""
    import json

    import _engine_harness

    names = ("restored", "different_batches", "nested")
    _engine_harness.spawn([{"name": n} for n in names], 2, str(tmp_path), runner=_misuse)
    for r in range(2):
        record = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "no_restore_buffers: a backward after the context-parallel block" in record["restored"]["error"]
        assert "buffers: the ranks of a context-parallel group were given different batches" in \
            record["different_batches"]["error"]  # fmt: skip
        assert "inside another context-parallel block" in record["nested"]["error"]


# ---- the context, without a process group ------------------------------------------------------------------------


def _groups(size: int = 2):
    from torsh.engine.parallel.context import ContextGroups

    return ContextGroups(size, None, tuple(range(size)), None)


def test_each_rank_holds_a_contiguous_part_of_the_sequence():
    """Contiguous parts, so that a rank's position ids are contiguous: a Hugging Face model takes a jump in them for
    the start of a packed sequence, and masks (torch's load-balanced chunks would make rank 0's [0, 1, 6, 7])."""
    import torch

    from torsh.engine.parallel.context import shard

    whole = torch.arange(8).reshape(1, 8)
    parts = [shard(whole, 1, r, 2) for r in range(2)]
    assert [p.tolist() for p in parts] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert parts[0].untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()  # a copy, not a view


def test_buffers_that_cannot_be_split_are_refused_by_name():
    import torch

    from torsh.engine.parallel.context import ContextParallel

    module = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="not a multiple of cp = 2.*pad"):
        ContextParallel(_groups(), module, [torch.zeros(2, 7)])
    with pytest.raises(ConfigError, match="buffer_seq_dims.*2 buffer"):
        ContextParallel(_groups(), module, [torch.zeros(2, 8), torch.zeros(2, 8)], [1])
    with pytest.raises(ConfigError, match="buffer 0 has 2 dimension"):
        ContextParallel(_groups(), module, [torch.zeros(2, 8)], [2])
    with pytest.raises(ConfigError, match="list of tensors"):
        ContextParallel(_groups(), module, [[1, 2, 3, 4]])
    with pytest.raises(ConfigError, match="buffers: .*list of tensors"):
        ContextParallel(_groups(), module, torch.zeros(2, 8))
    with pytest.raises(ConfigError, match="no_restore_buffers: .*list of tensors"):
        ContextParallel(_groups(), module, [torch.zeros(2, 8)], no_restore_buffers=torch.zeros(2, 8))


def test_attention_the_split_cannot_run_is_refused_by_name():
    """A mask over the whole sequence, and cross-attention to keys of another length: neither can be split (both
    refused before any communication)."""
    import torch

    from torsh.engine.parallel.context import SplitAttention

    q = torch.randn(1, 2, 4, 8)
    split = SplitAttention(_groups())
    with pytest.raises(ConfigError, match="attn_mask") as exc:
        split.attend(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    assert exc.value.problems[0].path == "parallelism.cp"
    with pytest.raises(ConfigError, match="4 queries and 6 keys"):
        split.attend(q, torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))


def test_a_forward_inside_the_context_that_calls_no_sdpa_is_refused(monkeypatch):
    """Attention written out by hand would see only this rank's part of the sequence: silently wrong, so refused."""
    import types

    import torch

    from torsh.engine.parallel import context

    engine = types.SimpleNamespace()
    block = types.SimpleNamespace(module=engine, mode=context.SplitAttention(_groups()), groups=_groups())
    monkeypatch.setattr(context, "_ACTIVE", block)
    with pytest.raises(ConfigError, match="called no torch.nn.functional.scaled_dot_product_attention"):
        with context.forward_context(engine):
            pass
    with context.forward_context(engine):
        block.mode.calls += 1  # what the split attention counts
    assert engine.__dict__["_cp_last_forward"] is block
    monkeypatch.setattr(context, "_ACTIVE", None)
    with torch.no_grad(), context.forward_context(engine):  # an evaluation: the block's forward is still the one
        pass
    assert engine.__dict__["_cp_last_forward"] is block
    with context.forward_context(engine):  # a training forward outside: nothing checked, nothing to redo split
        pass
    assert engine.__dict__["_cp_last_forward"] is None


def test_without_context_parallelism_the_context_does_nothing():
    """A script written for cp runs unchanged at cp 1 (Accelerate's maybe_context_parallel)."""
    import torch

    from torsh.engine.parallel.context import ContextParallelMethods

    engine = type("Engine", (ContextParallelMethods,), {})()
    tokens = torch.arange(8).reshape(1, 8)
    with engine.context_parallel(buffers=[tokens], buffer_seq_dims=[1]):
        assert tokens.shape == (1, 8)
    with engine.maybe_context_parallel(buffers=[tokens]):
        assert tokens.shape == (1, 8)


# ---- the plan, explain and the readers -----------------------------------------------------------------------------


@pytest.mark.parametrize(("parallelism", "stage", "kind", "mesh"), [
    ({"cp": 2}, 3, "fsdp2", (4,)),  # FSDP2 over dp_shard x cp, as Accelerate's dp_shard_cp
    ({"cp": 2, "dp_replicate": 2}, 3, "hsdp", (2, 2)),
    ({"cp": 2}, 1, "zero1", None),  # DDP over every rank
    ({"cp": 2, "tp": 2}, 2, "fsdp2", (2,)),
])  # fmt: skip
def test_the_context_parallel_peers_share_the_data_parallel_layout(parallelism, stage, kind, mesh):
    from torsh.plan import plan

    decided = plan(TorshConfig.from_dict({"parallelism": parallelism, "sharding": {"stage": stage}}), 4)
    assert decided.refused == ()
    assert (decided.data_parallel, decided.mesh) == (kind, mesh)
    assert decided.degrees.dp == 4 // (2 * parallelism.get("tp", 1))  # the batch is split over dp only


def test_explain_names_the_context_parallel_groups(tmp_path, capsys):
    from torsh.cli import main

    path = tmp_path / "accelerate.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n  fsdp_version: 2\nparallelism_config:\n"
                    "  parallelism_config_cp_size: 2\n  parallelism_config_dp_shard_size: 2\n")
    assert main(["explain", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "device mesh (dp_shard, cp) = (dp_shard 2 x cp 2) on 4 rank(s)" in out
    assert "rank 1: dp_shard 0, cp 1 (batch shard 0); rank 2: dp_shard 1, cp 0 (batch shard 1)" in out
    assert "context parallelism of degree 2: context-parallel groups [0, 1]; [2, 3]" in out
    assert "averaged over every data- and context-parallel rank (2 x 2" in out


def test_accelerate_context_parallel_settings_are_read():
    from torsh import adapters
    from torsh.translate import Fidelity

    accelerate = adapters.get("accelerate")
    raw = {"distributed_type": "FSDP", "num_processes": 4, "fsdp_config": {"fsdp_version": 2},
           "parallelism_config": {"parallelism_config_cp_size": 2, "parallelism_config_dp_shard_size": 2,
                                  "parallelism_config_cp_comm_strategy": "alltoall",
                                  "parallelism_config_cp_backend": "torch"}}  # fmt: skip
    t = accelerate.read(raw)
    notes = {n.source_path.rsplit("_config_", 1)[-1]: n for n in t.notes}
    # approximate: contiguous parts, and a mask refused where Accelerate drops it
    assert t.result.parallelism.cp == 2 and notes["cp_size"].fidelity is Fidelity.APPROXIMATE
    assert "attention mask" in notes["cp_size"].reason
    assert notes["cp_comm_strategy"].fidelity is Fidelity.APPROXIMATE
    assert notes["cp_backend"].fidelity is Fidelity.APPROXIMATE
    raw["parallelism_config"]["parallelism_config_cp_comm_strategy"] = "allgather"
    notes = {n.source_path.rsplit("_config_", 1)[-1]: n.fidelity for n in accelerate.read(raw).notes}
    assert notes["cp_comm_strategy"] is Fidelity.EXACT
    # written back as Accelerate checks it: dp_shard_size x cp_size = num_processes
    written = accelerate.write(accelerate.read(raw).result).result["parallelism_config"]
    assert (written["parallelism_config_cp_size"], written["parallelism_config_dp_shard_size"]) == (2, 2)
    raw["parallelism_config"]["parallelism_config_cp_comm_strategy"] = "ring"
    with pytest.raises(ConfigError, match="cp_comm_strategy.*allgather, alltoall"):
        accelerate.read(raw)
    # Accelerate reads the strategy only for cp_size above 1
    quiet = {**raw, "parallelism_config": {"parallelism_config_cp_size": 1,
                                           "parallelism_config_cp_comm_strategy": "ring"}}  # fmt: skip
    (note,) = [n for n in accelerate.read(quiet).notes if n.source_path.endswith("cp_comm_strategy")]
    assert "no effect" in note.reason
    # Accelerate refuses cp_size > 1 without its FSDP2 plugin
    for kind, version in (("MULTI_GPU", 2), ("FSDP", 1)):
        with pytest.raises(ConfigError, match="cp_size: Accelerate runs context parallelism with its FSDP2"):
            accelerate.read({**raw, "distributed_type": kind, "fsdp_config": {"fsdp_version": version},
                             "parallelism_config": {"parallelism_config_cp_size": 2}})


def test_the_accelerate_writer_says_what_accelerate_would_refuse():
    from torsh import adapters
    from torsh.translate import Fidelity

    cfg = TorshConfig.from_dict({"launch": {"world_size": 4}, "sharding": {"stage": 3},
                                 "parallelism": {"cp": 2, "dp_replicate": 2}})  # fmt: skip
    t = adapters.get("accelerate").write(cfg)
    assert any(n.fidelity is Fidelity.UNSUPPORTED and "pure replication" in n.reason for n in t.notes
               if n.source_path == "parallelism.dp_replicate")  # fmt: skip


def test_context_parallelism_beside_moe_or_an_mpu_is_refused_before_any_group_is_made():
    from torsh.engine.parallel.context import build_context_groups
    from torsh.plan import degrees

    laid = degrees(TorshConfig.from_dict({"parallelism": {"cp": 2}}), 2)
    with pytest.raises(ConfigError, match="MoE expert parallelism"):
        build_context_groups(laid, experts=True)
    with pytest.raises(ConfigError, match="an mpu passed to initialize"):
        build_context_groups(laid, mpu=object())
    assert build_context_groups(degrees(TorshConfig(), 2)) is None


def test_a_backward_that_failed_while_the_attention_was_split_is_mended_at_the_next_forward():
    """The split of a direct backward after the block is undone when that backward finishes; if it fails, the next
    forward puts back what was there before (another library's replacement included), and leaves it otherwise."""
    import types

    import torch.nn.functional as F

    from torsh.engine.parallel.context import attention_patched, forward_context

    def theirs(*args, **kwargs):  # another library's replacement
        raise AssertionError

    original = F.scaled_dot_product_attention
    try:
        F.scaled_dot_product_attention = theirs
        patch = attention_patched(_groups())
        patch.__enter__()  # (a backward that never finished)
        assert F.scaled_dot_product_attention is not theirs
        with forward_context(types.SimpleNamespace()):
            pass
        assert F.scaled_dot_product_attention is theirs
        with forward_context(types.SimpleNamespace()):
            pass
        assert F.scaled_dot_product_attention is theirs
    finally:
        F.scaled_dot_product_attention = original


@pytest.mark.parametrize(("size", "rank"), [(2, 0), (2, 1), (3, 1), (3, 2)])
@pytest.mark.parametrize("gqa", [False, True])
def test_a_ranks_causal_attention_is_its_rows_of_the_whole_sequences(monkeypatch, size, rank, gqa):
    """With the gather standing in for the group (it returns the whole sequence's keys and values), a rank's output
    and its queries' gradients are its rows of the one-rank attention, grouped key/value heads included."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from torsh.engine.parallel import context

    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    length = 4
    g = torch.Generator().manual_seed(size * 10 + rank)
    q = torch.randn(2, 4, size * length, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2 if gqa else 4, size * length, 8, generator=g) for _ in range(2))
    mine = slice(rank * length, (rank + 1) * length)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    (whole[..., mine, :] ** 2).sum().backward()
    expected_grad, q.grad = q.grad[..., mine, :].clone(), None
    local_k, local_v = k[..., mine, :], v[..., mine, :]
    gathered = {id(local_k): k, id(local_v): v}
    monkeypatch.setattr(context._GatherSequence, "apply", staticmethod(lambda x, groups: gathered[id(x)]))
    local_q = q[..., mine, :].detach().requires_grad_()
    out = context.SplitAttention(_groups(size)).attend(local_q, local_k, local_v, is_causal=True, enable_gqa=gqa)
    torch.testing.assert_close(out, whole[..., mine, :].detach())
    (out**2).sum().backward()
    torch.testing.assert_close(local_q.grad, expected_grad)


def test_torchtitan_context_parallel_settings_are_read():
    from torsh import adapters
    from torsh.translate import Fidelity

    for method, fidelity in (("allgather", Fidelity.EXACT), ("alltoall", Fidelity.APPROXIMATE)):
        t = adapters.get("torchtitan").read({"parallelism": {
            "context_parallel_degree": 2, "context_parallel_rotate_method": method, "data_parallel_shard_degree": -1}})
        notes = {n.source_path: n.fidelity for n in t.notes}
        assert t.result.parallelism.cp == 2 and notes["parallelism.context_parallel_degree"] is Fidelity.APPROXIMATE
        assert notes["parallelism.context_parallel_rotate_method"] is fidelity
