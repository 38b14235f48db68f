"""``deepspeed.zero.Init`` partitions each module's parameters when its constructor returns, as DeepSpeed does, so
that no rank ever holds the whole model (``torsh.engine.zero.construction``): one process here (each partition
is then the whole flattened parameter); the 2-rank behaviour, the element count per rank and training from the
partitions are in ``test_zero_init_ranks.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402


@pytest.fixture
def pp(monkeypatch):
    """The partition_parameters module, with ``zero.Init`` not starting a process group in the test process."""
    from torsh.compat.deepspeed import comm
    from torsh.compat.deepspeed.runtime.zero import partition_parameters

    started = []
    monkeypatch.setattr(comm, "init_distributed", lambda *a, **k: started.append(True))
    partition_parameters.started = started
    return partition_parameters


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)  # Linear initialises its parameters in its own constructor
        self.scale = nn.Parameter(torch.empty(3))
        nn.init.constant_(self.scale, 0.5)  # its own parameter, in its own constructor: kept


class _Model(nn.Module):
    def __init__(self, post_init: bool = False, apply: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.gain = nn.Parameter(torch.ones(2))
        if post_init:  # the children are partitioned by now: an in-place change does nothing, as under DeepSpeed
            for block in self.blocks:
                nn.init.zeros_(block.proj.weight)
        if apply:  # Module.apply gathers each module around the function (DeepSpeed's override_module_apply)
            self.apply(self._init)
        nn.init.constant_(self.gain, 2.0)  # its own parameter, inside its own constructor: kept

    @staticmethod
    def _init(module):
        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.bias.fill_(7.0)


def _whole(pp, param):
    with pp.GatheredParameters([param]):
        return param.detach().clone()


def test_zero_init_starts_distributed_when_not_started(pp):
    with pp.Init(enabled=False):
        pass
    assert pp.started == [True]


def test_parameters_are_partitioned_when_their_constructor_returns(pp):
    from torsh.engine.zero.params import ZeroParamStatus

    with pp.Init(dtype=torch.float):
        model = _Model()
    params = list(model.parameters())
    assert all(p.numel() == 0 for p in params)  # DeepSpeed leaves param.data empty
    assert [tuple(p.ds_shape) for p in params] == [(2,), (3,), (3, 3), (3,), (3,), (3, 3), (3,)]
    assert [p.ds_tensor.numel() for p in params] == [p.ds_numel for p in params]  # one rank: the whole of each
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE and not p.ds_persist for p in params)
    ids = [p.ds_id for p in params]
    assert len(set(ids)) == len(ids) and model.gain.ds_id == max(ids)  # the outer constructor returns last
    assert all(pp.is_zero_param(p) for p in params)
    assert torch.equal(_whole(pp, model.gain), torch.full((2,), 2.0))
    assert torch.equal(_whole(pp, model.blocks[1].scale), torch.full((3,), 0.5))


def test_a_change_after_the_constructor_returned_is_dropped_as_under_deepspeed(pp):
    torch.manual_seed(0)
    with pp.Init(dtype=torch.float):
        model = _Model(post_init=True)
    with torch.no_grad():
        model.blocks[1].scale.mul_(3)  # after the context: the data is empty
    weight = _whole(pp, model.blocks[0].proj.weight)
    assert weight.abs().sum() > 0  # Linear's own initialisation, not the zeros of the parent's post-init
    assert torch.equal(_whole(pp, model.blocks[1].scale), torch.full((3,), 0.5))


def test_module_apply_inside_the_context_gathers_each_module(pp):
    with pp.Init(dtype=torch.float):
        model = _Model(apply=True)
    assert torch.equal(_whole(pp, model.blocks[0].proj.bias), torch.full((3,), 7.0))
    assert model.blocks[0].proj.bias.numel() == 0  # partitioned again
    assert nn.Module.apply.__module__ == "torch.nn.modules.module"  # restored on leaving


def test_gathered_parameters_keeps_a_write_only_with_a_modifier_rank(pp):
    with pp.Init(dtype=torch.float):
        model = _Model()
    with pp.GatheredParameters([model.gain], modifier_rank=0):
        assert model.gain.shape == (2,)
        model.gain.data.fill_(5.0)
    with pp.GatheredParameters([model.gain]):
        model.gain.data.fill_(9.0)  # no modifier rank: dropped, as DeepSpeed drops it
    assert torch.equal(_whole(pp, model.gain), torch.full((2,), 5.0))
    with pp.GatheredParameters(model.gain, modifier_rank=0):
        with pp.GatheredParameters(model.gain):  # nested: already whole
            assert model.gain.numel() == 2


def test_deepspeeds_parameter_methods(pp):
    from torsh.engine.zero.params import ZeroParamStatus

    with pp.Init(dtype=torch.float):
        layer = nn.Linear(4, 2)
    layer.weight.all_gather()
    assert layer.weight.shape == (2, 4) and layer.weight.ds_status is ZeroParamStatus.AVAILABLE
    layer.weight.data.fill_(3.0)
    layer.weight.partition(has_been_updated=True)  # this rank's whole value becomes its partition
    assert layer.weight.numel() == 0 and torch.all(layer.weight.ds_tensor == 3.0)
    assert layer.weight.partition_numel() == 8 and layer.weight.padding_size() == 0
    assert layer.weight.ds_summary()["shape"] == (2, 4)


def test_skip_init_modules_are_partitioned_once_they_have_storage(pp):
    with pp.Init(dtype=torch.float):
        layer = torch.nn.utils.skip_init(nn.Linear, 5, 4)
    assert layer.weight.numel() == 0 and layer.weight.ds_tensor.numel() == 20


def test_module_argument_nesting_and_disabled(pp):
    built = _Model()
    pp.Init(module=built)  # a model built outside the context, partitioned at once
    assert all(p.numel() == 0 for p in built.parameters())
    with pp.Init(enabled=False):
        plain = nn.Linear(2, 2)
    assert plain.weight.numel() == 4 and not pp.is_zero_param(plain.weight)
    with pp.Init(dtype=torch.float):
        with pp.Init(dtype=torch.float):  # nested, as transformers nests it
            inner = nn.Linear(2, 2)
        outer = nn.Linear(2, 2)
    assert inner.weight.numel() == outer.weight.numel() == 0
    after = nn.Linear(2, 2)
    assert after.weight.numel() == 4  # the constructors are the classes' own again


def test_a_failed_construction_restores_the_constructors(pp):
    original = nn.Linear.__init__
    with pytest.raises(RuntimeError, match="boom"):
        with pp.Init(dtype=torch.float):
            _Model()
            raise RuntimeError("boom")
    assert nn.Linear.__init__ is original and nn.Linear(2, 2).weight.numel() == 4


def test_classes_defined_inside_the_context_are_partitioned_too(pp):
    with pp.Init(dtype=torch.float):
        class Late(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(3))

        late = Late()
    assert late.w.numel() == 0 and torch.equal(_whole(pp, late.w), torch.ones(3))
    assert Late().w.numel() == 3


def test_remote_device_keeps_partitions_on_the_cpu(pp):
    with pp.Init(remote_device="cpu", pin_memory=True):
        layer = nn.Linear(2, 2)
    assert layer.weight.ds_tensor.device.type == "cpu"


def test_a_whole_model_is_made_of_the_partitions_one_parameter_at_a_time(pp):
    from torsh.engine.zero import construction

    torch.manual_seed(0)
    reference = _Model()
    torch.manual_seed(0)
    with pp.Init(dtype=torch.float):
        model = _Model()
    assert construction.materialize(model) == 7
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), name
        assert not construction.is_partitioned(p)


ORIGINAL_NEW = torch.Tensor.__new__


def test_tensors_made_inside_are_built_in_deepspeeds_parameter_dtype(pp, monkeypatch):
    """DeepSpeed's rule: ``dtype`` if given, else the config's bf16/fp16 (fp32 when it enables neither), else fp16
    where the accelerator supports it, bf16 otherwise; ``tensor_overrides`` without the dtype leaves fp32. Weights
    are drawn in that dtype (not drawn in fp32 and cast), and the constructors are torch's again afterwards."""
    from torsh.compat.deepspeed.accelerator import get_accelerator

    def built(**kwargs):
        torch.manual_seed(0)
        with pp.Init(**kwargs):
            layer = nn.Linear(4, 4)
            made = torch.zeros(2), torch.empty(2), torch.tensor([1.0]), torch.tensor([1]), torch.Tensor(2)
        return layer, made

    layer, made = built(config_dict_or_path={"train_batch_size": 2, "bf16": {"enabled": True}})
    assert layer.weight.ds_tensor.dtype == torch.bfloat16 and layer.weight.dtype == torch.bfloat16
    assert [t.dtype for t in made] == [torch.bfloat16] * 3 + [torch.int64, torch.bfloat16]
    torch.manual_seed(0)
    drawn = torch.empty(4, 4, dtype=torch.bfloat16)
    nn.init.kaiming_uniform_(drawn, a=5 ** 0.5)  # what Linear draws, in bf16
    assert torch.equal(_whole(pp, layer.weight), drawn)
    assert torch.empty(2).dtype == torch.float32 and torch.Tensor.__new__ is ORIGINAL_NEW  # restored on exit
    assert built(config_dict_or_path={"train_batch_size": 2, "fp16": {"enabled": True}})[0].weight.dtype == torch.half
    assert built(config_dict_or_path={"train_batch_size": 2})[0].weight.dtype == torch.float32
    assert built(dtype=torch.half)[0].weight.dtype == torch.half
    assert built(config_dict_or_path={"train_batch_size": 2, "bf16": {"enabled": "true"}})[0].weight.dtype == \
        torch.bfloat16  # read as DeepSpeed's config model reads a bool
    assert built(dtype=torch.bfloat16, tensor_overrides=[])[0].weight.dtype == torch.float32
    accelerator = get_accelerator()
    expected = (torch.half if accelerator.is_fp16_supported() else torch.bfloat16)
    assert built()[0].weight.dtype == expected
    monkeypatch.setattr(type(accelerator), "is_fp16_supported", lambda self: True)
    assert built()[0].weight.dtype == torch.half
    with pytest.raises(ValueError, match="torch.half, torch.bfloat16 or torch.float"):
        pp.Init(dtype=torch.float64)
    with pytest.raises(RuntimeError, match="enables both bf16 and fp16"):
        pp.Init(config_dict_or_path={"train_batch_size": 2, "bf16": {"enabled": True}, "fp16": {"enabled": True}})


def test_transformers_keeps_arange_out_of_the_dtype_change(pp, monkeypatch):
    """transformers swaps ``zero_wrapper_for_fp_tensor_constructor`` around ``zero.Init`` so that ``torch.arange``
    (rotary embedding buffers) keeps its dtype; the swap is looked up when the context is entered."""
    original = pp.zero_wrapper_for_fp_tensor_constructor

    def without_arange(fn, target_fp_dtype=None, target_device=None):
        return fn if fn is pp._orig_torch_arange else original(fn, target_fp_dtype, target_device)

    monkeypatch.setattr(pp, "zero_wrapper_for_fp_tensor_constructor", without_arange)
    with pp.Init(dtype=torch.bfloat16):
        assert torch.arange(3, dtype=torch.float32).dtype == torch.float32
        assert torch.ones(3).dtype == torch.bfloat16
    assert torch.arange is pp._orig_torch_arange and torch.ones is pp._orig_torch_ones


def test_the_engine_is_set_up_with_torchs_own_constructors_inside_the_context(pp):
    """``deepspeed.initialize`` inside ``zero.Init`` (DeepSpeed's own test does it): modules torch imports lazily
    during set-up script functions with ``torch.jit`` and need the real constructors; the context's come back
    after. torch._dynamo accepts the replaced ``Tensor.__new__`` when it is first imported inside the context (it
    checks the one it finds against its stand-in)."""
    with pp.Init(dtype=torch.bfloat16):
        with pp.tensor_overrides_suspended():
            assert torch.empty(2).dtype == torch.float32 and torch.zeros is pp._orig_torch_zeros

            @torch.jit.script
            def scripted(x: torch.Tensor) -> torch.Tensor:
                return x + torch.zeros(1)

            assert scripted(torch.ones(1)).item() == 1.0
        assert torch.empty(2).dtype == torch.bfloat16
    with pp.tensor_overrides_suspended():  # outside any context: nothing to suspend
        assert torch.empty(2).dtype == torch.float32


def test_a_context_that_fails_to_open_leaves_torch_as_it_was(pp, monkeypatch):
    """Everything ``zero.Init`` patches is put back when opening it fails part-way, and a later context works."""
    before = (nn.Module.apply, nn.Module.__dict__.get("__init_subclass__"), nn.Linear.__init__, torch.empty,
              torch.Tensor.__new__)  # fmt: skip

    def fail(self):
        raise RuntimeError("no device")

    with monkeypatch.context() as patched:
        patched.setattr(pp._Constructors, "install", fail)
        with pytest.raises(RuntimeError, match="no device"):
            with pp.Init(dtype=torch.bfloat16):
                pass
        assert (nn.Module.apply, nn.Module.__dict__.get("__init_subclass__"), nn.Linear.__init__, torch.empty,
                torch.Tensor.__new__) == before  # fmt: skip
    with pp.Init(dtype=torch.bfloat16):
        assert torch.empty(1).dtype == torch.bfloat16
    assert torch.empty(1).dtype == torch.float32


def test_constructors_replaced_by_someone_else_are_put_back_and_the_legacy_constructor_works(pp, monkeypatch):
    """What was installed when the context opened (another library's wrapper) is what comes back; the legacy
    ``torch.Tensor(...)`` takes sizes or data inside, as outside. The outermost context decides (as DeepSpeed's)."""
    theirs = lambda *a, **k: pp._orig_torch_zeros(*a, **k)  # noqa: E731
    monkeypatch.setattr(torch, "zeros", theirs)
    with pp.Init(dtype=torch.bfloat16):
        assert torch.zeros(2).dtype == torch.bfloat16
        assert torch.Tensor([1.0, 2.0]).tolist() == [1.0, 2.0] and torch.Tensor([1.0]).dtype == torch.bfloat16
        assert torch.Tensor(2, 3).shape == (2, 3)
        with pp.Init(dtype=torch.float, tensor_overrides=[]):
            assert torch.zeros(1).dtype == torch.bfloat16
    assert torch.zeros is theirs and torch.Tensor.__new__ is ORIGINAL_NEW


def test_torch_dynamo_first_imported_inside_the_context_accepts_it(tmp_path):
    """In a fresh interpreter (torch._dynamo not imported yet), importing it inside ``zero.Init`` works: DDP does
    that lazily when a script calls ``initialize`` inside the context."""
    import subprocess
    import sys

    script = tmp_path / "dynamo_inside.py"
    script.write_text(
        "import sys, torch, torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, world_size=1)\n"
        "from torsh.compat.deepspeed.runtime.zero import partition_parameters as pp\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "with pp.Init(dtype=torch.bfloat16, mem_efficient_linear=False):\n"
        "    import torch._dynamo\n"
        "    assert torch.Tensor(2).dtype == torch.bfloat16\n"
        "dist.destroy_process_group()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
