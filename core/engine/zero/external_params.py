"""ZeRO-3 external parameters: a parameter read during the forward outside its own module's forward.

A forward may use another module's parameter (``F.linear(x, self.embed.weight)`` for a tied head, a child's bias
used by its parent). DeepSpeed finds these reads itself: at ZeRO-3 every module's ``_parameters`` is its
``ZeROOrderedDict``, whose lookup, while the engine's forward runs, gathers a parameter that is still partitioned.
Under FSDP2 such a read finds the owner's unit resharded, so the parameter is a DTensor shard, and the forward fails
mixing it with plain tensors. The same dictionary here unshards the owner's unit instead (a collective: every rank
reads the same parameters in the same forward), so the read gets the whole parameter; the unit stays unsharded
until its own backward (or next forward) reshards it, after its gradients, this use's included, are reduced, as
DeepSpeed keeps an external parameter gathered.

:func:`install` puts the dictionaries on a model FSDP2 shards at stage 3 and marks its forward (DeepSpeed's engine
forward prologue and epilogue); modules attached after ``initialize`` get theirs at the next forward
(:func:`ensure_zero_ordered_dict`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn


class ZeROOrderedDict(OrderedDict):
    """A module's ``_parameters`` that, while the engine's forward runs, hands out the whole parameter for one whose
    FSDP2 unit is resharded (it unshards the unit)."""

    def __init__(self, parent_module: nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parent_module = parent_module
        self._in_forward = False

    def __reduce__(self):
        reduced = super().__reduce__()
        return (reduced[0], (self._parent_module,)) + tuple(reduced[2:])

    def __getitem__(self, key: str):
        param = super().__getitem__(key)
        if param is None or torch.compiler.is_compiling():
            return param
        if getattr(self._parent_module._parameters, "_in_forward", False) and _is_shard(param):
            unit = _unit_of(self._parent_module, key)
            if unit is not None:
                param.is_external_param = True  # DeepSpeed's mark of a parameter it found used outside its module
                unit.unshard()  # the whole parameter is registered on the module in the shard's place
                return super().__getitem__(key)
        return param


def _is_shard(param: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def _unit_of(module: nn.Module, name: str) -> Any:
    """The FSDP2 module whose unit holds ``module``'s parameter ``name`` (None: no unit does)."""
    from torch.distributed import _composable_state
    from torch.distributed.fsdp import FSDPModule

    for owner in list(_composable_state._module_state_mapping):
        group = owner._get_fsdp_state()._fsdp_param_group if isinstance(owner, FSDPModule) else None
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            info = fsdp_param._module_info
            holders = [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]
            if any(m is module and n == name for m, n in holders):
                return owner
    return None


def ensure_zero_ordered_dict(module: Any) -> None:
    """``module._parameters`` as a :class:`ZeROOrderedDict` (same entries), unless it is one already or is no
    dict (a missing or None ``_parameters`` is left alone). The container it replaces the first time is kept as
    ``module._original_parameters``."""
    params = getattr(module, "_parameters", None)
    if isinstance(params, ZeROOrderedDict) or not isinstance(params, dict):
        return
    if not hasattr(module, "_original_parameters"):
        module._original_parameters = params
    module._parameters = ZeROOrderedDict(module, params.items())


def _mark_forward(flag: bool):
    def hook(model: nn.Module, *_: Any) -> None:
        for module in model.modules():
            if flag:
                ensure_zero_ordered_dict(module)  # a module attached after initialize
            if isinstance(module._parameters, ZeROOrderedDict):
                module._parameters._in_forward = flag

    return hook


def install(model: nn.Module) -> None:
    """Every module of ``model`` (sharded by FSDP2 at stage 3) gets a :class:`ZeROOrderedDict`, and its forward
    marks the dictionaries for its duration. Called after ``fully_shard``: the marking starts after FSDP2's own
    pre-forward (which reads the shards while it initialises) and ends after its post-forward."""
    for module in model.modules():
        ensure_zero_ordered_dict(module)
    model.register_forward_pre_hook(_mark_forward(True))
    model.register_forward_hook(_mark_forward(False), always_call=True)
