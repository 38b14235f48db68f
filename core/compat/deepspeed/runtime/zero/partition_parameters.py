"""``deepspeed.zero.Init`` and ``deepspeed.zero.GatheredParameters`` over the torsh engine's sharding.

Inside ``zero.Init`` each module's parameters are partitioned when its constructor returns, as DeepSpeed does
(:mod:`torsh.engine.zero.construction`): broadcast from the first rank, each rank keeps its partition as
``param.ds_tensor`` and ``param.data`` is empty, so the whole model never exists on one rank. ``Module.apply``
inside the context gathers a module's parameters around the function and partitions the first rank's result, and
``torch.nn.utils.skip_init`` modules are partitioned once ``to_empty`` gives them storage, as in DeepSpeed.
``initialize`` turns the partitions into FSDP2 shards (stage 3) or whole parameters (the other stages).

After ``initialize`` at stages 2/3 the parameters are DTensor shards carrying DeepSpeed's ``ds_id``/``ds_status``
(:mod:`torsh.engine.zero.params`): ``GatheredParameters`` puts full parameters, in DeepSpeed's parameter dtype, on
their modules inside the context, makes ``param.data`` the whole value (what DeepSpeed scripts read there) and,
with a ``modifier_rank``, writes that rank's values back into every rank's shard on exit. Plain (DDP) parameters
are left alone, as DeepSpeed leaves parameters ZeRO did not partition.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterable
from enum import Enum

import torch
import torch.distributed as dist
from torch import nn

from torsh.engine.distributed import local_device
from torsh.engine.zero import construction
from torsh.engine.zero.params import COMPUTE_DTYPE, ZeroParamStatus, write_shown

from .linear import zero3_linear_wrap
from .utils import is_zero_param  # noqa: F401  (DeepSpeed's name here too)

_GATHERED = "_torsh_gathered"


class ZeroParamType(Enum):
    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


# The torch constructors as they were before any ``zero.Init``. While the outermost context is entered they are
# replaced by :func:`zero_wrapper_for_fp_tensor_constructor` around these (looked up by name when the context is
# entered: transformers swaps it for one of its own, ``prevent_arange_dtype_change``, and compares the constructor
# with ``_orig_torch_arange``).
_orig_torch_tensor, _orig_torch_empty, _orig_torch_zeros, _orig_torch_ones = (torch.tensor, torch.empty, torch.zeros,
                                                                              torch.ones)  # fmt: skip
_orig_torch_full, _orig_torch_arange, _orig_torch_eye, _orig_torch_randn = (torch.full, torch.arange, torch.eye,
                                                                            torch.randn)  # fmt: skip


def _cast_floating(t: torch.Tensor, dtype) -> torch.Tensor:
    """``t`` with its floating data in ``dtype`` (the same tensor object: a leaf that requires grad stays one)."""
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t.data = t.data.to(dtype)
    return t


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device):
    """The tensor constructor ``fn`` as ``zero.Init`` installs it: on ``target_device`` unless the call names a
    device, floating results in ``target_fp_dtype`` (either None: left alone). DeepSpeed's name and arguments;
    transformers replaces this function around ``zero.Init`` to keep ``torch.arange``'s dtype."""

    def constructor(*args, **kwargs):
        if target_device is not None and kwargs.get("device") is None:
            kwargs["device"] = target_device
        return _cast_floating(fn(*args, **kwargs), target_fp_dtype)

    return constructor


class DeepSpeedTensorOverride(Enum):
    """What ``zero.Init`` changes in the tensors made inside it (``tensor_overrides``): their floating dtype, their
    device, or both (the default)."""

    dtype = 1
    device = 2


DEFAULT_TENSOR_OVERRIDES = [DeepSpeedTensorOverride.dtype, DeepSpeedTensorOverride.device]
_CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")


class _Constructors:
    """torch's tensor constructors (and the legacy ``torch.Tensor(...)``) while a ``zero.Init`` is open: floating
    tensors come out in the context's parameter dtype, on its device, so a layer's weights are drawn as DeepSpeed
    draws them (drawing in fp32 and casting later gives other values). Remembers what it replaced, and puts exactly
    that back."""

    def __init__(self, dtype, device) -> None:
        self.dtype, self.device = dtype, device
        self.replaced: dict[str, object] = {}

    def install(self) -> None:
        self.replaced = {name: getattr(torch, name) for name in _CONSTRUCTORS}
        self.replaced["Tensor.__new__"] = torch.Tensor.__new__
        wrap = globals()["zero_wrapper_for_fp_tensor_constructor"]  # looked up now: transformers may swap it
        for name in _CONSTRUCTORS:
            setattr(torch, name, wrap(self.replaced[name], target_fp_dtype=self.dtype, target_device=self.device))
        torch.Tensor.__new__ = self._legacy_new(self.replaced["Tensor.__new__"])

    def _legacy_new(self, original):
        dtype, device = self.dtype, self.device

        # A signature of (*args, **kwargs), as torch's own: torch._dynamo, when first imported (DDP imports it lazily,
        # maybe inside the context), checks the Tensor.__new__ it finds against its stand-in and accepts that one
        def __new__(*args, **kwargs):  # every legacy form (sizes, data, a tensor), then moved and cast
            made = original(*args, **kwargs)
            if device is not None and made.device != torch.device(device):
                made = made.to(device)
            return _cast_floating(made, dtype)

        return __new__

    def restore(self) -> None:
        if not self.replaced:
            return
        torch.Tensor.__new__ = self.replaced.pop("Tensor.__new__")
        for name, value in self.replaced.items():
            setattr(torch, name, value)
        self.replaced = {}

    @contextlib.contextmanager
    def suspended(self):
        """The replaced constructors inside the block; this context's after it."""
        if not self.replaced:
            yield
            return
        current = {name: getattr(torch, name) for name in _CONSTRUCTORS}
        current_new = torch.Tensor.__new__
        torch.Tensor.__new__ = self.replaced["Tensor.__new__"]
        for name in _CONSTRUCTORS:
            setattr(torch, name, self.replaced[name])
        try:
            yield
        finally:
            torch.Tensor.__new__ = current_new
            for name, value in current.items():
                setattr(torch, name, value)


def tensor_overrides_suspended():
    """torch's own constructors inside the block, even within an open ``zero.Init`` (the engine's set-up when a
    script calls ``initialize`` inside the context: modules that torch imports lazily there script functions with
    ``torch.jit``, which needs the real constructors); the context's come back after."""
    installed = _patched.get("constructors")
    return installed.suspended() if installed is not None else contextlib.nullcontext()


_TRUE = (True, 1, "true", "True", "TRUE", "1", "yes", "on")


def _enables(section) -> bool:
    """Whether a config section turns its mode on (``enabled`` read as DeepSpeed's config model reads a bool)."""
    return isinstance(section, dict) and section.get("enabled", False) in _TRUE


def _init_dtype(ds_config, dtype) -> torch.dtype:
    """The floating dtype ``zero.Init`` builds parameters in, by DeepSpeed's rule: ``dtype`` when given; else the
    config's mode (bf16 or fp16; fp32 when it enables neither); with no config either, fp16 where the accelerator
    supports it, else bf16."""
    if dtype is None and ds_config is not None:
        bf16 = _enables(ds_config.get("bf16")) or _enables(ds_config.get("bfloat16"))
        fp16 = _enables(ds_config.get("fp16"))
        if bf16 and fp16:
            raise RuntimeError("zero.Init: the config enables both bf16 and fp16; a model has one parameter dtype, "
                               "so enable only one of them")  # fmt: skip
        return torch.bfloat16 if bf16 else torch.half if fp16 else torch.float
    if dtype is None:
        from ...accelerator import get_accelerator

        accelerator = get_accelerator()
        dtype = torch.half if accelerator.is_fp16_supported() else (
            torch.bfloat16 if accelerator.is_bf16_supported() else torch.float)  # fmt: skip
    if dtype not in (torch.half, torch.bfloat16, torch.float):
        raise ValueError(f"zero.Init(dtype={dtype}): the parameter dtype must be torch.half, torch.bfloat16 or "
                         "torch.float")  # fmt: skip
    return dtype


_init_lock = threading.Lock()
_active: list = []  # the enabled Init contexts entered, innermost last (their partition settings apply)
_patched: dict = {}  # class -> its own __init__, while replaced; and the Module methods replaced


def _all_module_classes() -> list[type]:
    """Every subclass of ``nn.Module`` defined so far (transformers defines thousands), each once."""
    found: dict[type, None] = {}
    todo = [nn.Module]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found[sub] = None
                todo.append(sub)
    return list(found)


def _partition_module(module: nn.Module, *, recurse: bool = False) -> None:
    """Partition ``module``'s parameters (its own; every one with ``recurse``) with the innermost context's
    settings: its constructor has returned."""
    if not _active:
        return
    context = _active[-1]
    for p in module.parameters(recurse=recurse):
        if p.is_meta or construction.is_partitioned(p):
            continue
        construction.partition(p, group=context.group, remote_device=context.remote_device,
                               pin_memory=context.pin_memory)  # fmt: skip


def _partition_after(init):
    """``init`` (a module class's own ``__init__``) followed by the partition of the module's parameters, once per
    module: after the constructor of its most derived class returns (its base classes' constructors, run inside,
    leave the parameters to it). A module made on the meta device (``torch.nn.utils.skip_init``) is partitioned
    when ``to_empty`` gives it storage."""

    @functools.wraps(init)
    def wrapper(module, *args, **kwargs):
        outermost = "_ds_child_entered" not in module.__dict__
        if outermost:
            module.__dict__["_ds_child_entered"] = True
        try:
            init(module, *args, **kwargs)
        finally:
            if outermost:
                module.__dict__.pop("_ds_child_entered", None)
        if outermost:
            if str(kwargs.get("device")) == "meta":
                _partition_after_to_empty(module)
            else:
                _partition_module(module)

    wrapper._torsh_partition_after = True
    return wrapper


def _partition_after_to_empty(module: nn.Module) -> None:
    original = module.to_empty

    def to_empty(*args, **kwargs):
        del module.to_empty  # the class's own again
        result = original(*args, **kwargs)
        _partition_module(module, recurse=True)
        return result

    module.to_empty = to_empty


def _apply_with_gather(apply):
    """``Module.apply`` inside ``zero.Init`` (DeepSpeed's ``override_module_apply``): each module's partitioned
    parameters are gathered around the function, then the first rank's values are partitioned again, so that a
    parent's initialisation of its children's weights is kept, on every rank the same."""

    def wrapped_apply(self, fn):
        if getattr(fn, "_torsh_gathers", False):
            return apply(self, fn)

        def gathered(module):
            params = [p for p in module.parameters(recurse=False) if construction.is_partitioned(p)]
            for p in params:
                construction.show_whole(p)
            fn(module)
            for p in params:
                construction.repartition(p, written_by=p.__dict__[construction.PARTITIONED].source)

        gathered._torsh_gathers = True
        return apply(self, gathered)

    return wrapped_apply


def _patch() -> None:
    for cls in _all_module_classes():
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_torsh_partition_after", False):
            _patched[cls] = init
            cls.__init__ = _partition_after(init)
    _patched["__init_subclass__"] = nn.Module.__dict__.get("__init_subclass__")
    _patched["apply"] = nn.Module.apply

    def init_subclass(cls, **kwargs):
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_torsh_partition_after", False):
            _patched[cls] = init
            cls.__init__ = _partition_after(init)

    nn.Module.__init_subclass__ = classmethod(init_subclass)
    nn.Module.apply = _apply_with_gather(nn.Module.apply)


def _unpatch() -> None:
    """Put back what :func:`_patch` replaced (also after it stopped part-way)."""
    if "apply" in _patched:
        nn.Module.apply = _patched.pop("apply")
    if "__init_subclass__" in _patched:
        original = _patched.pop("__init_subclass__")
        if original is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = original
    for cls, init in _patched.items():
        if isinstance(cls, type):
            cls.__init__ = init
    _patched.clear()


def _contradicting_single_rank_pg_error(dp_world_size, explicit_process_group, env=None) -> str | None:
    """DeepSpeed's guard against a silent fallback to one rank: the message of the error ``zero.Init`` raises when
    the group it partitions over has one rank (``dp_world_size``) while the launcher's ``WORLD_SIZE`` (from
    ``env``, default the process environment) says several processes were started: a one-rank process group
    was started before ``zero.Init`` (``from_pretrained`` before ``deepspeed.init_distributed()``), and every rank
    would hold the whole model. None when there is no contradiction, when the caller passed the group explicitly
    (a one-rank group is then intended) or when ``WORLD_SIZE`` is not a number."""
    if dp_world_size != 1 or explicit_process_group is not None:
        return None
    if env is None:
        import os

        env = os.environ
    try:
        launched = int(env.get("WORLD_SIZE", "0") or "0")
    except (TypeError, ValueError):
        return None
    if launched <= 1:
        return None
    return (f"zero.Init resolved a process group of world_size=1, but the launcher environment reports "
            f"WORLD_SIZE={launched}. A single-rank process group was likely initialized before zero.Init ran "
            "(for example by from_pretrained before deepspeed.init_distributed()), so parameters would not be "
            "partitioned and every rank would hold the whole model. Call deepspeed.init_distributed() before "
            "building the model under zero.Init, or pass data_parallel_group= if a single-rank group is intended.")


class InsertPostInitMethodToModuleSubClasses:
    """The construction context :class:`Init` is (DeepSpeed's base class of it, by its name): while entered, each
    module's constructor is followed by the partition of its parameters, and, with ``mem_efficient_linear``,
    ``torch.nn.functional.linear`` becomes DeepSpeed's ZeRO-3 linear (:func:`enable_memory_efficient_linear`).
    Nested contexts patch once, with the outermost one's settings; the last one out restores the constructors."""

    def __init__(self, enabled=True, mem_efficient_linear=True, ds_config=None, dtype=None):
        self.enabled = enabled
        self.mem_efficient_linear = mem_efficient_linear
        self.dtype = _init_dtype(ds_config, dtype)
        if not hasattr(self, "tensor_overrides"):
            self.tensor_overrides = list(DEFAULT_TENSOR_OVERRIDES)

    def _enable_mem_efficient_linear(self) -> None:
        enable_memory_efficient_linear()

    def __enter__(self):
        if self.enabled:
            with _init_lock:
                if not _active:
                    self._patch_everything()
                _active.append(self)
        return self

    def _patch_everything(self) -> None:
        """The outermost context's patches, all or none (a failure part-way puts back what was done)."""
        overrides = self.tensor_overrides or ()
        constructors = _Constructors(self.dtype if DeepSpeedTensorOverride.dtype in overrides else None,
                                     local_device() if DeepSpeedTensorOverride.device in overrides else None)
        try:
            _patch()
            if overrides:
                constructors.install()
                _patched["constructors"] = constructors
            if self.mem_efficient_linear:
                self._enable_mem_efficient_linear()
        except BaseException:
            _patched.pop("constructors", None)
            constructors.restore()
            _unpatch()
            raise

    def __exit__(self, *exc):
        if self.enabled:
            with _init_lock:
                _active.pop()
                if not _active:
                    constructors = _patched.pop("constructors", None)
                    if constructors is not None:
                        constructors.restore()
                    _unpatch()
        return False


def _note_quantization(**switches: bool) -> None:
    """ZeRO++ weight quantisation asked of the context: the engine all-gathers the weights unquantized, as the
    DeepSpeed reader's note on the config key of the same name says (logged once, on rank 0)."""
    from torsh.adapters._deepspeed_rules import ZEROPP_QUANTIZATION

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    for name, on in switches.items():
        if on:
            logging.getLogger("torsh.engine").warning("deepspeed.zero.Init(%s=True): approximate (%s)", name,
                                                      ZEROPP_QUANTIZATION[f"zero_optimization.{name}"])


def enable_memory_efficient_linear() -> None:
    """``torch.nn.functional.linear`` becomes :func:`.linear.zero3_linear_wrap` (the same values; DeepSpeed's
    ZeRO-3 autograd function), as DeepSpeed installs it when a ZeRO-3 context or engine with
    ``memory_efficient_linear`` (its default) starts, and it stays so (DeepSpeed never puts it back). The function
    found there the first time is kept as ``InsertPostInitMethodToModuleSubClasses.linear_bk``; it is replaced
    only while it is still that function, so a wrapper another library put around the ZeRO-3 one stays."""
    import torch.nn.functional as F

    if not hasattr(InsertPostInitMethodToModuleSubClasses, "linear_bk"):
        InsertPostInitMethodToModuleSubClasses.linear_bk = F.linear
    if F.linear is InsertPostInitMethodToModuleSubClasses.linear_bk:
        F.linear = zero3_linear_wrap


def _memory_efficient_linear(config_dict_or_path, default: bool) -> bool:
    """``zero_optimization.memory_efficient_linear`` of the config (which then decides, as in DeepSpeed), else
    ``default`` (the ``mem_efficient_linear`` argument)."""
    if config_dict_or_path is None:
        return default
    from ..config import _as_dict

    config = _as_dict(config_dict_or_path) or {}
    zero = config.get("zero_optimization")
    return bool(zero.get("memory_efficient_linear", True)) if isinstance(zero, dict) else True


def _refuse_quantized_initialization(config_dict_or_path) -> None:
    """DeepSpeed's ``zero.Init`` quantizes the weights of the layers it builds when the config sets
    ``weight_quantization.quantized_initialization``; torsh does not, and values that differ from DeepSpeed's are not
    given silently."""
    from ..config import _as_dict
    from ..._unsupported import NotSupportedByTorsh, message

    config = _as_dict(config_dict_or_path) or {}
    quantization = config.get("weight_quantization")
    if isinstance(quantization, dict) and quantization.get("quantized_initialization"):
        raise NotSupportedByTorsh(message(
            "zero.Init with weight_quantization.quantized_initialization",
            "the layers' weights are not quantized at construction; remove the weight_quantization section (the "
            "weights are then built in full precision)"))  # fmt: skip


class Init(InsertPostInitMethodToModuleSubClasses):
    """DeepSpeed's ZeRO-3 construction context: each module's parameters are partitioned when its constructor
    returns (:mod:`torsh.engine.zero.construction`), so no rank holds the whole model.

    Every argument of DeepSpeed 0.19.8 is accepted. As DeepSpeed's, it starts ``torch.distributed``
    (:func:`deepspeed.init_distributed`) when it is not started yet, and ``config_dict_or_path`` is checked as
    DeepSpeed checks it. ``module=`` partitions a model built outside the context at once; ``data_parallel_group``
    (or ``sequence_data_parallel_group``) is the group the parameters are partitioned over (default: every rank);
    ``remote_device="cpu"`` keeps the partitions on the CPU (pinned with ``pin_memory`` on a CUDA machine);
    ``enabled=False`` changes nothing. ``mem_efficient_linear`` (the config's
    ``zero_optimization.memory_efficient_linear`` when a config is given) installs DeepSpeed's ZeRO-3
    ``F.linear`` when the context is entered or ``module=`` is given (:func:`enable_memory_efficient_linear`).
    Floating tensors made inside the context are built in DeepSpeed's parameter dtype (``dtype``, else the config's
    bf16/fp16, fp32 when it enables neither; with neither, fp16 where the accelerator supports it, else bf16) on
    this process's device, so weights are drawn as DeepSpeed draws them (``tensor_overrides`` chooses which of the
    two is changed, as in DeepSpeed). The ZeRO++ quantisation arguments are accepted and logged as approximate
    (the weights are all-gathered unquantized);
    ``weight_quantization.quantized_initialization`` in the config is refused.
    Usable as a context manager or a decorator.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None, param_swapper=None,
                 tensor_overrides=None):  # fmt: skip
        if config is not None:
            config_dict_or_path = config
        ds_config = None
        if config_dict_or_path is not None:
            from ..config import _as_dict, check_gradient_allreduce_op

            check_gradient_allreduce_op(config_dict_or_path)  # DeepSpeed reads (and checks) the config here
            _refuse_quantized_initialization(config_dict_or_path)
            ds_config = _as_dict(config_dict_or_path) or {}
        self.tensor_overrides = list(DEFAULT_TENSOR_OVERRIDES if tensor_overrides is None else tensor_overrides)
        super().__init__(enabled=enabled, mem_efficient_linear=_memory_efficient_linear(config_dict_or_path,
                                                                                        mem_efficient_linear),
                         ds_config=ds_config, dtype=dtype)  # fmt: skip
        if not dist.is_initialized():
            from ...comm import init_distributed

            init_distributed()
        _note_quantization(zero_quantized_weights=zero_quantized_weights,
                           zero_quantized_nontrainable_weights=zero_quantized_nontrainable_weights)
        if module is not None and enabled and self.mem_efficient_linear:
            self._enable_mem_efficient_linear()
        if sequence_data_parallel_group is not None and data_parallel_group is not None:
            raise ValueError("Both 'data_parallel_group' and 'sequence_data_parallel_group' were specified. Please "
                             "provide only one of these arguments.")  # fmt: skip
        explicit = data_parallel_group if data_parallel_group is not None else sequence_data_parallel_group
        problem = dist.is_initialized() and _contradicting_single_rank_pg_error(dist.get_world_size(explicit),
                                                                                  explicit)  # fmt: skip
        if problem:
            raise RuntimeError(problem)
        self.group = explicit
        self.remote_device = _remote_device(remote_device)
        self.pin_memory = bool(pin_memory)
        if module is not None and enabled:  # DeepSpeed partitions a built module at once
            _active.append(self)
            try:
                _partition_module(module, recurse=True)
            finally:
                _active.pop()

    def __call__(self, fn):
        def wrapped(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return wrapped


def _remote_device(remote_device) -> torch.device | None:
    """Where partitions are kept: ``"cpu"`` (or ``"nvme"``, kept on the CPU: torsh has no NVMe swapper), else with
    the parameter (None)."""
    if remote_device is None:
        return None
    name = getattr(remote_device, "value", remote_device)
    return torch.device("cpu") if str(name) in ("cpu", "nvme") else torch.device(str(name))


def _as_list(params) -> list:
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, Iterable):
        unique = {}
        for p in params:
            if isinstance(p, torch.Tensor):
                unique.setdefault(id(p), p)
        return list(unique.values())
    return []  # DeepSpeed silently ignores anything else


def _is_sharded(p) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _owners(params: list, fwd_module) -> dict[int, list[tuple[nn.Module, str]]]:
    """For each sharded parameter, every (module, attribute name) that holds it (tied weights: several)."""
    from torch.distributed import _composable_state  # fully_shard registers each module it shards here

    roots = list(_composable_state._module_state_mapping.keys())
    if fwd_module is not None:
        roots.append(fwd_module)
    wanted = {id(p) for p in params}
    found: dict[int, list[tuple[nn.Module, str]]] = {i: [] for i in wanted}
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for name, q in module._parameters.items():
                if q is not None and id(q) in wanted:
                    found[id(q)].append((module, name))
    missing = [tuple(p.shape) for p in params if not found[id(p)]]
    if missing:
        raise RuntimeError(f"deepspeed.zero.GatheredParameters: sharded parameters of shapes {missing} belong to "
                           "no sharded module torsh knows; pass fwd_module=<the module holding them>")  # fmt: skip
    return found


class GatheredParameters:
    """Full parameters inside the context (DeepSpeed's ``GatheredParameters``, same arguments).

    Under FSDP2 (stages 2/3 after ``initialize``) each sharded parameter is gathered and a full ``nn.Parameter``
    is put on its modules for the duration of the context (read ``module.weight``, ``module.state_dict()``;
    do not run the model's forward inside). It is in DeepSpeed's parameter dtype, the compute dtype (bf16 or
    fp16 under mixed precision, where torsh's shards hold the fp32 masters), so a value written there is rounded
    as DeepSpeed's parameter stores it. On exit, with ``modifier_rank`` set, that rank's full values are
    broadcast and written into every rank's shard: the elements that changed take the written value, the others
    keep the fp32 master's (what a rank changed otherwise is discarded, as in DeepSpeed). Parameters partitioned
    by :class:`Init` and not yet taken by ``initialize`` are gathered whole inside the context and partitioned
    again on exit, from ``modifier_rank``'s values when it is set (else what was written is dropped). Other
    parameters (DDP, stages 0/1): a no-op. Every rank must enter the context, as in DeepSpeed.
    """

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        params = _as_list(params) if enabled else []
        self._sharded = [p for p in params if _is_sharded(p) and _GATHERED not in p.__dict__]  # not already gathered
        self._partitioned = [p for p in params if construction.is_partitioned(p)
                             and p.ds_status is ZeroParamStatus.NOT_AVAILABLE]  # not already gathered
        self._full: list[nn.Parameter] = []
        self._owners: dict[int, list[tuple[nn.Module, str]]] = {}

    @torch.no_grad()
    def __enter__(self):
        for p in self._partitioned:
            construction.show_whole(p)
        if not self._sharded:
            return None
        self._owners = _owners(self._sharded, self.fwd_module)
        for p in self._sharded:
            whole = p.full_tensor().detach().to(_shown_dtype(p), copy=True)
            full = nn.Parameter(whole, requires_grad=p.requires_grad)
            self._full.append(full)
            for module, name in self._owners[id(p)]:
                module._parameters[name] = full
            _show_whole(p, full, writable=self.modifier_rank is not None)
        return None

    @torch.no_grad()
    def __exit__(self, *exc):
        written = list(zip(self._sharded, self._full))
        for p in self._sharded:  # the shards back on their modules before anything is written into them
            for module, name in self._owners.get(id(p), ()):
                module._parameters[name] = p
            _show_shard(p)
        self._full = []
        if self.modifier_rank is not None:
            self._write_back(written)
        for p in self._partitioned:
            construction.repartition(p, written_by=self.modifier_rank)
        return False

    def _write_back(self, written: list) -> None:
        for p, full in written:
            value = full.data.contiguous()
            dist.broadcast(value, src=self.modifier_rank)
            write_shown(p, value)


class _WholeData:
    """Mixed into a sharded parameter's class inside :class:`GatheredParameters`: ``param.data``,
    ``param.detach()`` and ``param.dtype`` are those of its whole value, as on a gathered DeepSpeed parameter
    (``with GatheredParameters([p]): p.data.cpu()``)."""

    @property
    def data(self):
        return self.__dict__[_GATHERED][0]

    @data.setter
    def data(self, value):  # kept, and written back on exit when the context has a modifier_rank
        full = self.__dict__[_GATHERED][1]
        if full is not None:
            full.data = value.to(full.dtype)
            value = full.data
        self.__dict__[_GATHERED] = (value, full)

    @property
    def dtype(self):  # DeepSpeed's parameter dtype (the compute dtype), not the fp32 shard's
        return self.__dict__[_GATHERED][0].dtype

    def detach(self):  # the whole value, as a gathered DeepSpeed parameter's (``p.detach().cpu()`` in the context)
        return self.__dict__[_GATHERED][0].detach()


_whole_types: dict[type, type] = {}


def _shown_dtype(p) -> torch.dtype:
    """The dtype a gathered parameter has under DeepSpeed: its compute dtype (DeepSpeed casts the module to it
    and keeps the fp32 masters in its optimizer), where torsh keeps fp32 shards on the module."""
    return getattr(p, COMPUTE_DTYPE, None) or p.dtype


def _show_whole(p, full: nn.Parameter, *, writable: bool) -> None:
    """``p.data`` becomes ``full``'s value (whole, in the compute dtype: what the modules hold in the context);
    with ``writable`` a value assigned to ``p.data`` goes to ``full`` too, to be written back on exit."""
    base = type(p)
    p.__dict__[_GATHERED] = (full.data, full if writable else None)
    p.__class__ = _whole_types.setdefault(base, type(f"Gathered{base.__name__}", (_WholeData, base), {}))
    if hasattr(p, "ds_status"):
        p.ds_status = ZeroParamStatus.AVAILABLE


def _show_shard(p) -> None:
    if _GATHERED in p.__dict__:
        p.__class__ = type(p).__bases__[1]  # (_WholeData, the class it had)
        del p.__dict__[_GATHERED]
    if hasattr(p, "ds_status"):
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def register_external_parameter(module, parameter) -> None:
    """DeepSpeed's hint that ``module``'s forward uses another module's parameter (a tied projection): kept where
    DeepSpeed keeps it (``module._external_params``), and read by the engine's unit planning at ZeRO-3 as a tie, so
    that ``module`` and the parameter's owner are sharded in one FSDP2 unit (the parameter is whole in both
    forwards)."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    if not hasattr(module, "_external_params"):
        module._external_params = {}
    module._external_params[id(parameter)] = parameter


def unregister_external_parameter(module, parameter) -> None:
    """Forget a :func:`register_external_parameter` (before ``initialize``: the units are planned there)."""
    if not isinstance(parameter, nn.Parameter):
        raise RuntimeError("Parameter is not a torch.nn.Parameter")
    if id(parameter) not in getattr(module, "_external_params", {}):
        raise RuntimeError("Parameter is not a registered external parameter of module.")
    del module._external_params[id(parameter)]


#: The shape DeepSpeed gives ``param.data`` of a partitioned parameter outside ``GatheredParameters`` (its data is
#: freed to an empty tensor; the partition is ``param.ds_tensor``).
partitioned_param_data_shape = [0]


class MultipleAllGatherHandles:
    """Several all-gather handles waited on as one (DeepSpeed's, same constructor and ``wait``): ``wait`` calls
    each handle's ``wait``, passing ``handle_dependency`` by keyword, in order. torsh's own gathers of partitioned
    parameters (``param.all_gather()``, :class:`GatheredParameters`) complete before they return, so a handle
    made of them has nothing left to wait for; the class serves code that groups handles of its own."""

    def __init__(self, handles):
        self.handles = handles

    def wait(self, handle_dependency=True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)
