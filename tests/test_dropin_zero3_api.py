"""The drop-in's ZeRO-3 module-level API: DeepSpeed's ZeRO-3 linear function (``deepspeed.runtime.zero.linear``)
and its installation as ``F.linear`` by ``zero.Init``, the single-rank group guard, ``all_gather_coalesced`` on a
partitioned parameter, and the parameter dictionary that gathers another module's parameter read in a forward
(``deepspeed.runtime.zero.parameter_offload``). One process each; compared with DeepSpeed where that is cheap."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

_REAL = "DeepSpeed is not installed"


@pytest.fixture
def pp(monkeypatch):
    """partition_parameters, with ``zero.Init`` not starting a process group, and ``F.linear`` as it was after."""
    from torsh.compat.deepspeed import comm
    from torsh.compat.deepspeed.runtime.zero import partition_parameters

    monkeypatch.setattr(comm, "init_distributed", lambda *a, **k: None)
    original = F.linear
    had_backup = "linear_bk" in vars(partition_parameters.InsertPostInitMethodToModuleSubClasses)
    yield partition_parameters
    F.linear = original
    if not had_backup and "linear_bk" in vars(partition_parameters.InsertPostInitMethodToModuleSubClasses):
        del partition_parameters.InsertPostInitMethodToModuleSubClasses.linear_bk


# --- the linear function ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8,), (3, 8), (2, 3, 8)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("bias", [True, False])
def test_zero3_linear_gives_deepspeeds_values_and_gradients(shape, bias):
    real = pytest.importorskip("deepspeed.runtime.zero.linear", reason=_REAL)
    from torsh.compat.deepspeed.runtime.zero.linear import zero3_linear_wrap

    torch.manual_seed(0)
    leaves = [torch.randn(*shape), torch.randn(4, 8), torch.randn(4) if bias else None]
    results = []
    for fn in (zero3_linear_wrap, real.zero3_linear_wrap, F.linear):
        args = [t.clone().requires_grad_() if t is not None else None for t in leaves]
        out = fn(*args)
        (out * torch.arange(out.numel()).reshape(out.shape)).sum().backward()
        results.append([out.detach()] + [a.grad for a in args if a is not None])
    ours, deepspeeds, torchs = results
    for a, b, c in zip(ours, deepspeeds, torchs):
        assert torch.equal(a, b)  # DeepSpeed's arithmetic exactly
        torch.testing.assert_close(a, c)  # and F.linear's values


def test_backward_runs_in_the_forwards_autocast_state():
    from torsh.compat.deepspeed.runtime.zero.linear import zero3_linear_wrap

    weight, x = torch.randn(4, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = zero3_linear_wrap(x, weight)
    assert out.dtype == torch.bfloat16 and out.grad_fn._fwd_used_autocast is True
    assert out.grad_fn._dtype == torch.bfloat16
    plain = zero3_linear_wrap(x, weight)
    assert plain.grad_fn._fwd_used_autocast is False
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an autocast region around backward changes nothing
        plain.sum().backward()
    assert weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    torch.testing.assert_close(weight.grad, torch.ones(2, 4).t() @ x.detach())


def test_torch_func_transforms_run_over_it():
    from torsh.compat.deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3, zero3_linear_wrap

    weight, bias, xs = torch.randn(4, 8), torch.randn(4), torch.randn(3, 8)
    got = torch.func.vmap(lambda x: LinearFunctionForZeroStage3.apply(x, weight, bias).sum())(xs)
    torch.testing.assert_close(got, (xs @ weight.t() + bias).sum(-1))
    grad = torch.func.grad(lambda w: zero3_linear_wrap(xs, w).sum())(weight)
    torch.testing.assert_close(grad, torch.ones(3, 4).t() @ xs)


def test_the_module_is_nn_linear_with_deepspeeds_function():
    from torsh.compat.deepspeed.runtime.zero import linear

    torch.manual_seed(1)
    ours = linear.LinearModuleForZeroStage3(5, 3)
    torch.manual_seed(1)
    reference = nn.Linear(5, 3)
    assert torch.equal(ours.weight, reference.weight) and torch.equal(ours.bias, reference.bias)
    x = torch.randn(2, 5)
    assert torch.equal(ours(x), reference(x)) and "LinearFunctionForZeroStage3" in type(ours(x).grad_fn).__name__
    assert linear.autocast_custom_fwd.func is torch.amp.custom_fwd
    assert isinstance(linear.autocast_custom_bwd, functools.partial)
    assert linear.autocast_custom_bwd.keywords == {"device_type": "cpu"}


# --- zero.Init ----------------------------------------------------------------------------------------------------


def test_init_installs_the_zero3_linear_once_and_keeps_it(pp):
    original = F.linear
    context = pp.Init()
    assert F.linear is original  # not before the context is entered
    with context:
        assert F.linear is pp.zero3_linear_wrap
        with pp.Init():
            assert pp.InsertPostInitMethodToModuleSubClasses.linear_bk is original
        model = nn.Linear(4, 3)
    assert F.linear is pp.zero3_linear_wrap  # DeepSpeed never restores it
    assert pp.is_zero_param(model.weight) and isinstance(context, pp.InsertPostInitMethodToModuleSubClasses)


def test_init_with_a_module_installs_it_and_keeps_a_wrapper_around_it(pp):
    original = F.linear
    pp.Init(module=nn.Linear(4, 3))
    assert F.linear is pp.zero3_linear_wrap and pp.InsertPostInitMethodToModuleSubClasses.linear_bk is original

    @functools.wraps(pp.zero3_linear_wrap)
    def wrapper(*args, **kwargs):
        return pp.zero3_linear_wrap(*args, **kwargs)

    F.linear = wrapper  # a library's wrapper around the ZeRO-3 linear stays
    pp.Init(module=nn.Linear(4, 3))
    assert F.linear is wrapper


@pytest.mark.parametrize("config, argument", [({"zero_optimization": {"memory_efficient_linear": False}}, True),
                                              (None, False)])  # fmt: skip
def test_memory_efficient_linear_off_leaves_f_linear_alone(pp, config, argument):
    original = F.linear
    with pp.Init(config_dict_or_path=config, mem_efficient_linear=argument):
        nn.Linear(2, 2)
    assert F.linear is original
    assert "linear_bk" not in vars(pp.InsertPostInitMethodToModuleSubClasses)


def test_a_config_without_the_key_installs_it_whatever_the_argument(pp):
    with pp.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}, mem_efficient_linear=False):
        assert F.linear is pp.zero3_linear_wrap  # DeepSpeed: the config's value (default true) decides


def test_single_rank_group_guard_is_deepspeeds():
    real = pytest.importorskip("deepspeed.runtime.zero.partition_parameters", reason=_REAL)
    from torsh.compat.deepspeed.runtime.zero.partition_parameters import _contradicting_single_rank_pg_error as ours

    cases = [(1, None, {"WORLD_SIZE": "8"}), (1, None, {"WORLD_SIZE": "1"}), (1, None, {}), (4, None, {"WORLD_SIZE":
             "4"}), (1, object(), {"WORLD_SIZE": "8"}), (1, None, {"WORLD_SIZE": ""}),
             (1, None, {"WORLD_SIZE": "x"}), (1, None, {"WORLD_SIZE": None})]  # fmt: skip
    for case in cases:
        assert (ours(*case) is None) == (real._contradicting_single_rank_pg_error(*case) is None), case
    message = ours(1, None, {"WORLD_SIZE": "8"})
    assert "WORLD_SIZE=8" in message and "init_distributed" in message and "data_parallel_group" in message


def test_all_gather_coalesced_gathers_partitioned_parameters(pp):
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.arange(1.0, 6.0))
            self.b = nn.Parameter(torch.arange(1.0, 5.0).reshape(2, 2))

    with pp.Init(mem_efficient_linear=False):
        holder = Holder()
    params = [holder.a, holder.b]
    assert all(p.numel() == 0 for p in params)
    params[0].all_gather_coalesced(params).wait()
    assert torch.equal(holder.a.data, torch.arange(1.0, 6.0))
    assert torch.equal(holder.b.data, torch.arange(1.0, 5.0).reshape(2, 2))
    assert all(p.ds_status is pp.ZeroParamStatus.AVAILABLE for p in params)
    holder.a.partition(params)
    assert all(p.numel() == 0 for p in params)


# --- the parameter dictionary -------------------------------------------------------------------------------------


def test_ensure_zero_ordered_dict_wraps_once_and_keeps_the_first_container():
    from torsh.compat.deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict

    module = nn.Linear(2, 2)
    first = module._parameters
    ensure_zero_ordered_dict(module)
    wrapped = module._parameters
    assert isinstance(wrapped, ZeROOrderedDict) and list(wrapped) == ["weight", "bias"]
    assert module._original_parameters is first and module.weight is first["weight"]
    ensure_zero_ordered_dict(module)
    assert module._parameters is wrapped
    module._parameters = dict(wrapped)
    ensure_zero_ordered_dict(module)
    assert module._original_parameters is first
    bare = type("Bare", (), {})()
    ensure_zero_ordered_dict(bare)  # nothing to wrap: no error
    assert not hasattr(bare, "_original_parameters")


class _ExternalUse(nn.Module):
    """A forward reading a child's weight after the child's own forward (DeepSpeed's external parameter)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return F.linear(self.second(self.first(x)), self.first.weight).pow(2).sum()


def test_a_parameter_read_outside_its_modules_forward_is_gathered_at_stage_3(monkeypatch):
    import copy
    import socket

    from torsh.compat import deepspeed
    from torsh.compat.deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict
    from torsh.compat.deepspeed.utils import safe_get_full_grad
    from torsh.engine.distributed import shutdown

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0",
                           WORLD_SIZE="1").items():  # fmt: skip
        monkeypatch.setenv(key, value)
    torch.manual_seed(0)
    model = _ExternalUse()
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3}}  # fmt: skip
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        assert isinstance(engine.module.first._parameters, ZeROOrderedDict)
        x = torch.randn(2, 4)
        engine.backward(engine(x))  # under FSDP2 alone: "mixed torch.Tensor and DTensor"
        reference(x).backward()
        torch.testing.assert_close(safe_get_full_grad(model.first.weight), reference.first.weight.grad)
        assert model.first.weight.is_external_param and not model.second.weight.is_external_param
        assert model.first.weight.ds_active_sub_modules == set()
        late = nn.Linear(4, 4)
        late._parameters = dict(late._parameters)
        engine.module.late = late  # attached after initialize: converted at the next forward
        engine(x)
        assert isinstance(late._parameters, ZeROOrderedDict) and not late._parameters._in_forward
    finally:
        shutdown()


def test_zero_init_refuses_quantized_initialization_it_would_not_do():
    """DeepSpeed's zero.Init quantizes the weights it builds under weight_quantization.quantized_initialization;
    torsh would build them in full precision, so it says so instead of giving other values."""
    from torsh.compat.deepspeed._unsupported import NotSupportedByTorsh
    from torsh.compat.deepspeed.runtime.zero import partition_parameters as pp

    config = {"train_batch_size": 2, "zero_optimization": {"stage": 3},
              "weight_quantization": {"quantized_initialization": {"num_bits": 8}}}  # fmt: skip
    with pytest.raises(NotSupportedByTorsh, match="weight_quantization.quantized_initialization"):
        pp.Init(config_dict_or_path=config)
