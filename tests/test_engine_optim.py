"""Optimizer construction from the core model: torch names, DeepSpeed's resolved names, clear refusals."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torsh.config import OptimizerConfig  # noqa: E402
from torsh.engine.optim import build_optimizer  # noqa: E402
from torsh.errors import ConfigError  # noqa: E402


def _params():
    return [torch.nn.Parameter(torch.ones(3))]


def test_adamw_with_typed_fields_and_kwargs():
    cfg = OptimizerConfig(name="AdamW", lr=0.01, weight_decay=0.0, betas=(0.8, 0.9), eps=1e-6,
                          kwargs={"foreach": False})
    opt = build_optimizer(cfg, _params(), offload=False)
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"], group["eps"], group["foreach"]) == (
        0.01, 0.0, (0.8, 0.9), 1e-6, False)


def test_unset_fields_keep_the_class_defaults():
    opt = build_optimizer(OptimizerConfig(name="AdamW"), _params(), offload=False)
    assert opt.param_groups[0]["weight_decay"] == 0.01  # torch AdamW's own default; adapters write DS's 0


def test_adam_is_l2_adam_and_sgd_takes_momentum():
    assert type(build_optimizer(OptimizerConfig(name="Adam"), _params(), offload=False)) is torch.optim.Adam
    sgd = build_optimizer(OptimizerConfig(name="SGD", lr=0.1, momentum=0.9), _params(), offload=True)
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["momentum"] == 0.9


def test_param_groups_are_kept():
    a, b = _params(), _params()
    opt = build_optimizer(OptimizerConfig(name="AdamW", lr=0.1), [{"params": a}, {"params": b, "lr": 0.5}],
                          offload=False)  # fmt: skip
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]


def test_no_section_or_no_name_builds_nothing():
    assert build_optimizer(None, _params(), offload=False) is None
    assert build_optimizer(OptimizerConfig(lr=0.5), _params(), offload=False) is None


@pytest.mark.parametrize("name", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_deepspeed_only_optimizers_are_refused_with_an_alternative(name):
    with pytest.raises(ConfigError, match="unsupported by the engine: use") as err:
        build_optimizer(OptimizerConfig(name=name), _params(), offload=False)
    assert err.value.problems[0].path == "optimizer.name"


def test_unknown_name_suggests_the_torch_class():
    with pytest.raises(ConfigError) as err:
        build_optimizer(OptimizerConfig(name="Adamw"), _params(), offload=False)
    assert err.value.problems[0].suggestion == "AdamW"


def test_foreign_keywords_and_auto_are_config_errors_naming_the_key():
    cfg = OptimizerConfig(name="SGD", betas=(0.9, 0.99), lr="auto", kwargs={"bias_correction": False})
    with pytest.raises(ConfigError) as err:
        build_optimizer(cfg, _params(), offload=False)
    assert {p.path for p in err.value.problems} == {"optimizer.lr", "optimizer.betas",
                                                    "optimizer.kwargs.bias_correction"}  # fmt: skip


def test_capturable_is_refused_with_cpu_offload():
    cfg = OptimizerConfig(name="AdamW", kwargs={"capturable": True})
    with pytest.raises(ConfigError, match="offload"):
        build_optimizer(cfg, _params(), offload=True)


def test_fsdp2_shards_are_stepped_with_foreach_ops_unless_the_config_says(tmp_path):
    """FSDP2's parameters are DTensors: torch would step them one by one on the CPU (a DTensor dispatch per
    parameter and op); the engine asks for one foreach op per list. The update is the same; an explicit
    ``foreach`` in the config wins, and plain tensors and iterators are left to torch's own choice."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        sharded = list(model.parameters())
        opt = build_optimizer(OptimizerConfig(name="AdamW"), sharded, offload=False)
        assert opt.defaults["foreach"] is True
        grouped = build_optimizer(OptimizerConfig(name="AdamW"), [{"params": sharded[0]}, {"params": sharded[1:]}],
                                  offload=False)  # fmt: skip
        assert grouped.defaults["foreach"] is True
        told = build_optimizer(OptimizerConfig(name="AdamW", kwargs={"foreach": False}), sharded, offload=False)
        assert told.defaults["foreach"] is False
        # an optimizer the script built is rebuilt over the shards the same way, unless it chose foreach itself
        from torsh.engine.optim import build_step_optimizer

        names = {id(p): f"p{i}" for i, p in enumerate(sharded)}
        by_name = {names[id(p)]: p for p in sharded}
        for chosen, expected in ((None, True), (False, False)):
            client = torch.optim.AdamW(sharded, lr=0.1, foreach=chosen)
            rebuilt = build_step_optimizer(section=None, client=client, groups=[], name_of=names, by_name=by_name,
                                           offload=False)  # fmt: skip
            assert rebuilt.defaults["foreach"] is expected
        assert build_optimizer(OptimizerConfig(name="AdamW"), _params(), offload=False).defaults["foreach"] is None
        lazy = build_optimizer(OptimizerConfig(name="AdamW"), iter(sharded), offload=False)
        assert lazy.defaults["foreach"] is None and len(lazy.param_groups[0]["params"]) == 4
        # the same update as torch's one-at-a-time loop, bit for bit, on a copy of the model
        twin = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        twin.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
        fully_shard(twin, mesh=init_device_mesh("cpu", (1,)))
        looped = build_optimizer(OptimizerConfig(name="AdamW", kwargs={"foreach": False}), list(twin.parameters()),
                                 offload=False)  # fmt: skip
        before = {id(p): p.detach().full_tensor().clone() for p in sharded}
        for _ in range(3):
            for net, optimizer in ((model, opt), (twin, looped)):
                net(torch.ones(2, 4)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        assert all(not torch.equal(p.detach().full_tensor(), before[id(p)]) for p in sharded)
        for ours, theirs in zip(sharded, twin.parameters()):
            assert torch.equal(ours.detach().full_tensor(), theirs.detach().full_tensor())
    finally:
        dist.destroy_process_group()


def test_an_optimizer_class_that_cannot_be_rebuilt_is_a_config_error_naming_it():
    """A wrapper optimizer (its constructor takes another optimizer) cannot be rebuilt over the step's tensors:
    a ConfigError naming it and what to pass instead, not the TypeError of its constructor."""
    from torsh.engine.optim import construct

    class Wrap(torch.optim.Optimizer):
        def __init__(self, inner, k):
            self.inner = inner
            super().__init__(inner.param_groups, {})

    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError) as err:
        construct(Wrap, [{"params": [p]}], {})
    assert "Wrap" in str(err.value) and "the optimizer it wraps" in str(err.value)
    assert isinstance(construct(torch.optim.SGD, [{"params": [p]}], {"lr": 0.1}), torch.optim.SGD)


@pytest.mark.parametrize(("name", "says"), [("LBFGS", "closure"), ("SparseAdam", "sparse gradients")])
def test_a_configured_optimizer_the_engine_cannot_step_is_refused_naming_the_key(name, says):
    with pytest.raises(ConfigError) as err:
        build_optimizer(OptimizerConfig(name=name), _params(), offload=False)
    assert "optimizer.name" in str(err.value) and name in str(err.value) and says in str(err.value)
    assert build_optimizer(OptimizerConfig(name="Adafactor"), _params(), offload=False) is not None  # not sharded
