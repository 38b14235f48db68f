"""The drop-in's mixture of experts (``deepspeed.moe``) against DeepSpeed 0.19.8's, and the engine-side expert
parallelism (``torsh.engine.parallel.moe``) on 2 gloo ranks."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torsh.compat.deepspeed.moe import sharded_moe as T  # noqa: E402
from torsh.compat.deepspeed.moe.layer import MoE  # noqa: E402
from torsh.compat.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402
from torsh.engine.parallel import moe as engine_moe  # noqa: E402


@pytest.fixture(scope="module")
def ds():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return pytest.importorskip("deepspeed")


def _same(a, b, label):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), label
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{label}[{i}]")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), (label, a, b)
    else:
        assert a == b, (label, a, b)


def test_gating_equals_deepspeeds_bit_for_bit_with_its_random_streams(ds):
    """Same logits and seed: the same routes, capacities, gate values, aux loss and counts, for top-1 (random
    token selection, Gumbel noise, no dropping), top-2 (sampled second expert) and top-k (both drop policies),
    dense and sparse; the random numbers are drawn as DeepSpeed draws them."""
    from deepspeed.moe import sharded_moe as D

    logits = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    for cf, min_cap, drop, rts, noisy, sparse in itertools.product([0.5, 2.0], [0, 4], [True, False], [True, False],
                                                                    [None, "RSample"], [False, True]):  # fmt: skip
        args = (cf, min_cap, None, noisy, drop, rts, None, sparse)
        torch.manual_seed(1)
        expected = D.top1gating(logits.clone(), *args)
        torch.manual_seed(1)
        _same(T.top1gating(logits.clone(), *args), expected, f"top1{args}")
    for cf, drop, sample, sparse in itertools.product([0.5, 1.0], [True, False], [True, False], [False, True]):
        torch.manual_seed(2)
        expected = D.top2gating(logits.clone(), cf, 1, drop, None, sample, sparse)
        torch.manual_seed(2)
        _same(T.top2gating(logits.clone(), cf, 1, drop, None, sample, sparse), expected, "top2")
    for k, drop, policy, sparse in itertools.product([1, 3], [True, False], ["probs", "position"], [False, True]):
        _same(T.topkgating(logits, k, 0.5, 1, drop, None, policy, sparse),
              D.topkgating(logits, k, 0.5, 1, drop, None, policy, sparse), "topk")  # fmt: skip
    with pytest.raises(ValueError, match="Invalid drop_policy: nearest"):
        T.topkgating(logits, 2, 1.0, 0, drop_policy="nearest")


@pytest.mark.parametrize("k, noisy, residual", [(1, "Jitter", True), (2, None, False), (3, "RSample", False)])
def test_moe_layer_forward_and_gradients_equal_deepspeeds(ds, k, noisy, residual):
    """One rank: DeepSpeed's MoE and ours from the same seed have the same parameters (names, values, expert
    marks), outputs, aux loss, counts and gradients."""
    from deepspeed.moe.layer import MoE as DsMoE

    expert = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    layers = []
    for cls in (DsMoE, MoE):
        torch.manual_seed(3)
        layers.append(cls(8, expert, num_experts=4, k=k, noisy_gate_policy=noisy, use_residual=residual,
                          min_capacity=2))  # fmt: skip
    x = torch.randn(2, 6, 8, requires_grad=True)
    results = []
    for layer in layers:
        torch.manual_seed(5)
        out, l_aux, counts = layer(x)
        (out.sum() + l_aux).backward()
        results.append((out, l_aux, counts, x.grad.clone(), [(n, p.grad, getattr(p, "allreduce", None),
                        getattr(p, "group_name", None)) for n, p in layer.named_parameters()]))  # fmt: skip
        x.grad = None
    _same(results[1], results[0], f"layer k={k}")


def test_moe_param_groups_equal_deepspeeds(ds):
    """The same groups as DeepSpeed's (shared, then one ``moe`` group per expert group and source group)."""
    from deepspeed.moe.layer import MoE as DsMoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as ds_split

    model = torch.nn.ModuleDict({"dense": torch.nn.Linear(4, 4), "a": DsMoE(4, torch.nn.Linear(4, 4), num_experts=2),
                                 "b": DsMoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=2)})  # fmt: skip
    name = {id(p): n for n, p in model.named_parameters()}

    def groups():
        return [{"params": list(model["dense"].parameters()) + list(model["a"].parameters()), "name": "x", "lr": 1},
                {"params": list(model["b"].parameters()), "name": "y"}]  # fmt: skip

    def named(gs):
        # DeepSpeed orders the expert groups by a set of names (the order varies with PYTHONHASHSEED); ours
        # are in the order the names first appear, the same on every rank: compared as collections
        return sorted((repr({**g, "params": [name[id(p)] for p in g["params"]]}) for g in gs))

    for max_size in (None, 10):
        assert named(split_params_into_different_moe_groups_for_optimizer(groups(), max_size)) == named(
            ds_split(groups(), max_size))
    from deepspeed.moe.utils import configure_moe_param_groups

    # what the engine does to model_parameters of an MoE model when it builds the optimizer itself
    for given in (lambda: list(model.parameters()), groups):
        assert named(engine_moe.expert_param_groups(given())) == named(configure_moe_param_groups(given()))


def test_expert_rank_layout_equals_deepspeeds(ds):
    from deepspeed.utils import groups as ds_groups

    for world, tp, ep, pp, data_first in [(8, 1, 2, 1, False), (8, 1, 4, 1, True), (16, 2, 2, 2, False)]:
        assert engine_moe.expert_parallel_ranks(world, tp, ep, pp, data_first) == tuple(
            ds_groups._get_expert_parallel_ranks(world, tp, ep, pp, data_first))


def test_an_expert_parallel_layer_without_its_groups_is_refused():
    """ep_size 2 needs the expert-parallel group the engine makes: before it, the layer says so (never a
    silent all-to-all over the default group)."""
    layer = MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=2)
    with pytest.raises(NotImplementedError, match="expert-parallel group was made"):
        layer(torch.randn(1, 4, 4))


# ---- 2 ranks: expert parallelism on the engine's side --------------------------------------------------------


def _expert_model(ep_size: int):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(4, 4)
            self.moe = MoE(4, torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), num_experts=2,
                           ep_size=ep_size, use_rts=False, min_capacity=0)  # fmt: skip

        def forward(self, x):
            out, l_aux, _ = self.moe(self.inp(x))
            return out.square().mean() + l_aux

    torch.manual_seed(0)
    return Net()


def _ranks(rank: int, world_size: int, port: int, out: str) -> None:
    """ep_size 1 vs 2 on 2 ranks, rank r holding expert r: the expert gradients DeepSpeed's rule gives (summed
    over the expert-data-parallel group, divided by the world) equal the data-parallel mean of the replicated
    layer's; the start-up broadcast keeps each rank's own experts; the shared weights reduce over the world."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from torsh.engine.zero.sharding import allreduce_gradients
    from torsh.config import GradientsConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    record = {}
    replicated, parallel = _expert_model(1), _expert_model(2)
    state = replicated.state_dict()
    mine = {k.replace(f"deepspeed_experts.{rank}.", "deepspeed_experts.0."): v for k, v in state.items()
            if "deepspeed_experts" not in k or f"deepspeed_experts.{rank}." in k}  # fmt: skip
    parallel.load_state_dict(mine)
    plans = [engine_moe.prepare_experts(m, stage=0, dp_world_size=2) for m in (replicated, parallel)]
    record["active"] = [p.active for p in plans]
    record["ignored"] = sorted(getattr(parallel, "_ddp_params_and_buffers_to_ignore", []))
    DistributedDataParallel(parallel)  # accepts the ignored names
    before = parallel.moe.deepspeed_moe.experts.deepspeed_experts[0][0].weight.detach().clone()
    plans[1].broadcast()
    record["kept_own_expert"] = torch.equal(before, parallel.moe.deepspeed_moe.experts.deepspeed_experts[0][0].weight)
    x = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(rank))
    gradients = GradientsConfig()
    for model, plan in zip((replicated, parallel), plans):
        model(x).backward()
        shared = plan.shared(model.parameters()) if plan is not None else list(model.parameters())
        allreduce_gradients([p.grad for p in shared], gradients, _Precision(), 2)
        if plan is not None:
            plan.reduce_gradients(gradients)
    ours = parallel.moe.deepspeed_moe.experts.deepspeed_experts[0]
    theirs = replicated.moe.deepspeed_moe.experts.deepspeed_experts[rank]
    record["expert_grads_equal"] = all(torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)
                                       for a, b in zip(ours.parameters(), theirs.parameters()))  # fmt: skip
    record["shared_grads_equal"] = torch.allclose(parallel.inp.weight.grad, replicated.inp.weight.grad, rtol=1e-5)
    grads = [p.grad for p in parallel.parameters()]
    local = float(torch.nn.utils.get_total_norm(grads))
    norms = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(norms, torch.tensor([local]))
    record["norm"] = [plans[1].global_norm(grads), sum(float(n) for n in norms) / 2]
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


class _Precision:
    reduce_dtype = torch.float32
    param_dtype = torch.float32


def test_local_experts_reduce_over_their_group_on_two_ranks(tmp_path):
    from _engine_harness import free_port, start

    start(_ranks, (2, free_port(), str(tmp_path)), 2)
    for rank in range(2):
        record = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        assert record["active"] == [False, True]  # ep_size 1: ordinary data-parallel parameters
        assert record["ignored"] == [f"moe.deepspeed_moe.experts.deepspeed_experts.0.{i}.{w}"
                                     for i in (0, 1) for w in ("bias", "weight")]  # fmt: skip
        assert record["kept_own_expert"] and record["expert_grads_equal"] and record["shared_grads_equal"]
        assert record["norm"][0] == pytest.approx(record["norm"][1], rel=1e-6)


def test_expert_parallelism_under_fsdp_is_refused_by_name():
    layer = torch.nn.Linear(2, 2)
    for p in layer.parameters():
        p.allreduce, p.group_name = False, "ep_size_2"
    engine_moe.EXPERT_DATA_PARALLEL.setdefault("ep_size_2", None)
    engine_moe.EXPERT_DATA_PARALLEL_RANKS.setdefault("ep_size_2", [0])
    try:
        with pytest.raises(engine_moe.ExpertParallelNotSupported, match="ZeRO stage 3"):
            engine_moe.prepare_experts(layer, stage=3, dp_world_size=2, kind="fsdp")
    finally:
        engine_moe.EXPERT_DATA_PARALLEL.pop("ep_size_2", None)
        engine_moe.EXPERT_DATA_PARALLEL_RANKS.pop("ep_size_2", None)


# ---- 2 ranks through torsh.initialize -------------------------------------------------------------------------


def _trained_ranks(rank: int, world_size: int, port: int, out: str) -> None:
    """ep_size 1 and 2 from the same weights (rank r's expert of the ep-2 model is expert r of the other), one
    engine each at stages 0 and 2: the same losses, the same expert gradients (DeepSpeed's
    TestExpertWeightGradWithZero), the ranks' experts kept apart by the step."""
    import torch.distributed as dist

    import torsh
    from torsh.compat.deepspeed.utils import safe_get_full_grad

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))  # fmt: skip
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    record = {}
    for stage in (0, 2):
        replicated, parallel = _expert_model(1), _expert_model(2)
        mine = {k.replace(f"deepspeed_experts.{rank}.", "deepspeed_experts.0."): v
                for k, v in replicated.state_dict().items()
                if "deepspeed_experts" not in k or f"deepspeed_experts.{rank}." in k}  # fmt: skip
        parallel.load_state_dict(mine)
        config = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}  # fmt: skip
        engines = [torsh.initialize(model=m, config=config)[0] for m in (replicated, parallel)]
        x = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(rank))
        losses, same_grads = [], []
        for _ in range(2):
            for engine in engines:
                loss = engine(x)
                engine.backward(loss)
                losses.append(float(loss))
            theirs = engines[0].module.moe.deepspeed_moe.experts.deepspeed_experts
            grads = [safe_get_full_grad(p) for e in theirs for p in e.parameters()]  # collective: every expert
            ours = [safe_get_full_grad(p) for p in engines[1].module.moe.deepspeed_moe.experts.parameters()]
            mine_of_theirs = grads[rank * len(ours):(rank + 1) * len(ours)]
            same_grads.append(all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(ours, mine_of_theirs)))
            for engine in engines:
                engine.step()
        record[stage] = {"losses": losses, "same_grads": same_grads}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def test_expert_parallel_training_equals_the_replicated_layers_on_two_ranks(tmp_path):
    from _engine_harness import free_port, start

    start(_trained_ranks, (2, free_port(), str(tmp_path)), 2)
    for rank in range(2):
        record = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        for stage in ("0", "2"):
            losses = record[stage]["losses"]
            assert losses[0::2] == pytest.approx(losses[1::2], rel=1e-5), (rank, stage)
            assert all(record[stage]["same_grads"]), (rank, stage)
