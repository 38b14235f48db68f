"""A Megatron-style ``mpu`` passed to ``initialize(..., mpu=mpu)`` drives the engine (2 gloo ranks).

A column/row-parallel MLP written here (Megatron's layout: the first linear split on its output features, the
second on its input features with an all-reduce in forward; the split parameters marked ``tensor_model_parallel``,
the rest duplicated) trains over an mpu of model-parallel size 2 with clipping, and must give the losses and
gradient norms of the same MLP unsplit on one rank; real DeepSpeed 0.19.8 runs the same script with the same mpu.
An mpu of data-parallel size 2 behaves as plain data parallelism; DeepSpeed's ``PipelineParallelGrid`` over a
``PipeModelDataParallelTopology`` serves as the mpu; a bad mpu is a ``ConfigError`` naming ``mpu``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import _engine_harness as h  # noqa: E402

from torsh.engine.parallel.mpu import read_mpu  # noqa: E402
from torsh.errors import ConfigError  # noqa: E402

D_IN, HIDDEN, D_OUT, BATCH, STEPS, CLIP, LR = 8, 16, 4, 4, 4, 0.05, 1e-2
REL = 1e-5


# ---- the model-parallel pieces a Megatron script brings ---------------------------------------------


class MegatronMpu:
    """Megatron's parallel_state in miniature: model-parallel groups of ``mp`` neighbouring ranks, data-parallel
    groups of the ranks at the same model-parallel index."""

    def __init__(self, mp: int):
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        self.mp, self.dp, self.rank = mp, world // mp, rank
        for start in range(0, world, mp):  # every rank makes every group, in one order (new_group is collective)
            group = dist.new_group(list(range(start, start + mp)))
            if start <= rank < start + mp:
                self.mp_group = group
        for first in range(mp):
            ranks = list(range(first, world, mp))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.dp_group, self.dp_ranks = group, ranks

    def get_model_parallel_group(self):
        return self.mp_group

    def get_model_parallel_rank(self):
        return self.rank % self.mp

    def get_model_parallel_world_size(self):
        return self.mp

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_rank(self):
        return self.rank // self.mp

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_group_ranks(self):
        return self.dp_ranks


def _parallel_layers():
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F

    class CopyToModelParallel(torch.autograd.Function):
        """Identity forward; the input's gradient summed over the model-parallel group in backward."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    class ReduceFromModelParallel(torch.autograd.Function):
        """The partial sums of the model-parallel ranks added in forward; identity backward."""

        @staticmethod
        def forward(ctx, x, group):
            x = x.clone()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    def mark(p: nn.Parameter, dim: int) -> nn.Parameter:
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1  # Megatron's marks
        return p

    class ColumnParallelLinear(nn.Module):
        def __init__(self, full: nn.Linear, rank: int, size: int, group):
            super().__init__()
            rows = full.out_features // size
            self.group = group
            self.weight = mark(nn.Parameter(full.weight.detach()[rank * rows:(rank + 1) * rows].clone()), 0)
            self.bias = mark(nn.Parameter(full.bias.detach()[rank * rows:(rank + 1) * rows].clone()), 0)

        def forward(self, x):
            return F.linear(CopyToModelParallel.apply(x, self.group), self.weight, self.bias)

    class RowParallelLinear(nn.Module):
        def __init__(self, full: nn.Linear, rank: int, size: int, group):
            super().__init__()
            cols = full.in_features // size
            self.group = group
            self.weight = mark(nn.Parameter(full.weight.detach()[:, rank * cols:(rank + 1) * cols].clone()), 1)
            self.bias = nn.Parameter(full.bias.detach().clone())  # duplicated: added once, after the reduction

        def forward(self, x):
            return ReduceFromModelParallel.apply(F.linear(x, self.weight), self.group) + self.bias

    return ColumnParallelLinear, RowParallelLinear


def full_mlp(seed: int = 0):
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D_IN), nn.LayerNorm(D_IN),
                         nn.Linear(D_IN, D_OUT))  # fmt: skip


def split_mlp(full, rank: int, size: int, group):
    """``full`` with its first linear column-parallel and its second row-parallel over ``group``; the layer norm
    and the head duplicated on every model-parallel rank."""
    import copy

    from torch import nn

    column, row = _parallel_layers()
    return nn.Sequential(column(full[0], rank, size, group), nn.GELU(), row(full[2], rank, size, group),
                         copy.deepcopy(full[3]), copy.deepcopy(full[4]))  # fmt: skip


def data(step: int, dp_rank: int):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)


def config(stage: int, bf16: bool = False, wide: bool = False) -> dict:
    """DeepSpeed's JSON; ``wide``: bf16 weights with fp32 gradient accumulation and the optimizer offloaded."""
    zero: dict = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if wide else {})}
    return {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 10**9, "gradient_clipping": CLIP,
            "zero_optimization": zero, "bf16": {"enabled": bf16 or wide},
            **({"data_types": {"grad_accum_dtype": "fp32"}} if wide else {}),
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}}


def reference(dp_ranks: int) -> dict:
    """The unsplit MLP on one rank: the batches of ``dp_ranks`` data-parallel ranks averaged, AdamW, and
    DeepSpeed's clipping (max_norm / (norm + 1e-6), never above 1)."""
    model = full_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for r in range(dp_ranks):
            x, y = data(step, r)
            loss = torch.nn.functional.mse_loss(model(x), y) / dp_ranks
            loss.backward()
            total += loss.item()
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        for p in model.parameters():
            p.grad.mul_(min(1.0, CLIP / (norm + 1e-6)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
        norms.append(norm)
    return {"losses": losses, "norms": norms}


def make_mpu(kind: str, mp: int):
    if kind == "megatron":
        return MegatronMpu(mp)
    import torch.distributed as dist

    from torsh.compat.deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=1, num_mp=mp, num_dp=dist.get_world_size() // mp)
    return PipelineParallelGrid(topology=topo)


def train(rank: int, world_size: int, scenario: dict) -> dict:
    """The DeepSpeed training loop with ``mpu=`` on torsh or real DeepSpeed."""
    deepspeed = h.backend(scenario.get("backend", "torsh"))
    if scenario.get("mpu") == "grid":  # the drop-in's deepspeed.initialize, as a script under `torsh run` calls it
        import torsh.compat.deepspeed as deepspeed
    mp_size = scenario.get("mp", 2)
    mpu = make_mpu(scenario["mpu"], mp_size) if scenario.get("mpu") else None
    model = full_mlp()
    if mpu is not None and mp_size > 1:
        model = split_mlp(model, mpu.get_model_parallel_rank(), mp_size, mpu.get_model_parallel_group())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), mpu=mpu,
                                      config=config(scenario.get("stage", 0), scenario.get("bf16", False),
                                                    scenario.get("wide", False)))  # fmt: skip
    dp_rank = mpu.get_data_parallel_rank() if mpu is not None else rank
    rec: dict = {"losses": [], "norms": [], "dp_world_size": engine.dp_world_size,
                 "mp_world_size": engine.mp_world_size, "dp_rank": dp_rank,
                 "dp_group_is_mpus": mpu is not None and engine.data_parallel_group is mpu.get_data_parallel_group()}
    if scenario.get("mpu") == "grid":  # DeepSpeed's engine records the unit in deepspeed.utils.groups
        groups = deepspeed.utils.groups
        rec["groups"] = [groups.mpu is mpu, groups._get_model_parallel_world_size(),
                         groups._get_data_parallel_world_size(), groups._get_data_parallel_rank(),
                         groups.get_model_parallel_rank() == mpu.get_model_parallel_rank(),
                         groups._get_data_parallel_group() is mpu.get_data_parallel_group()]  # fmt: skip
        rec["tp_src"] = groups.get_tensor_model_parallel_src_rank()
    for step in range(STEPS):
        x, y = data(step, dp_rank)
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.module[0].weight.dtype)).float(), y)
        with engine.coalesce_grad_reduction() if scenario.get("coalesce") else contextlib.nullcontext():
            engine.backward(loss)  # in the block: reduced once when it ends, over the data-parallel group
        engine.step()
        rec["losses"].append(loss.item())
        norm = engine.get_global_grad_norm()
        rec["norms"].append(None if norm is None else float(norm))
    if scenario.get("save"):
        engine.save_checkpoint(scenario["save"], tag="t")
        rec["files"] = sorted(os.listdir(Path(scenario["save"], "t")))
    engine.destroy() if hasattr(engine, "destroy") else None
    return rec


def resume(rank: int, world_size: int, scenario: dict) -> dict:  # noqa: ARG001
    """Train 2 steps, save, train 2 more; then a fresh engine (other initial weights) loads the checkpoint and
    trains the same 2 steps: the same losses. DeepSpeed's model-states file of each model-parallel rank holds
    that rank's slices."""
    import torsh

    mpu = make_mpu(scenario["mpu"], 2)
    records = {}
    for run, seed in (("first", 0), ("resumed", 7)):
        model = split_mlp(full_mlp(seed), mpu.get_model_parallel_rank(), 2, mpu.get_model_parallel_group())
        engine, *_ = torsh.initialize(model=model, model_parameters=model.parameters(), mpu=mpu,
                                      config=config(scenario["stage"]))  # fmt: skip
        losses = []
        if run == "resumed":
            engine.load_checkpoint(scenario["save"], tag="t")
        for step in range(STEPS):
            if run == "resumed" and step < STEPS // 2:
                continue
            x, y = data(step, mpu.get_data_parallel_rank())
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if run == "first" and step == STEPS // 2 - 1:
                saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
                engine.save_checkpoint(scenario["save"], tag="t")
        records[run] = losses
        engine.destroy()
    path = Path(scenario["save"], "t")
    mine = torch.load(path / f"mp_rank_{mpu.get_model_parallel_rank():02d}_model_states.pt", weights_only=True)
    records["file_holds_this_ranks_slices"] = all(torch.equal(mine["module"][k], v) for k, v in saved.items())
    records["mp_world_size"] = mine["mp_world_size"]
    records["files"] = sorted(os.listdir(path))
    return records


def refused(rank: int, world_size: int, scenario: dict) -> dict:
    """``initialize`` with a bad mpu (or a refused combination): the error's text."""
    import torsh

    mpu = make_mpu("megatron", scenario.get("mp", 2))
    if scenario["case"] == "sizes":
        mpu.get_data_parallel_world_size = lambda: 2  # 2 x 2 on a 2-rank job
    elif scenario["case"] == "group":
        mpu.get_data_parallel_group = lambda: None  # the world, where the mpu says 1 rank
    elif scenario["case"] == "rank1" and rank == 1:  # wrong on one rank only: rank 0's own mpu is right
        mpu.get_data_parallel_world_size = lambda: 2
    model, cfg = full_mlp(), config(scenario.get("stage", 0))
    if scenario["case"] == "tp":
        cfg["tensor_parallel"] = {"autotp_size": 2}
    elif scenario["case"] == "moe":
        from torsh.compat.deepspeed.moe.layer import MoE

        model.append(MoE(D_OUT, torch.nn.Linear(D_OUT, D_OUT), num_experts=2))
    # the MoE layers' expert groups after initialize (None: the refusal came before prepare_experts made them)
    layers = [m for m in model.modules() if hasattr(m, "deepspeed_moe")]

    def expert_groups() -> list:
        return [m.deepspeed_moe.ep_group is not None for m in layers]

    try:
        torsh.initialize(model=model, model_parameters=model.parameters(), mpu=mpu, config=cfg)
    except ConfigError as err:
        return {"error_text": str(err), "expert_groups": expert_groups()}
    return {"error_text": None, "expert_groups": expert_groups()}


def run_case(rank: int, world_size: int, scenario: dict) -> dict:
    run = refused if scenario.get("refused") else resume if scenario.get("resume") else train
    return run(rank, world_size, scenario)


def _run(scenarios: list[dict], world_size: int = 2) -> list[dict]:
    import json

    with tempfile.TemporaryDirectory() as out:
        h.spawn(scenarios, world_size, out, runner=run_case)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world_size)]


def _close(got: list[float], want: list[float], label: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= REL * max(abs(b), 1e-12), f"{label}[{i}]: {a} vs {b} (all: {got} vs {want})"


# ---- tests ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    save = tmp_path_factory.mktemp("mpu_ckpt")
    scenarios = [{"name": f"mp2_s{s}", "mpu": "megatron", "stage": s} for s in (0, 1, 2)]
    scenarios += [{"name": "grid_s0", "mpu": "grid", "stage": 0},
                  {"name": "grid_s2", "mpu": "grid", "stage": 2},
                  {"name": "resume_s0", "resume": True, "mpu": "megatron", "stage": 0, "save": str(save / "s0")},
                  {"name": "resume_s2", "resume": True, "mpu": "grid", "stage": 2, "save": str(save / "s2")},
                  {"name": "dp2_s0", "mpu": "megatron", "mp": 1, "stage": 0},
                  {"name": "dp2_s2", "mpu": "megatron", "mp": 1, "stage": 2},
                  {"name": "plain_s0", "stage": 0},
                  {"name": "plain_s2", "stage": 2}]  # fmt: skip
    scenarios += [{"name": f"wide_{c}", "mpu": "megatron", "stage": 1, "wide": True, "coalesce": c}
                  for c in (False, True)]  # fmt: skip
    scenarios += [{"name": f"bad_{c}", "refused": True, "case": c} for c in ("sizes", "group")]
    scenarios += [{"name": f"bad_{c}", "refused": True, "case": c, "stage": 3 if c == "stage3" else 0}
                  for c in ("stage3", "tp", "moe")]  # fmt: skip
    return _run(scenarios)


@pytest.mark.parametrize("name", ["mp2_s0", "mp2_s1", "mp2_s2", "grid_s0", "grid_s2"])
def test_model_parallel_mlp_trains_with_the_losses_and_norms_of_the_unsplit_mlp(records, name):
    """Model-parallel size 2, data-parallel size 1: both ranks see one batch, each holds half of each split
    linear; the losses and the clipping norm (split parameters summed over the model group, duplicated ones
    counted once) equal the unsplit MLP's on one rank, and clipping bites (norms above the max norm)."""
    want = reference(1)
    assert min(want["norms"]) > CLIP
    for rec in h.ranks_of(records, name):
        assert (rec["dp_world_size"], rec["mp_world_size"], rec["dp_rank"]) == (1, 2, 0)
        _close(rec["losses"], want["losses"], f"{name} losses")
        _close(rec["norms"], want["norms"], f"{name} norms")


@pytest.mark.parametrize("stage", [0, 2])
def test_data_parallel_mpu_is_plain_data_parallelism(records, stage):
    """Model-parallel size 1, data-parallel size 2: the losses and norms of the same job without an mpu, and
    those of the one-rank run over both ranks' batches."""
    mine, plain = h.ranks_of(records, f"dp2_s{stage}"), h.ranks_of(records, f"plain_s{stage}")
    want = reference(2)
    for r, (a, b) in enumerate(zip(mine, plain)):
        assert (a["dp_world_size"], a["mp_world_size"], a["dp_rank"]) == (2, 1, r)
        assert a["dp_group_is_mpus"]  # the engine's data_parallel_group is the mpu's group object, not the world
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        _close(a["norms"], want["norms"], "dp2 norms")
    _close([(a + b) / 2 for a, b in zip(mine[0]["losses"], mine[1]["losses"])], want["losses"], "dp2 losses")


@pytest.mark.parametrize("stage", [0, 2])
def test_checkpoint_per_model_parallel_rank_resumes_with_the_same_losses(records, stage):
    """Each model-parallel rank's slices are saved apart (DeepSpeed's ``mp_rank_XX_model_states.pt`` per
    model-parallel rank, written by its first data-parallel rank, and keys of their own in the DCP files), so a
    fresh engine that loads the checkpoint continues with the losses of the run that saved it."""
    for rec in h.ranks_of(records, f"resume_s{stage}"):
        assert rec["resumed"] == rec["first"][STEPS // 2:]
        assert rec["file_holds_this_ranks_slices"] and rec["mp_world_size"] == 2
        assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= set(rec["files"]), rec["files"]


def test_coalesced_reduction_averages_over_the_data_parallel_group_only(records):
    """ZeRO-1 with fp32 gradient accumulation reduces a ``coalesce_grad_reduction`` block's gradients itself:
    over the mpu's data-parallel group (here each rank alone), so the losses are those of the same steps without
    the block (averaging the two model-parallel ranks' different slices would change them)."""
    for coalesced, plain in zip(h.ranks_of(records, "wide_True"), h.ranks_of(records, "wide_False")):
        assert coalesced["losses"] == plain["losses"]


def test_bad_mpus_are_errors_naming_mpu(records):
    sizes, group, stage3 = (h.ranks_of(records, f"bad_{c}")[0]["error_text"] for c in ("sizes", "group", "stage3"))
    assert "mpu" in sizes and "2 x model-parallel size 2 = 4, but the job has 2 ranks" in sizes
    assert "get_data_parallel_group() has 2 ranks" in group and "get_data_parallel_world_size() is 1" in group
    assert "mpu" in stage3 and "ZeRO stage 3" in stage3
    tp, moe = (h.ranks_of(records, f"bad_{c}")[0]["error_text"] for c in ("tp", "moe"))
    assert "mpu" in tp and "the config's own tensor / pipeline / context / sequence parallel degrees" in tp
    assert "mpu" in moe and "MoE layers" in moe


def test_mpu_beside_moe_is_refused_before_the_expert_groups_are_made(records):
    """The refusal of MoE layers beside an mpu comes before the engine gives the layers their expert groups (a
    collective that changes the model): a refused initialize leaves the model as it was."""
    for record in h.ranks_of(records, "bad_moe"):
        assert record["error_text"] and record["expert_groups"] == [False]


def test_an_mpu_without_its_methods_is_an_error_naming_them():
    class Partial:
        def get_data_parallel_group(self):
            return None

    with pytest.raises(ConfigError, match=r"mpu.*has no get_data_parallel_rank, get_data_parallel_world_size"):
        read_mpu(Partial(), 2)

    class Uninitialised(MegatronMpu):
        def __init__(self):  # the groups were never made
            self.mp, self.dp, self.rank = 2, 1, 0

    with pytest.raises(ConfigError, match=r"mpu.get_data_parallel_group\(\) raised AttributeError"):
        read_mpu(Uninitialised(), 2)

    class Negative(Uninitialised):
        dp_group = mp_group = None

        def get_model_parallel_rank(self):
            return -1

    with pytest.raises(ConfigError, match=r"get_model_parallel_rank\(\) returned -1, not an integer >= 0"):
        read_mpu(Negative(), 2)

    class BrokenPipe(Uninitialised):
        dp_group = mp_group = None

        def get_pipe_parallel_world_size(self):
            raise RuntimeError("pipeline groups were never made")

    with pytest.raises(ConfigError, match=r"mpu.*get_pipe_parallel_world_size\(\) raised RuntimeError: pipeline"):
        read_mpu(BrokenPipe(), 2)


def test_an_mpu_wrong_on_one_rank_stops_every_rank_with_the_same_error(tmp_path):
    """Only rank 1's mpu has the wrong sizes: both ranks raise the same ConfigError naming mpu and rank 1, instead
    of rank 0 going on into the engine's collectives and waiting there for rank 1 (a hang the timeout kills)."""
    import json

    scenario = {"name": "rank1", "refused": True, "case": "rank1"}
    h.start(h._worker, (2, h.free_port(), [scenario], str(tmp_path), run_case), 2, timeout=90)
    texts = [json.loads(Path(tmp_path, f"rank{r}.json").read_text())["rank1"]["error_text"] for r in range(2)]
    assert texts[0] == texts[1] and texts[0] is not None, texts
    assert "mpu" in texts[0] and "rank 1: data-parallel size 2 x model-parallel size 2 = 4" in texts[0], texts[0]
    assert "rank 0" not in texts[0], texts[0]


def test_tensor_model_parallel_src_rank_is_the_first_rank_of_the_model_parallel_group(monkeypatch):
    """deepspeed.utils.groups.get_tensor_model_parallel_src_rank under an mpu of data-parallel size 2 x
    model-parallel size 2: rank 3's model-parallel group is (2, 3), so 2 (its data-parallel rank is 1); without a
    model axis, the rank itself."""
    from torsh.compat.deepspeed.utils import groups

    model_group = object()

    class FakeDist:
        @staticmethod
        def is_available():
            return True

        @staticmethod
        def is_initialized():
            return True

        @staticmethod
        def get_rank(group=None):
            return 3

        @staticmethod
        def get_global_rank(group, rank):
            assert group is model_group
            return {0: 2, 1: 3}[rank]

    class Mpu:
        def get_model_parallel_group(self):
            return model_group

        def get_model_parallel_world_size(self):
            return 2

        def get_data_parallel_rank(self):
            return 1

    monkeypatch.setattr(groups, "_dist", lambda: FakeDist)
    monkeypatch.setattr(groups, "mpu", Mpu())
    assert groups.get_tensor_model_parallel_src_rank() == 2
    monkeypatch.setattr(groups, "mpu", None)
    assert groups.get_tensor_model_parallel_src_rank() == 3


@pytest.mark.slow
def test_data_parallel_mpu_at_zero3_is_plain_zero3():
    """ZeRO-3 runs beside an mpu without a model axis (its data-parallel group is the world): the losses and norms
    of the same job without the mpu (with a model axis it is refused, see above)."""
    records = _run([{"name": "dp2_s3", "mpu": "megatron", "mp": 1, "stage": 3}, {"name": "plain_s3", "stage": 3}])
    for a, b in zip(h.ranks_of(records, "dp2_s3"), h.ranks_of(records, "plain_s3")):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"] and a["dp_world_size"] == 2
        assert a["dp_group_is_mpus"]


@pytest.mark.slow
def test_four_ranks_with_both_axes(tmp_path):
    """Data-parallel size 2 x model-parallel size 2 (4 gloo ranks): the gradients are averaged over the
    data-parallel pairs (0, 2) and (1, 3) only, the norm summed over the model pairs; the losses and norms are the
    unsplit MLP's on one rank over both batches, and a checkpoint resumes with the same losses."""
    scenarios = [{"name": "s0", "mpu": "megatron", "stage": 0}, {"name": "s2", "mpu": "grid", "stage": 2},
                 {"name": "resume", "resume": True, "mpu": "megatron", "stage": 1, "save": str(tmp_path)}]
    records = _run(scenarios, world_size=4)
    want = reference(2)
    for name in ("s0", "s2"):
        ranks = h.ranks_of(records, name)
        assert [(r["dp_world_size"], r["mp_world_size"], r["dp_rank"]) for r in ranks] == [(2, 2, 0), (2, 2, 0),
                                                                                            (2, 2, 1), (2, 2, 1)]
        _close([(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[2]["losses"])], want["losses"], name)
        for r in ranks:
            _close(r["norms"], want["norms"], f"{name} norms")
            assert r["dp_group_is_mpus"]
    # DeepSpeed's get_tensor_model_parallel_src_rank: the first global rank of each model-parallel pair
    assert [r["tp_src"] for r in h.ranks_of(records, "s2")] == [0, 0, 2, 2]
    for rec in h.ranks_of(records, "resume"):
        assert rec["resumed"] == rec["first"][STEPS // 2:] and rec["file_holds_this_ranks_slices"]


@pytest.mark.slow
def test_real_deepspeed_gives_the_same_losses_with_the_same_mpu():
    """The same script and mpu under real DeepSpeed 0.19.8 (CPU): the losses torsh gives at stages 0-2 in fp32 and
    at stages 1-2 in bf16, and DeepSpeed's clipping norm where it reports one (ZeRO-1/2). DeepSpeed's stage-0 bf16
    optimizer is left out: it tests the model-parallel marks on the gradients, which carry none, so it counts
    model-parallel rank 0's gradients only; torsh keeps the rule."""
    pytest.importorskip("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cases = [(stage, False) for stage in (0, 1, 2)] + [(1, True), (2, True)]
    scenarios = [{"name": f"s{stage}{'_bf16' if bf16 else ''}_{backend}", "mpu": "megatron", "stage": stage,
                  "bf16": bf16, "backend": backend}
                 for stage, bf16 in cases for backend in ("torsh", "deepspeed")]  # fmt: skip
    records = _run(scenarios)
    for stage, bf16 in cases:
        name = f"s{stage}{'_bf16' if bf16 else ''}"
        ours, theirs = h.both(records, name)
        for a, b in zip(ours, theirs):
            _close(a["losses"], b["losses"], f"{name} losses vs DeepSpeed")
            if stage > 0:
                _close(a["norms"], b["norms"], f"{name} norms vs DeepSpeed")


def test_deepspeed_utils_groups_answer_from_the_mpu_initialize_was_given(records):
    """As DeepSpeed's engine records it (``groups.mpu``): the model-parallel size 2, the data-parallel size 1."""
    for r in h.ranks_of(records, "grid_s0"):
        assert r["groups"] == [True, 2, 1, 0, True, True]


def test_norm_function_under_a_partition_is_built_once():
    """ZeRO-1/2 beside a model axis: the norm function (its scan of the duplicated parameters) is built at the first
    step and the same one returned at every later step; a new partition gets its own."""
    from torsh.engine.parallel.mpu import MpuGroups

    class Partition:
        def global_norm(self, grads, *, skip=(), over=()):  # noqa: ARG002
            return 0.0

    groups = MpuGroups(mpu=None, dp_group=None, data_rank=0, dp=1, mp_group=None, mp_rank=1, tp=2)
    first, other = Partition(), Partition()
    norm = groups.norm_function([], first)
    assert norm.func == first.global_norm and groups.norm_function([], first) is norm
    assert groups.norm_function([], other).func == other.global_norm
