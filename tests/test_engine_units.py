"""FSDP2 units and DDP buckets sized from DeepSpeed's settings (``reduce_bucket_size`` and friends), which the
DeepSpeed reader maps into ``sharding.buckets`` and the engine plan decides from (:mod:`torsh.sharding_plan`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import _one_process as one_process  # noqa: E402
from torsh import adapters  # noqa: E402
from torsh import sharding_plan as sp  # noqa: E402
from torsh.config import DdpConfig, TorshConfig  # noqa: E402
from torsh.engine.zero import units as u  # noqa: E402
from torsh.errors import ConfigError  # noqa: E402

BLOCK = 10 * 10 + 10  # parameters of one Linear(10, 10) block


class Stack(nn.Module):
    """An embedding, eight equal blocks in a ModuleList, a head: the shape of a transformer."""

    def __init__(self, depth: int = 8, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(7, 10)
        self.layers = nn.ModuleList(nn.Linear(10, 10) for _ in range(depth))
        self.head = nn.Linear(10, 7, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def ds(stage: int, sharding: dict | None = None, **zero) -> sp.ShardingPlan:
    """The plan's sharding section for a DeepSpeed config with these ``zero_optimization`` keys (``sharding``: core
    sharding settings on top)."""
    cfg = adapters.load({"train_batch_size": 8, "zero_optimization": {"stage": stage, **zero}}).result
    if sharding:
        cfg = cfg.model_copy(update={"sharding": type(cfg.sharding).model_validate({**dict(cfg.sharding), **sharding})})
    return sp.sharding_plan(cfg)


def native(sharding: dict) -> sp.ShardingPlan:
    """The plan's sharding section for a native config (no DeepSpeed bucket section unless ``sharding`` has one)."""
    return sp.sharding_plan(TorshConfig.from_dict({"sharding": sharding}))


def sizes(plan: u.UnitPlan) -> list[int]:
    return [len(unit.modules) for unit in plan.units]


@pytest.mark.parametrize("bucket,expected", [
    (2 * BLOCK, [2, 2, 2, 2]),  # exactly two blocks per bucket
    (3 * BLOCK + 5, [3, 3, 2]),  # the last group takes what is left
    (BLOCK - 1, [1] * 8),  # a block above the bucket is a unit alone, never split
    (None, [8]),  # DeepSpeed's defaults (5e7 / 5e8) hold the whole stack
])
def test_consecutive_blocks_are_grouped_up_to_the_smaller_bucket(bucket, expected):
    zero = {} if bucket is None else {"reduce_bucket_size": 10**6, "stage3_prefetch_bucket_size": bucket}
    plan = u.plan_units(Stack(), ds(3, **zero))
    assert plan.policy == "buckets"
    assert sizes(plan) == expected
    assert [n for unit in plan.units for n in unit.modules] == [f"layers.{i}" for i in range(8)]  # in order
    limit = bucket or sp.DEEPSPEED_DEFAULTS["prefetch_bucket_size"]
    assert all(unit.numel <= limit for unit in plan.units if len(unit.modules) > 1)
    assert plan.root_numel == 7 * 10 + 7 * 10  # embedding and head stay in the root


def test_the_reduce_bucket_bounds_units_when_it_is_the_smaller():
    plan = u.plan_units(Stack(), ds(3, reduce_bucket_size=4 * BLOCK))
    assert sizes(plan) == [4, 4]
    assert "reduce_bucket_size" in plan.summary and "sharding.buckets.reduce_bucket_size=440" in plan.summary


def test_stage_2_uses_the_allgather_bucket_and_no_live_bound():
    ext = ds(2, allgather_bucket_size=2 * BLOCK, stage3_prefetch_bucket_size=8 * BLOCK,
             stage3_max_live_parameters=2)  # fmt: skip
    plan = u.plan_units(Stack(), ext)
    assert sizes(plan) == [2, 2, 2, 2]
    assert "allgather_bucket_size" in plan.summary and "at most" not in plan.summary


@pytest.mark.parametrize("max_live,expected", [(4 * BLOCK, [2, 2, 2, 2]), (7 * BLOCK, [3, 3, 2]),
                                               (BLOCK, [1] * 8)])  # fmt: skip
def test_a_unit_never_holds_more_than_half_of_max_live_parameters(max_live, expected):
    """Two units are gathered at once at stage 3 (computing + prefetched): together within the bound."""
    ext = ds(3, reduce_bucket_size=10**6, stage3_prefetch_bucket_size=10**6, stage3_max_live_parameters=max_live)
    plan = u.plan_units(Stack(), ext)
    assert sizes(plan) == expected
    multi = [unit for unit in plan.units if len(unit.modules) > 1]
    assert all(2 * unit.numel <= max_live for unit in multi)
    assert "max_live_parameters" in plan.summary
    if multi:
        assert "per-unit bound" in plan.units[0].reason


def test_every_unit_says_why():
    plan = u.plan_units(Stack(), ds(3, stage3_prefetch_bucket_size=3 * BLOCK))
    lines = plan.describe()
    assert lines[0] == plan.summary and lines[-1].startswith("root: the remaining")
    assert "unit 0: layers.0 .. layers.2 (3 modules) (330 parameters)" in lines[1]
    assert "adding layers.3 (110) would exceed the target" in lines[1]
    assert "the last blocks; kept gathered from forward to backward: reused within 280 parameters" in lines[3]


@pytest.mark.parametrize("window,kept", [
    (None, [True, True, True]),  # DeepSpeed's default 1e9: a small model is never freed between forward and backward
    (1000, [False, True, True]),  # units 1 and 2 are reused within 720 and 280 parameters, unit 0 within 1380
    (1, [False, False, False]),  # every unit freed after forward, as stage 3 implies
])
def test_stage3_units_reused_within_max_reuse_distance_stay_gathered(window, kept):
    """DeepSpeed frees a parameter after forward only when its next use (in backward) is max_reuse_distance
    elements or more away; the units it would keep are not resharded after forward."""
    zero = {"stage3_prefetch_bucket_size": 3 * BLOCK}
    if window is not None:
        zero["stage3_max_reuse_distance"] = window
    plan = u.plan_units(Stack(), ds(3, **zero))
    assert plan.root_numel == 70 + 70  # the embedding and the bias-free head
    assert [unit.reshard_after_forward is False for unit in plan.units] == kept
    assert all(unit.reshard_after_forward in (None, False) for unit in plan.units)
    assert ["kept gathered" in unit.reason for unit in plan.units] == kept


@pytest.mark.parametrize("stage, sharding", [(2, None), (3, {"reshard_after_forward": True})])
def test_reuse_distance_leaves_stage2_and_an_explicit_reshard_alone(stage, sharding):
    plan = u.plan_units(Stack(), ds(stage, sharding))
    assert [unit.reshard_after_forward for unit in plan.units] == [None]


def test_max_reuse_distance_is_read_under_both_spellings_and_checked():
    assert sp.bucket_settings(None).max_reuse_distance == 10**9
    assert ds(3, max_reuse_distance=5).buckets.max_reuse_distance == 5
    assert ds(3, stage3_max_reuse_distance=7).buckets.sources["max_reuse_distance"] == \
        "sharding.buckets.max_reuse_distance=7"  # fmt: skip
    with pytest.raises(ConfigError, match="stage3_max_reuse_distance"):
        ds(3, stage3_max_reuse_distance=-1)


def test_per_layer_stays_selectable():
    plan = u.plan_units(Stack(), ds(3), policy="per_layer")
    assert sizes(plan) == [1] * 8 and plan.policy == "per_layer"
    assert "memory first" in plan.units[0].reason


def test_policy_resolution():
    assert ds(3).policy == "buckets"  # a DeepSpeed config: its bucket section, even empty
    assert native({"stage": 3, "buckets": {"reduce_bucket_size": 5}}).policy == "buckets"
    assert native({"stage": 3}).policy == "children"  # the engine's default
    explicit = ds(3, {"wrap": {"module_classes": ["Linear"]}})
    assert explicit.policy == "wrap"  # a written wrap policy is kept
    plan = u.plan_units(Stack(), explicit)
    assert len(plan.units) == 9 and all("module_classes" in unit.reason for unit in plan.units)
    with pytest.raises(ConfigError, match="sharding.units"):
        u.plan_units(Stack(), ds(3), policy="coarse")


def test_blocks_sharing_a_weight_with_the_rest_stay_in_the_root():
    model = Stack()
    model.head = nn.Linear(10, 10, bias=False)
    model.head.weight = model.layers[0].weight  # tied across the container's boundary
    plan = u.plan_units(model, ds(3))
    assert "layers.0" not in plan.units[0].modules and plan.units[0].modules[0] == "layers.1"


def test_tied_embeddings_stay_in_the_root_unit():
    plan = u.plan_units(Stack(tied=True), ds(3))
    assert sizes(plan) == [8] and plan.root_numel == 70


def test_a_model_without_a_block_container_gets_one_unit_per_child():
    model = nn.Sequential()  # the root itself is not a container of blocks
    model.add_module("a", nn.Linear(4, 4))
    model.add_module("b", nn.ReLU())
    plan = u.plan_units(model, ds(3))
    assert [unit.modules for unit in plan.units] == [("a",)] and "no repeated-block container" in plan.summary


def test_settings_read_from_a_deepspeed_config_in_either_spelling():
    for key in ("stage3_prefetch_bucket_size", "prefetch_bucket_size"):
        cfg = adapters.load({"train_batch_size": 8, "zero_optimization": {"stage": 3, key: 2 * BLOCK}}).result
        assert cfg.sharding.buckets.prefetch_bucket_size == 2 * BLOCK
        assert sp.sharding_plan(cfg).buckets.prefetch_bucket_size == 2 * BLOCK
    settings = sp.bucket_settings(None)
    assert (settings.reduce_bucket_size, settings.prefetch_bucket_size) == (500_000_000, 50_000_000)
    assert settings.sources["max_live_parameters"] == "DeepSpeed's default 1e+09"


def test_auto_is_deferred_and_read_as_deepspeeds_default():
    plan = ds(3, reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto")
    assert plan.buckets.reduce_bucket_size == 500_000_000  # DeepSpeed reads "auto" as its default
    assert plan.buckets.sources["reduce_bucket_size"].startswith("sharding.buckets.reduce_bucket_size=auto")


@pytest.mark.parametrize("key, bad", [("allgather_bucket_size", -1), ("allgather_bucket_size", "big"),
                                      ("allgather_bucket_size", True), ("stage3_max_live_parameters", -1)])  # fmt: skip
def test_a_bad_bucket_size_names_its_key(key, bad):
    # DeepSpeed 0.19.8 bounds: reduce_bucket_size gt=0 (0 is dropped, see below), the others ge=0
    with pytest.raises(ConfigError, match=f"zero_optimization.{key}"):
        ds(3, **{key: bad})


def test_a_zero_reduce_bucket_is_dropped_so_deepspeeds_default_applies():
    translation = adapters.load({"train_batch_size": 8, "zero_optimization": {"stage": 2, "reduce_bucket_size": 0}})
    assert translation.result.sharding.buckets.reduce_bucket_size is None
    assert sp.sharding_plan(translation.result).reduce_bucket_numel == 500_000_000


def test_a_zero_allgather_bucket_is_accepted_as_deepspeed_accepts_it():
    assert ds(2, allgather_bucket_size=0).buckets.allgather_bucket_size == 0


def test_zero_max_live_parameters_is_accepted_and_gives_one_unit_per_block():
    """axolotl's ZeRO-3 configs set stage3_max_live_parameters 0, which DeepSpeed 0.19.8 accepts (ge=0): nothing is
    held gathered ahead, so no two blocks share a unit."""
    plan = u.plan_units(Stack(), ds(3, stage3_max_live_parameters=0))
    assert sizes(plan) == [1] * 8


# ---- DDP ------------------------------------------------------------------------------------------


def test_ddp_bucket_is_reduce_bucket_size_in_mib_of_gradients():
    mb, why = sp.ddp_bucket_cap_mb(DdpConfig(), _sizes(reduce_bucket_size=2**20), grad_bytes=4)
    assert mb == pytest.approx(4.0) and "x 4 bytes" in why
    mb, _ = sp.ddp_bucket_cap_mb(DdpConfig(), _sizes(reduce_bucket_size=2**20), grad_bytes=2)
    assert mb == pytest.approx(2.0)  # bf16 gradients: the same elements in half the bytes


def _sizes(**sizes):
    from torsh.config import BucketSizes

    return BucketSizes(**sizes)


def test_ddp_bucket_defaults_to_deepspeeds_5e8_elements():
    mb, why = sp.ddp_bucket_cap_mb(DdpConfig(), _sizes(), grad_bytes=4)
    assert mb == pytest.approx(5e8 * 4 / 2**20)  # 1907.3 MiB, not DDP's 25
    assert "DeepSpeed's default" in why


def test_ddp_bucket_keeps_an_explicit_value_and_jobs_without_buckets():
    assert sp.ddp_bucket_cap_mb(DdpConfig(bucket_cap_mb=50), _sizes(reduce_bucket_size=2**20), grad_bytes=4)[0] == 50
    assert sp.ddp_bucket_cap_mb(DdpConfig(), None, grad_bytes=4)[0] == 25.0


def test_explain_lines_need_no_model():
    from torsh.plan import plan

    cfg = adapters.load({"train_batch_size": 8, "zero_optimization": {"stage": 0, "reduce_bucket_size": 2**20}})
    assert "DDP gradient buckets of 4.0 MiB: reduce_bucket_size 1.05e+06 (sharding.buckets.reduce_bucket_size" \
           "=1.05e+06) x 4 bytes per gradient element = 4.0 MiB" in plan(cfg.result, 2).steps  # fmt: skip
    assert native({"stage": 3}).describe_units() == ["FSDP2 units: each direct child holding parameters"]
    assert ds(3).describe_units()[0].startswith("FSDP2 units: consecutive blocks grouped up to 50M parameters")


def test_importing_the_module_does_not_import_torch():
    code = "import sys, torsh.engine.zero.units, torsh.sharding_plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---- the engine's call: fully_shard over each unit's modules ---------------------------------------------


def test_fully_shard_takes_each_unit_as_a_list(tmp_path):
    """The hook-up the engine uses: one ``fully_shard([m1, m2, ...])`` per unit, then the root; a step runs and
    FSDP2 makes one parameter group per unit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = Stack(tied=True)
        reference = Stack(tied=True)
        reference.load_state_dict(model.state_dict())
        plan = u.plan_units(model, ds(3, stage3_prefetch_bucket_size=3 * BLOCK))
        modules = dict(model.named_modules())
        mesh = init_device_mesh("cpu", (1,))
        for unit in plan.units:
            fully_shard([modules[n] for n in unit.modules], mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        tokens = torch.randint(0, 7, (6,))
        model(tokens).sum().backward()
        reference(tokens).sum().backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        for n, p in reference.named_parameters():
            torch.testing.assert_close(grads[n], p.grad)
        states = {id(m._get_fsdp_state()) for m in modules.values() if hasattr(m, "_get_fsdp_state")}
        assert len(states) == len(plan.units) + 1 == 4
    finally:
        dist.destroy_process_group()


def test_the_plan_gets_ddp_buckets_from_reduce_bucket_size():
    from torsh.plan import plan

    raw = {"train_batch_size": 8, "zero_optimization": {"stage": 1, "reduce_bucket_size": 2**20},
           "bf16": {"enabled": True}}  # fmt: skip
    cfg = adapters.load(raw).result
    decided = plan(cfg, 2)
    assert decided.sharding.ddp.bucket_cap_mb == pytest.approx(2.0)  # 2**20 bf16 gradients
    assert decided.step.ddp.bucket_cap_mb == pytest.approx(2.0)  # what the engine's DDP is built with
    assert cfg.ddp.bucket_cap_mb == 25.0  # the config is left alone
    assert plan(TorshConfig(), 2).sharding.ddp == TorshConfig().ddp  # no bucket section: DDP's own
    assert decided.sharding.reduce_bucket_numel == 2**20  # ZeRO-1/2's buckets in elements


def test_a_unit_that_would_split_a_tied_weight_is_left_to_the_root():
    """Each direct child as a unit would put the tied embedding and head in two units: both stay in the root."""
    plan = u.plan_units(Stack(tied=True), native({"stage": 3}))
    assert plan.policy == "children"
    assert [unit.modules[0] for unit in plan.units] == [f"layers.{i}" for i in range(8)]


INITIALIZE_SCRIPT = """
import torch, torsh
from torch import nn
from torch.distributed.tensor import DTensor
from _one_process import run_cases

class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 10)
        self.layers = nn.ModuleList(nn.Linear(10, 10) for _ in range(8))
        self.head = nn.Linear(10, 7)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)

def run(bucket, reuse):
    model = Stack()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": bucket,
                                    "stage3_max_reuse_distance": reuse}}
    engine, *_ = torsh.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randint(0, 7, (2, 3))).sum()
    gathered = [not isinstance(model.layers[i].weight, DTensor) for i in (0, 3, 6)]
    engine.backward(loss)
    engine.step()
    states = {id(m._get_fsdp_state()) for m in model.modules() if hasattr(m, "_get_fsdp_state")}
    return {"gathered": str(gathered), "states": len(states)}

run_cases(run)
"""

INITIALIZE_CASES = [
    (3 * BLOCK, 4, 10**9, "[True, True, True]"),
    (3 * BLOCK, 4, 1000, "[False, True, True]"),
    (1, 9, 1, "[False, False, False]"),
]


@pytest.fixture(scope="module")
def initialize_records() -> dict[tuple[int, int], dict]:
    """Every case of INITIALIZE_CASES through torsh.initialize in one process; ``{(bucket, reuse): record}``."""
    cases = [(bucket, reuse) for bucket, _, reuse, _ in INITIALIZE_CASES]
    env = {"PATH": "/usr/bin:/bin", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    return dict(zip(cases, one_process.records(INITIALIZE_SCRIPT, cases, env=env, timeout=300)))


@pytest.mark.slow
@pytest.mark.parametrize("bucket,states,reuse,gathered", INITIALIZE_CASES)
def test_initialize_shards_a_deepspeed_config_in_units_of_its_bucket_size(initialize_records, bucket, states, reuse,
                                                                          gathered):
    """Through torsh.initialize: 8 blocks in units of 3 (3 units + the root), or each block alone (8 + root);
    after forward, the units reused within stage3_max_reuse_distance hold their gathered parameters."""
    record = initialize_records[(bucket, reuse)]
    assert "error" not in record, record.get("traceback")
    assert record["states"] == states
    assert record["gathered"] == gathered
