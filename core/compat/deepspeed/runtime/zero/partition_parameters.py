"""``deepspeed.zero.Init`` and ``deepspeed.zero.GatheredParameters`` over the torsh engine's sharding.

torsh shards at ``initialize`` (FSDP2 at stages 2/3), not while the model is built, so ``zero.Init`` builds the
model normally (full parameters on every rank); it only marks the parameters it saw created, so that
``GatheredParameters(..., modifier_rank=r)`` on them broadcasts rank ``r``'s values, as DeepSpeed's partitioned
parameters do. After ``initialize`` at stages 2/3 the parameters are DTensor shards carrying DeepSpeed's
``ds_id``/``ds_status`` (:mod:`torsh.engine.zero.params`): ``GatheredParameters`` puts full parameters, in
DeepSpeed's parameter dtype, on their modules inside the context, makes ``param.data`` the whole value (what
DeepSpeed scripts read there) and, with a ``modifier_rank``, writes that rank's values back into every rank's
shard on exit. Plain (DDP) parameters are
left alone, as DeepSpeed leaves parameters ZeRO did not partition.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from enum import Enum

import torch
import torch.distributed as dist
from torch import nn

from torsh.engine.zero.params import COMPUTE_DTYPE, ZeroParamStatus, write_shown

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
        _built.append(weakref.ref(param))
    return _original_register_parameter(self, name, param)


#: A parameter built under ``zero.Init`` and partitioned, under DeepSpeed, when its module's constructor returned:
#: the fingerprint of its value at that point, and how to name it.
_SEAL = "_torsh_zero_init_seal"
_built: list = []  # weak references to the parameters marked in the current outermost context
_registration_hook = None


def _fingerprint(p) -> tuple[str, str] | None:
    """Two sums of the value, as text (a parameter left uninitialised by ``torch.empty`` may hold NaN)."""
    try:
        t = p.detach()
        if t.is_meta:
            return None
        return (repr(float(t.sum(dtype=torch.float64))), repr(float(t.abs().sum(dtype=torch.float64))))
    except Exception:  # noqa: BLE001 - a parameter that cannot be summed is not checked
        return None


def _seal(p, label: str) -> None:
    """Remember ``p``'s value where DeepSpeed would partition it (its module's constructor has returned)."""
    p.__dict__[_SEAL] = (_fingerprint(p), label)


def _seal_module(module: nn.Module, *, recurse: bool = True) -> None:
    for name, p in module.named_parameters(recurse=recurse):
        if getattr(p, _ZERO_INIT_MARK, False) and _SEAL not in p.__dict__:
            owner = type(module).__name__ if "." not in name else name.rsplit(".", 1)[0]
            _seal(p, f"{owner}.{name.rsplit('.', 1)[-1]} {list(p.shape)}")


def _on_child_registered(parent, name, child):  # torch's global module registration hook
    if isinstance(child, nn.Module) and _init_depth > 0:
        _seal_module(child)  # assigned to its parent: the child's constructor has returned


def changed_after_construction(params) -> list:
    """The parameters among ``params`` whose value changed since DeepSpeed would have partitioned them (their
    module's constructor returned under ``zero.Init``), outside ``GatheredParameters(..., modifier_rank=r)``."""
    out = []
    for p in params:
        seal = p.__dict__.get(_SEAL) if isinstance(p, torch.Tensor) else None
        if seal is not None and seal[0] is not None and _fingerprint(p) != seal[0]:
            out.append(p)
    return out


def _difference(what: str, names: list[str]) -> str:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"{what}: {len(names)} parameter(s) built under deepspeed.zero.Init changed after their module's "
            f"constructor returned, outside deepspeed.zero.GatheredParameters(..., modifier_rank=...): {shown}. "
            "Under DeepSpeed such parameters are already partitioned (empty) at that point: the change does nothing "
            "there and draws nothing from torch's random generator, so the model you train (and the random stream "
            "after it: dropout, data order) differs from DeepSpeed's. torsh keeps the change. For DeepSpeed's "
            "model, drop that change (the constructors' own initialisation is what DeepSpeed keeps); to have it "
            "under both engines, make it inside deepspeed.zero.GatheredParameters(params, modifier_rank=0), as "
            "transformers >= 5 does for a model built from a config")  # fmt: skip


def _warn(message: str) -> None:
    import logging

    logging.getLogger("torsh.compat").warning(message)


def check_before_initialize(model) -> None:
    """Called by ``deepspeed.initialize``: say which parameters built under ``zero.Init`` were changed after
    construction (where DeepSpeed would have discarded the change), then forget the seals."""
    if model is None:
        return
    named = [(n, p) for n, p in model.named_parameters() if _SEAL in p.__dict__]
    if not named:
        return
    changed = {id(p) for p in changed_after_construction([p for _, p in named])}
    if changed:
        _warn(_difference("deepspeed.initialize", [n for n, p in named if id(p) in changed]))
    for _, p in named:
        p.__dict__.pop(_SEAL, None)


def _contradicting_single_rank_group(explicit_group) -> str | None:
    """DeepSpeed's guard: a world group of one process while the launcher started several."""
    if explicit_group is not None or not dist.is_initialized() or dist.get_world_size() != 1:
        return None
    import os

    try:
        launched = int(os.environ.get("WORLD_SIZE", "0") or "0")
    except ValueError:
        return None
    if launched <= 1:
        return None
    return (f"zero.Init resolved a process group of world_size=1, but the launcher environment reports "
            f"WORLD_SIZE={launched}. A single-rank process group was likely initialized before zero.Init ran. "
            "Parameters would not be partitioned across the launched processes: call deepspeed.init_distributed() "
            "before building the model under zero.Init, or pass data_parallel_group= if one rank is intended.")


class Init:
    """DeepSpeed's ZeRO-3 construction context: here the model is built normally and sharded at ``initialize``.

    Every argument of DeepSpeed 0.19.8 is accepted. As DeepSpeed's, it starts ``torch.distributed``
    (:func:`deepspeed.init_distributed`) when it is not started yet, and ``config_dict_or_path`` is checked as
    DeepSpeed checks it. ``module=`` (converting a built model) and ``enabled=False`` change nothing. Usable as a
    context manager or a decorator.

    DeepSpeed partitions each parameter when its module's constructor returns; a change made to it after that
    point, outside ``GatheredParameters(..., modifier_rank=r)``, is lost under DeepSpeed and kept here. Such
    changes are detected (at the end of the outermost context and at ``initialize``) and logged as a warning
    naming the parameters, the difference, and how to get the same model under both engines.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None, param_swapper=None,
                 tensor_overrides=None):  # fmt: skip
        if config is not None:
            config_dict_or_path = config
        if config_dict_or_path is not None:
            from ..config import check_gradient_allreduce_op

            check_gradient_allreduce_op(config_dict_or_path)  # DeepSpeed reads (and checks) the config here
        if not dist.is_initialized():
            from ...comm import init_distributed

            init_distributed()
        if sequence_data_parallel_group is not None and data_parallel_group is not None:
            raise ValueError("Both 'data_parallel_group' and 'sequence_data_parallel_group' were specified. Please "
                             "provide only one of these arguments.")  # fmt: skip
        problem = _contradicting_single_rank_group(data_parallel_group or sequence_data_parallel_group)
        if problem:
            raise RuntimeError(problem)
        self.enabled = enabled
        if module is not None and enabled:
            for p in module.parameters():
                setattr(p, _ZERO_INIT_MARK, True)
            _seal_module(module)  # DeepSpeed partitions a built module at once

    def __enter__(self):
        global _init_depth, _registration_hook
        if self.enabled:
            with _init_lock:
                _init_depth += 1
                if _init_depth == 1:
                    nn.Module.register_parameter = _marking_register_parameter
                    _registration_hook = torch.nn.modules.module.register_module_module_registration_hook(
                        _on_child_registered)
        return self

    def __exit__(self, *exc):
        global _init_depth, _registration_hook
        if self.enabled:
            with _init_lock:
                _init_depth -= 1
                if _init_depth == 0:
                    nn.Module.register_parameter = _original_register_parameter
                    _registration_hook.remove()
                    _registration_hook = None
                    built, _built[:] = [r() for r in _built], []
                    self._check([p for p in built if p is not None], failed=exc[0] is not None)
        return False

    @staticmethod
    def _check(built: list, *, failed: bool) -> None:
        sealed = [p for p in built if _SEAL in p.__dict__]
        changed = {id(p) for p in changed_after_construction(sealed)}
        if changed and not failed:
            _warn(_difference("deepspeed.zero.Init", [p.__dict__[_SEAL][1] for p in sealed if id(p) in changed]))
        for p in built:  # the rest (the outermost modules' own parameters) are partitioned on leaving
            if id(p) in changed or _SEAL not in p.__dict__:
                _seal(p, p.__dict__.get(_SEAL, (None, f"parameter {list(p.shape)}"))[1])

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
    do not run the model's forward inside). It is in DeepSpeed's parameter dtype, the compute dtype (bf16 or
    fp16 under mixed precision, where torsh's shards hold the fp32 masters), so a value written there is rounded
    as DeepSpeed's parameter stores it. On exit, with ``modifier_rank`` set, that rank's full values are
    broadcast and written into every rank's shard: the elements that changed take the written value, the others
    keep the fp32 master's (what a rank changed otherwise is discarded, as in DeepSpeed). Parameters built under
    :class:`Init` and not yet sharded are broadcast from ``modifier_rank`` on exit. Other parameters (DDP, stages
    0/1): a no-op. Every rank must enter the context, as in DeepSpeed.
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
            for p in self._built_in_init:
                if _multi_process():
                    dist.broadcast(p.data, src=self.modifier_rank)
                if _SEAL in p.__dict__:  # written back, as DeepSpeed does: the new value is the partitioned one
                    _seal(p, p.__dict__[_SEAL][1])
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


def _multi_process() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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


def is_zero_param(parameter) -> bool:
    """Whether ``parameter`` is sharded (DeepSpeed: has ZeRO-3 attributes)."""
    return _is_sharded(parameter)


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
