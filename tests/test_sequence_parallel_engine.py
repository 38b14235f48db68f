"""DeepSpeed-Ulysses sequence parallelism in the engine (``sequence_parallel_size``, ``parallelism.sp``).

On 2 gloo ranks a small attention model whose attention is ``DistributedAttention`` over the sequence-parallel
group, each rank holding half of every sequence, trains with the losses of the same model on one rank with the
whole sequence, and (where DeepSpeed 0.19.8 runs on the CPU) with DeepSpeed's own losses; the groups are
DeepSpeed's, read through the engine and ``deepspeed.utils.groups``. Then the config side: the plan's refusals and
``explain``'s words, the DeepSpeed and Accelerate readers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torsh.config import TorshConfig
from torsh.errors import ConfigError

WORKER = r'''
import json, os, sys
import torch, torch.distributed as dist
from torch import nn

FRAMEWORK, STEPS, SP = os.environ["FRAMEWORK"], 4, 2
B, S, D, HEADS = 2, 8, 8, 4
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
if FRAMEWORK == "deepspeed":
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups
    deepspeed.init_distributed(dist_backend="gloo")
    initialize = deepspeed.initialize
else:
    import torsh
    from torsh.compat.deepspeed.sequence.layer import DistributedAttention
    from torsh.compat.deepspeed.runtime.sequence_parallel import parallel_state_sp
    from torsh.compat.deepspeed.utils import groups
    initialize = torsh.initialize


def local_attention(q, k, v, *args):  # [batch, sequence, heads, head_dim], causal over the whole sequence
    out = nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return out.transpose(1, 2)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.attention = local_attention  # the one-rank model; sequence parallelism puts DistributedAttention here

    def forward(self, x, y, share):
        q, k, v = (t.reshape(*x.shape[:2], HEADS, D // HEADS) for t in self.qkv(x).chunk(3, dim=-1))
        h = x + self.out(self.attention(q, k, v, 0).reshape(x.shape))
        h = h + self.mlp(h)
        # this rank's share of the whole sequence's mean loss (DeepSpeed's Ulysses convention: the sequence-parallel
        # peers' losses add up to the loss of the whole sequence)
        return ((h - y) ** 2).mean() * share


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, S, D, generator=g), torch.randn(B, S, D, generator=g)


def reference():  # the same model on one rank, the whole sequence, clipping as DeepSpeed clips
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = data(step)
        loss = model(x, y, 1.0)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms}


def train(stage, use_mpu, direct=False):
    model = Model()
    config = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "gradient_clipping": 0.5,
              "sequence_parallel_size": SP, "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6,
              "zero_allow_untested_optimizer": True}
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    kwargs = {"mpu": parallel_state_sp} if use_mpu else {}
    engine, *_ = initialize(model=model, optimizer=opt, config=config, **kwargs)
    spg = engine.seq_parallel_group
    model.attention = DistributedAttention(local_attention, spg)
    sp_rank = dist.get_rank(group=spg)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = (t.chunk(SP, dim=1)[sp_rank] for t in data(step))
        loss = engine(x, y, 1.0 / SP)
        if direct:  # the script's own backward (allowed at ZeRO 1-3): the same gradients as engine.backward's
            loss.backward()
        else:
            engine.backward(loss)
        engine.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole, group=spg)
        losses.append(whole.item())
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else None)
    record = {"losses": losses, "norms": norms, "sequence_parallel_size": engine.sequence_parallel_size,
              "seq_parallel_group": dist.get_process_group_ranks(spg),
              "seq_data_parallel_group": dist.get_process_group_ranks(engine.seq_data_parallel_group),
              "seq_dp_world_size": engine.seq_dp_world_size, "train_batch_size": engine.train_batch_size(),
              "groups": [groups._get_sequence_parallel_world_size(), groups._get_sequence_parallel_rank(),
                         dist.get_process_group_ranks(groups._get_sequence_parallel_group()),
                         groups._get_sequence_data_parallel_world_size()]}
    record["dp_world_size"] = engine.dp_world_size  # DeepSpeed's engine: None under its sequence-parallel mpu
    if FRAMEWORK == "deepspeed":
        record["batch_ranks"] = engine._config.world_size  # the ranks DeepSpeed's batch arithmetic splits over
    else:
        record["dp_group"] = dist.get_process_group_ranks(engine.data_parallel_group)
        if stage == 0 and not use_mpu:  # DeepSpeed's model-states file records the ranks gradients were reduced over
            engine.save_checkpoint(os.environ["OUT"], tag="sp")
            dist.barrier()
            states = torch.load(os.path.join(os.environ["OUT"], "sp", "mp_rank_00_model_states.pt"), weights_only=False)
            record["checkpoint_dp_world_size"] = states["dp_world_size"]
    return record


results = {}
if rank == 0:
    results["one_rank"] = reference()
if FRAMEWORK == "deepspeed":  # DeepSpeed runs Ulysses from its sequence-parallel mpu
    parallel_state_sp.initialize_sequence_parallel(SP)
    for stage in (0, 1, 2):
        results[f"stage{stage}"] = train(stage, use_mpu=True)
else:
    for stage in (0, 1, 2, 3):
        results[f"stage{stage}"] = train(stage, use_mpu=False)
    results["stage2_direct"] = train(2, use_mpu=False, direct=True)
    parallel_state_sp.initialize_sequence_parallel(SP)
    results["stage0_mpu"] = train(0, use_mpu=True)
with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as handle:
    json.dump(results, handle)
dist.barrier()
dist.destroy_process_group()
'''


def _run(tmp_path, framework: str) -> list[dict]:
    """The worker under torchrun on 2 ranks (a fresh interpreter: real DeepSpeed is imported there)."""
    from conftest import _free_port

    script = tmp_path / "ulysses_train.py"
    script.write_text(WORKER)
    env = {**os.environ, "OUT": str(tmp_path), "FRAMEWORK": framework, "DS_ACCELERATOR": "cpu",
           "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR")
           or os.path.join(sys.prefix, "torch_extensions")}  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(_free_port()), str(script)], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _relative(a: list[float], b: list[float]) -> float:
    """The largest relative difference where the reference has a value (DeepSpeed's fp32 stage 0 records no norm)."""
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if y is not None]
    assert all(x is not None for x, _ in pairs)
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in pairs), default=0.0)


def _torsh_rank(rank: int, world_size: int, port: int, out: str) -> None:
    """One rank of the worker under torsh, forked by the harness (the engine imported once, in the parent)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), OUT=out, FRAMEWORK="torsh")  # fmt: skip
    exec(compile(WORKER, "ulysses_train", "exec"), {"__name__": "__main__"})


@pytest.fixture(scope="module")
def torsh_run(tmp_path_factory):
    from _engine_harness import free_port, start

    out = tmp_path_factory.mktemp("sp_torsh")
    start(_torsh_rank, (2, free_port(), str(out)), 2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("scenario", ["stage0", "stage1", "stage2", "stage3", "stage0_mpu", "stage2_direct"])
def test_ulysses_trains_with_the_one_rank_losses(torsh_run, scenario):
    """sequence_parallel_size 2 on 2 ranks (from the config, or from a parallel_state_sp mpu): the losses and the
    clipped gradient norms of the same model on one rank with the whole sequence, at every ZeRO stage, and at ZeRO-2
    also when the script calls ``loss.backward()`` itself instead of ``engine.backward``."""
    reference = torsh_run[0]["one_rank"]
    for rank in (0, 1):
        got = torsh_run[rank][scenario]
        assert _relative(got["losses"], reference["losses"]) <= 1e-5, (got["losses"], reference["losses"])
        assert _relative(got["norms"], reference["norms"]) <= 1e-5, (got["norms"], reference["norms"])


def test_ulysses_groups_are_deepspeeds(torsh_run):
    """The engine's and deepspeed.utils.groups' accessors: one sequence-parallel group of both ranks, the
    sequence-data-parallel group of every rank, one data-parallel replica (the batch is 2 x 1 x 1)."""
    for rank in (0, 1):
        got = torsh_run[rank]["stage0"]
        assert got["sequence_parallel_size"] == 2
        assert got["seq_parallel_group"] == [0, 1] and got["seq_data_parallel_group"] == [0, 1]
        assert got["seq_dp_world_size"] == 2 and got["dp_world_size"] == 1 and got["train_batch_size"] == 2
        assert got["dp_group"] == [rank]  # DeepSpeed's data_parallel mesh dimension: dp_world_size ranks
        assert torsh_run[rank]["stage0_mpu"]["dp_group"] == [rank]
        assert got["checkpoint_dp_world_size"] == 2  # DeepSpeed writes seq_dp_world_size there
        assert got["groups"] == [2, rank, [0, 1], 2]


@pytest.mark.slow
def test_ulysses_losses_equal_deepspeeds(tmp_path, torsh_run):
    """Real DeepSpeed 0.19.8 on the CPU (its sequence-parallel mpu, stages 0-2): the same losses and norms."""
    pytest.importorskip("deepspeed")
    theirs = _run(tmp_path, "deepspeed")
    for rank in (0, 1):
        for stage in ("stage0", "stage1", "stage2"):
            ours, ref = torsh_run[rank][stage], theirs[rank][stage]
            assert _relative(ours["losses"], ref["losses"]) <= 1e-5, (stage, ours["losses"], ref["losses"])
            assert _relative(ours["norms"], ref["norms"]) <= 1e-5, (stage, ours["norms"], ref["norms"])
            assert ours["groups"] == ref["groups"] and ours["seq_dp_world_size"] == ref["seq_dp_world_size"]
            assert ours["train_batch_size"] == ref["train_batch_size"]
            assert ours["dp_world_size"] == ref["batch_ranks"] and ref["dp_world_size"] in (None, ours["dp_world_size"])


def _rebuild_rank(rank: int, world_size: int, port: int, out: str) -> None:
    """Sequence groups built three times on one process group: the engine's, a parallel_state_sp mpu's, the engine's."""
    import torch.distributed as dist

    from torsh.compat.deepspeed.runtime.sequence_parallel import parallel_state_sp
    from torsh.engine.parallel import sequence

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        made, new_group = [], dist.new_group

        def counting(*args, **kwargs):
            made.append(args[0] if args else kwargs.get("ranks"))
            return new_group(*args, **kwargs)

        parallel_state_sp.initialize_sequence_parallel(2)
        dist.new_group = counting  # this forked rank's own module
        builds = [sequence.build_sequence_groups(2)]
        after_first = len(made)
        builds.append(sequence.build_sequence_groups(2, mpu=parallel_state_sp))
        builds.append(sequence.build_sequence_groups(2))
        dist.new_group = new_group
        record = {"made": [after_first, len(made)],
                  "reused": [builds[2].data_group is builds[0].data_group and builds[2].group is builds[0].group],
                  "replicas": dist.get_process_group_ranks(builds[0].replicas)}  # fmt: skip
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        parallel_state_sp._release_sequence_parallel_groups()
        sequence.CURRENT = None
        dist.destroy_process_group()


def test_rebuilt_sequence_groups_reuse_the_groups(tmp_path):
    """A later engine reuses the sequence groups of an earlier one: no build after the first makes another group
    (the group of every rank is made once per process group)."""
    from _engine_harness import free_port, start

    start(_rebuild_rank, (2, free_port(), str(tmp_path)), 2, timeout=60)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["made"][0] > 0 and got["made"][1] == got["made"][0], got["made"]
        assert got["reused"] == [True] and got["replicas"] == [rank]


# ---- the config side: plan, explain, the readers ------------------------------------------------------------------


def test_explain_prints_the_sequence_parallel_degree_and_groups(tmp_path, capsys):
    """A DeepSpeed config with sequence_parallel_size 2 on 4 ranks: the batch is split over 2 replicas, and explain
    names the degree, the sequence-parallel groups and the sequence-data-parallel group."""
    from torsh.cli import main

    src = tmp_path / "ds.json"
    src.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3, "sequence_parallel_size": 2,
                               "zero_optimization": {"stage": 2}}))  # fmt: skip
    assert main(["explain", str(src), "--world-size", "4", "--report", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["data_parallel_size"] == 2 and data["refused"] == []
    assert data["batch"].startswith("global batch 6 = micro batch 3 x gradient accumulation 1 x 2")
    step = next(s for s in data["engine"] if s.startswith("sequence parallelism"))
    assert "degree 2" in step and "sequence-parallel groups [0, 1]; [2, 3]" in step
    assert "sequence-data-parallel group [0, 1, 2, 3]" in step and "averaged over the 2 data-parallel" in step


def test_plan_refuses_what_sequence_parallelism_does_not_run_beside():
    from torsh.plan import plan

    def refused(parallelism: dict, world: int) -> list[str]:
        return [f"{p.path}: {p.reason}" for p in plan(TorshConfig.from_dict({"parallelism": parallelism}),
                                                       world).refused]  # fmt: skip

    assert refused({"sp": 2}, 4) == []
    (odd,) = refused({"sp": 2}, 3)
    assert odd.startswith("parallelism.sp: the sequence-parallel degree must divide the 3 data-parallel rank(s)")
    (with_tp,) = refused({"sp": 2, "tp": 2}, 4)
    assert with_tp.startswith("parallelism.sp:") and "parallelism.tp 2" in with_tp
    (with_cp,) = refused({"sp": 2, "cp": 2}, 4)
    assert with_cp.startswith("parallelism.sp:") and "parallelism.cp 2" in with_cp


def test_plan_refuses_a_compression_hook_beside_sequence_parallelism():
    """A DDP compression hook averages over every rank, Ulysses over the data-parallel replicas: together the
    gradients would be sp times too small, so stages 0/1 refuse it; at stages 2/3 an fp16/bf16 compression is
    the reduce dtype of the engine's own reduction, which divides by the replicas."""
    from torsh.plan import plan

    def refused(stage: int, method: str) -> list[str]:
        cfg = TorshConfig.from_dict({"parallelism": {"sp": 2}, "sharding": {"stage": stage},
                                     "compression": {"method": method}})  # fmt: skip
        return [f"{p.path}: {p.reason}" for p in plan(cfg, 4).refused]

    for stage in (0, 1):
        for method in ("fp16", "powersgd"):
            (why,) = refused(stage, method)
            assert why.startswith("compression.method: gradient compression at sharding stage 0/1")
            assert "parallelism.sp 2" in why and "set compression.method to 'none'" in why
        assert refused(stage, "none") == []
    assert refused(2, "bf16") == [] and refused(3, "fp16") == []


def test_deepspeed_reader_maps_sequence_parallel_size():
    from torsh import adapters

    t = adapters.get("deepspeed").read({"train_batch_size": 4, "sequence_parallel_size": 2})
    assert t.result.parallelism.sp == 2
    (note,) = [n for n in t.notes if n.source_path == "sequence_parallel_size"]
    assert note.target_path == "parallelism.sp" and note.fidelity.value == "exact"
    assert adapters.get("deepspeed").write(t.result).result["sequence_parallel_size"] == 2
    assert "sequence_parallel_size" not in adapters.get("deepspeed").write(TorshConfig()).result
    with pytest.raises(ConfigError, match="sequence_parallel_size"):
        adapters.get("deepspeed").read({"train_batch_size": 4, "sequence_parallel_size": 0})


ACCELERATE_SP = """
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 3
mixed_precision: bf16
num_processes: 4
parallelism_config:
  parallelism_config_dp_shard_size: 2
  parallelism_config_sp_size: 2
  parallelism_config_sp_backend: deepspeed
  parallelism_config_sp_seq_length_is_variable: true
"""


def test_accelerate_yaml_sp_size_is_ulysses_under_deepspeed_and_cp_size_is_context_parallelism(tmp_path):
    """Accelerate runs sp_size as DeepSpeed's sequence_parallel_size (its DeepSpeed backend only); cp_size is torch's
    context parallelism, read as parallelism.cp, which the engine runs (``test_context_parallel_engine``)."""
    import yaml

    from torsh import adapters
    from torsh.plan import plan

    raw = yaml.safe_load(ACCELERATE_SP)
    t = adapters.get("accelerate").read(raw)
    assert t.result.parallelism.sp == 2 and plan(t.result, 4).refused == ()
    fidelity = {n.source_path.rsplit("_config_", 1)[-1]: n.fidelity.value for n in t.notes
                if n.source_path.startswith("parallelism_config.")}  # fmt: skip
    # approximate: Accelerate also swaps a Hugging Face model's attention and shards the batches; torsh does not
    assert fidelity["sp_size"] == "approximate" and fidelity["sp_backend"] == "exact"
    assert fidelity["sp_seq_length_is_variable"] == "unsupported"
    written = adapters.get("accelerate").write(t.result).result["parallelism_config"]
    assert written["parallelism_config_sp_size"] == 2

    raw["distributed_type"] = "MULTI_GPU"
    raw.pop("deepspeed_config")
    t = adapters.get("accelerate").read(raw)
    assert t.result.parallelism.sp == 1
    (note,) = [n for n in t.notes if n.source_path.endswith("sp_size")]
    assert note.fidelity.value == "unsupported" and "DeepSpeed backend" in note.reason

    raw["parallelism_config"] = {"parallelism_config_cp_size": 2, "parallelism_config_dp_shard_size": 2}
    raw["distributed_type"], raw["fsdp_config"] = "FSDP", {"fsdp_version": 2}  # Accelerate's cp needs FSDP2
    t = adapters.get("accelerate").read(raw)
    assert t.result.parallelism.cp == 2 and plan(t.result, 4).refused == ()


def test_sequence_groups_refuse_what_they_do_not_run_beside():
    """Before any group is made (so without a process group): MoE experts, a Megatron mpu, and a
    parallel_state_sp mpu of another degree than the config's."""
    from torsh.engine.parallel import sequence

    with pytest.raises(ConfigError, match="parallelism.sp.*MoE"):
        sequence.build_sequence_groups(2, experts=True)
    megatron = type("Mpu", (), {"get_data_parallel_group": lambda self: None})()
    with pytest.raises(ConfigError, match="Megatron-style mpu"):
        sequence.build_sequence_groups(2, mpu=megatron)
    assert sequence.build_sequence_groups(1, mpu=megatron) is None
    ulysses = type("SpMpu", (), {"initialize_sequence_parallel": None,
                                 "get_sequence_parallel_world_size": staticmethod(lambda: 4)})()  # fmt: skip
    assert sequence.degree_with_mpu(1, ulysses) == 4 and sequence.degree_with_mpu(4, ulysses) == 4
    with pytest.raises(ConfigError, match="sequence_parallel_size.*4 ranks"):
        sequence.degree_with_mpu(2, ulysses)


def test_accelerate_accepts_the_sp_size_torsh_writes(tmp_path):
    """The Accelerate file written for parallelism.sp 2 (ZeRO-2) loads with Accelerate's own config loader, and its
    ParallelismConfig takes the size as DeepSpeed-Ulysses sequence parallelism."""
    pytest.importorskip("accelerate")
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.parallelism_config import ParallelismConfig

    from torsh import adapters

    cfg = TorshConfig.from_dict({"parallelism": {"sp": 2}, "sharding": {"stage": 2}, "launch": {"nproc_per_node": 4}})
    written = adapters.get("accelerate").write(cfg).result
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(written))
    loaded = load_config_from_file(str(path))
    assert loaded.distributed_type == "DEEPSPEED"
    size = loaded.parallelism_config["parallelism_config_sp_size"]
    parallelism = ParallelismConfig(sp_size=size)
    assert parallelism.sp_enabled and parallelism.sp_backend == "deepspeed" and parallelism.sp_size == 2


def test_deepspeed_reduces_in_the_sequence_parallel_communication_dtype():
    """Under sequence parallelism DeepSpeed's engine reduces gradients in seq_parallel_communication_data_type
    (fp32 unless set) instead of communication_data_type; without it the key has no effect. Written back so that
    the reduction dtype survives a round trip."""
    from torsh import adapters

    def read(**keys):
        t = adapters.read({"train_batch_size": 4, "bf16": {"enabled": True}, **keys}, "deepspeed")
        return t.result.precision.reduce_dtype, {n.source_path: n.fidelity.name for n in t.notes
                                                 if "communication" in n.source_path}  # fmt: skip

    assert read(sequence_parallel_size=2) == ("fp32", {"seq_parallel_communication_data_type": "DEFAULTED"})
    assert read(sequence_parallel_size=2, seq_parallel_communication_data_type="bf16",
                communication_data_type="fp16") == ("bf16", {"seq_parallel_communication_data_type": "EXACT",
                                                             "communication_data_type": "IGNORED"})  # fmt: skip
    assert read(seq_parallel_communication_data_type="fp16")[0] == "bf16"
    assert read(seq_parallel_communication_data_type="fp16")[1]["seq_parallel_communication_data_type"] == "IGNORED"
    written = adapters.write(adapters.read({"train_batch_size": 4, "bf16": {"enabled": True},
                                            "sequence_parallel_size": 2,
                                            "seq_parallel_communication_data_type": "bf16"}, "deepspeed").result,
                             "deepspeed").result  # fmt: skip
    assert written["seq_parallel_communication_data_type"] == "bf16" and "communication_data_type" not in written
