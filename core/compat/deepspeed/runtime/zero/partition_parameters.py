"""``deepspeed.zero.Init`` and ``deepspeed.zero.GatheredParameters`` over the torsh engine's sharding.

torsh shards at ``initialize`` (FSDP2 at stages 2/3), not while the model is built, so ``zero.Init`` builds the
model normally (full parameters on every rank); it only marks the parameters it saw created, so that
``GatheredParameters(..., modifier_rank=r)`` on them broadcasts rank ``r``'s values, as DeepSpeed's partitioned
parameters do. After ``initialize`` at stages 2/3 the parameters are DTensor shards carrying DeepSpeed's
``ds_id``/``ds_status`` (:mod:`torsh.engine.zero_params`): ``GatheredParameters`` puts full parameters on their
modules inside the context, makes ``param.data`` the whole value (what DeepSpeed scripts read there) and, with a
``modifier_rank``, writes that rank's values back into every rank's shard on exit. Plain (DDP) parameters are
left alone, as DeepSpeed leaves parameters ZeRO did not partition.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from enum import Enum

import torch
import torch.distributed as dist
from torch import nn

from torsh.engine.zero_params import COMPUTE_DTYPE, ZeroParamStatus, write_whole

_ZERO_INIT_MARK = "_torsh_zero_init"
_GATHERED = "_torsh_gathered"


class ZeroParamType(Enum):
    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


# The torch constructors as they were before any ``zero.Init``, and DeepSpeed's wrapper for them. torsh's ``Init``
# does not wrap constructors (the model is built normally and sharded at ``initialize``), but transformers swaps
# the wrapper for one of its own around ``zero.Init`` (``prevent_arange_dtype_change``, every ``from_pretrained``
# at ZeRO-3) and compares the constructor with ``_orig_torch_arange``.
_orig_torch_tensor, _orig_torch_empty, _orig_torch_zeros, _orig_torch_ones = (torch.tensor, torch.empty, torch.zeros,
                                                                              torch.ones)  # fmt: skip
_orig_torch_full, _orig_torch_arange, _orig_torch_eye, _orig_torch_randn = (torch.full, torch.arange, torch.eye,
                                                                            torch.randn)  # fmt: skip


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device):
    """``fn`` making its tensors on ``target_device`` (when no device is given) and floating ones in
    ``target_fp_dtype`` (DeepSpeed's signature and behaviour)."""

    def wrapped_fn(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped_fn


_init_lock = threading.Lock()
_init_depth = 0
_original_register_parameter = nn.Module.register_parameter


def _marking_register_parameter(self, name, param):
    if param is not None:
        setattr(param, _ZERO_INIT_MARK, True)
    return _original_register_parameter(self, name, param)


#: Said once per process, when a model was first built under ``zero.Init`` (the difference is documented here).
CONSTRUCTION_DIFFERENCE = (
    "deepspeed.zero.Init on torsh builds the model with whole parameters (they are sharded at initialize), so two "
    "things differ from DeepSpeed, whose parameters are already partitioned (empty) when the module's constructor "
    "returns: (1) initialisation applied after construction takes effect here and is lost under DeepSpeed - for a "
    "transformers model built from a config (from_config, --model_type), _init_weights initialises every weight, "
    "as it does without ZeRO-3, while DeepSpeed keeps the constructors' defaults (nn.Embedding N(0, 1)): the initial "
    "weights and the loss curve differ; (2) that initialisation (also of resized or missing weights after "
    "from_pretrained/resize_token_embeddings) draws from torch's random generator, which DeepSpeed's does not: "
    "reseed after building the model (transformers.set_seed) for the same dropout and data order in both")
_construction_warned = False


def _warn_construction_difference() -> None:
    global _construction_warned
    if _construction_warned:
        return
    _construction_warned = True
    import logging

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        logging.getLogger("torsh.compat").warning(CONSTRUCTION_DIFFERENCE)


class Init:
    """DeepSpeed's ZeRO-3 construction context: here the model is built normally and sharded at ``initialize``.

    Every argument of DeepSpeed 0.19.8 is accepted. ``module=`` (converting a built model) and ``enabled=False``
    change nothing. Usable as a context manager or a decorator.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None, param_swapper=None,
                 tensor_overrides=None):  # fmt: skip
        self.enabled = enabled
        if module is not None and enabled:
            for p in module.parameters():
                setattr(p, _ZERO_INIT_MARK, True)

    def __enter__(self):
        global _init_depth
        if self.enabled:
            with _init_lock:
                _init_depth += 1
                nn.Module.register_parameter = _marking_register_parameter
        return self

    def __exit__(self, *exc):
        global _init_depth
        if self.enabled:
            with _init_lock:
                _init_depth -= 1
                if _init_depth == 0:
                    nn.Module.register_parameter = _original_register_parameter
                    _warn_construction_difference()
        return False

    def __call__(self, fn):
        def wrapped(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return wrapped


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
    do not run the model's forward inside). On exit, with ``modifier_rank`` set, that rank's full values are
    broadcast and written into every rank's shard (what a rank changed otherwise is discarded, as in
    DeepSpeed). Parameters built under :class:`Init` and not yet sharded are broadcast from ``modifier_rank``
    on exit. Other parameters (DDP, stages 0/1): a no-op. Every rank must enter the context, as in DeepSpeed.
    """

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        params = _as_list(params) if enabled else []
        self._sharded = [p for p in params if _is_sharded(p) and _GATHERED not in p.__dict__]  # not already gathered
        self._built_in_init = [p for p in params if not _is_sharded(p) and getattr(p, _ZERO_INIT_MARK, False)]
        self._full: list[nn.Parameter] = []
        self._owners: dict[int, list[tuple[nn.Module, str]]] = {}

    @torch.no_grad()
    def __enter__(self):
        if not self._sharded:
            return None
        self._owners = _owners(self._sharded, self.fwd_module)
        for p in self._sharded:
            full = nn.Parameter(p.full_tensor().detach().clone(), requires_grad=p.requires_grad)
            self._full.append(full)
            for module, name in self._owners[id(p)]:
                module._parameters[name] = full
            _show_whole(p, full, writable=self.modifier_rank is not None)
        return None

    @torch.no_grad()
    def __exit__(self, *exc):
        try:
            if self._sharded and self.modifier_rank is not None:
                self._write_back()
            if self._built_in_init and self.modifier_rank is not None and _multi_process():
                for p in self._built_in_init:
                    dist.broadcast(p.data, src=self.modifier_rank)
        finally:
            for p in self._sharded:
                for module, name in self._owners.get(id(p), ()):
                    module._parameters[name] = p
                _show_shard(p)
            self._full = []
        return False

    def _write_back(self) -> None:
        for p, full in zip(self._sharded, self._full):
            dist.broadcast(full.data, src=self.modifier_rank)
            write_whole(p, full.data)


class _WholeData:
    """Mixed into a sharded parameter's class inside :class:`GatheredParameters`: ``param.data`` is its whole value,
    as on a gathered DeepSpeed parameter (``with GatheredParameters([p]): p.data.cpu()``)."""

    @property
    def data(self):
        return self.__dict__[_GATHERED][0]

    @data.setter
    def data(self, value):  # kept, and written back on exit when the context has a modifier_rank
        full = self.__dict__[_GATHERED][1]
        if full is not None:
            full.data = value.to(full.dtype)
        self.__dict__[_GATHERED] = (value, full)


_whole_types: dict[type, type] = {}


def _show_whole(p, full: nn.Parameter, *, writable: bool) -> None:
    """``p.data`` becomes ``full``'s value: the fp32 master itself when the context writes it back, else (a
    read) a copy in the dtype DeepSpeed's parameter has, the compute dtype."""
    dtype = getattr(p, COMPUTE_DTYPE, None)
    view = full.data if writable or dtype is None else full.data.to(dtype)
    base = type(p)
    p.__dict__[_GATHERED] = (view, full if writable else None)
    p.__class__ = _whole_types.setdefault(base, type(f"Gathered{base.__name__}", (_WholeData, base), {}))
    if hasattr(p, "ds_status"):
        p.ds_status = ZeroParamStatus.AVAILABLE


def _show_shard(p) -> None:
    if _GATHERED in p.__dict__:
        p.__class__ = type(p).__bases__[1]  # (_WholeData, the class it had)
        del p.__dict__[_GATHERED]
    if hasattr(p, "ds_status"):
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def _multi_process() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def register_external_parameter(module, parameter) -> None:
    """DeepSpeed's hint that ``module``'s forward uses another module's parameter: nothing to do under FSDP2."""


def unregister_external_parameter(module, parameter) -> None:
    """See :func:`register_external_parameter`."""


def is_zero_param(parameter) -> bool:
    """Whether ``parameter`` is sharded (DeepSpeed: has ZeRO-3 attributes)."""
    return _is_sharded(parameter)
