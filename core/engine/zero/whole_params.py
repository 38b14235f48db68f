"""What a rank reads from a module sharded with FSDP2, without a collective: whole parameters when they are there.

DeepSpeed keeps every parameter whole on every rank at stages 0-2, so scripts read the module state on one rank:
DeepSpeed-Chat's ``save_hf_format`` and many others run ``torch.save(model.state_dict(), ...)`` on rank 0 only.
FSDP2's own ``state_dict`` pre-hook reshards the parameters *of the calling rank* (``_to_sharded``), which has two
effects a DeepSpeed script does not expect:

- the file holds DTensor shards (rank 0's half, pickled with its device mesh), which ``torch.load(weights_only=True)``
  and ``from_pretrained`` cannot read;
- the ranks no longer agree on which parameters are gathered. After an evaluation forward (its units are kept
  gathered, ``reshard_after_forward=False``) rank 0 is resharded and rank 1 is not, so the next per-parameter
  ``GatheredParameters`` loop (DeepSpeed-Chat's ``save_zero_three_model``) all-gathers on rank 0 only: rank 1
  finishes and exits, rank 0 waits for it ("Connection closed by peer").

:func:`install` replaces that pre-hook by one that changes nothing, and adds a post-hook that puts a copy of the
whole parameter in the state dict wherever its unit is gathered on every rank. At stage 2 (``keep_whole``)
:func:`make_whole` gathers the units after each optimizer step, as DeepSpeed's stage 2 all-gathers the updated
partitions after its step, so between steps the whole values are always there: ``model.state_dict()`` on any
rank gives plain full tensors in the compute dtype, DeepSpeed's stage-2 module state dict.

Why gather after the step rather than keep a separate full copy: the gathered buffers are the ones the next
forward would all-gather into anyway (stage 2 runs with ``reshard_after_forward=False``), so nothing is
communicated twice and the peak memory does not grow; a separate copy would add one whole model in the compute
dtype to every rank for the whole run. The parameters the module shows between steps stay the FSDP2 shards
(what the optimizer steps, what ``safe_get_full_fp32_param`` and ``GatheredParameters`` read); a forward pre-hook
puts the gathered ones back on the modules before the unit runs. Measured on 2 CPU ranks (gloo; 4 blocks of
256x1024 linears, micro batch 8, median of 35 steps, alternating runs on a machine shared with other jobs): 335
and 432 ms per step with the gather after the step, 299 and 531 ms without it, i.e. no difference beyond the
noise, as expected: it is the same all-gather, moved from the next forward to the end of the step.

torsh's own checkpoints need the shards (DCP writes each rank's part): :func:`sharded_state` shows them while a
checkpoint is written or read, on every rank, and gathers the units again afterwards at stage 2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the functions: checkpoint.save_load imports this module without it
    import torch
    from torch import nn

_SHOWING_SHARDS = "_torsh_showing_shards"
_INSTALLED = "_torsh_whole_params"
_KEEP_WHOLE = "_torsh_keep_whole"  # on the root module, once make_whole has run: sharded_state gathers again
_OWNED = "_torsh_fsdp_params"  # on a module: its parameter names -> their FSDP2 parameters
_sharded_depth = 0  # > 0 inside sharded_state(): state dicts hold the shards (torsh's own checkpoint files)


COMPUTE_DTYPE = "_torsh_compute_dtype"
"""The dtype DeepSpeed's parameter would have (its module is cast to the compute dtype; torsh keeps fp32 shards)."""


class ZeroParamStatus(Enum):
    """Where a partitioned parameter's whole value is (DeepSpeed's enum, ``param.ds_status``)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def _groups(model: nn.Module) -> list[Any]:
    """Every FSDP2 parameter group of ``model``, once each (a unit of several modules shares one group)."""
    from torch.distributed.fsdp import FSDPModule

    seen: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                seen.setdefault(id(group), group)
    return list(seen.values())


def _owners(fsdp_param: Any) -> list[tuple[nn.Module, str]]:
    info = fsdp_param._module_info
    return [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]


def install(model: nn.Module, *, mark_gathered: bool) -> None:
    """Hooks on every FSDP2 unit of ``model`` (right after ``fully_shard``): a state dict never reshards on
    the calling rank alone, and holds whole values wherever its unit is gathered. ``mark_gathered`` (stage 3):
    a unit gathered for its forward or kept gathered after it shows its parameters as DeepSpeed shows a gathered
    ZeRO-3 parameter (``ds_id``, ``ds_status`` AVAILABLE), so that scripts testing ``hasattr(p, "ds_id")`` take
    the same branch as under DeepSpeed (where the parameter is partitioned again after the forward, and gathered
    by the script)."""
    for group in _groups(model):
        if getattr(group, _INSTALLED, False):
            continue
        setattr(group, _INSTALLED, True)
        # FSDP2 registers its state-dict hooks in the group's lazy init (first forward); this keeps its load
        # pre-hook (loading writes the shards, so they must be on the modules) and drops its save pre-hook.
        group._register_state_dict_hooks = _loader_hooks(group)
        for module in group.modules:
            module.register_forward_pre_hook(_show_gathered_hook(group), prepend=True)
            if mark_gathered:
                # after FSDP2's own pre-forward hook (it gathers the unit): code run inside the forward that reads
                # a parameter of a module whose forward it bypasses (TRL's fused LM-head loss reads lm_head.weight
                # and gathers it unless ds_status says AVAILABLE) finds the gathered parameter marked
                module.register_forward_pre_hook(_mark_gathered_pre_hook(group))
                module.register_forward_hook(_mark_gathered_hook(group))
        for fsdp_param in group.fsdp_params:
            fsdp_param._torsh_group = group
            fsdp_param.sharded_param._torsh_fsdp_param = fsdp_param
            for module, name in _owners(fsdp_param):
                if _OWNED not in module.__dict__:
                    module.__dict__[_OWNED] = {}
                    module.register_state_dict_post_hook(_whole_values)
                module.__dict__[_OWNED][name] = fsdp_param


def _loader_hooks(group: Any):
    def register() -> None:
        handles = group._module_to_pre_load_state_dict_hook_handle
        if handles:
            return
        for module in {fsdp_param._module_info.module for fsdp_param in group.fsdp_params}:
            handles[module] = module._register_load_state_dict_pre_hook(lambda *a, **k: _reshard(group))

    return register


def _reshard(group: Any) -> None:
    group._to_sharded()
    setattr(group, _SHOWING_SHARDS, False)


def _show_gathered_hook(group: Any):
    def hook(module: nn.Module, args: Any) -> None:
        if getattr(group, _SHOWING_SHARDS, False):
            setattr(group, _SHOWING_SHARDS, False)
            if group.is_unsharded:
                for fsdp_param in group.fsdp_params:
                    fsdp_param._setattr_on_modules(fsdp_param.unsharded_param)

    return hook


def _mark_gathered(group: Any) -> None:
    for fsdp_param in group.fsdp_params:
        whole, shard = getattr(fsdp_param, "_unsharded_param", None), fsdp_param.sharded_param
        if whole is not None and hasattr(shard, "ds_id") and not hasattr(whole, "ds_id"):
            whole.ds_id, whole.ds_shape, whole.ds_numel = shard.ds_id, shard.ds_shape, shard.ds_numel
            whole.ds_status = ZeroParamStatus.AVAILABLE
            setattr(whole, COMPUTE_DTYPE, getattr(shard, COMPUTE_DTYPE, None))


def _mark_gathered_pre_hook(group: Any):
    def hook(module: nn.Module, args: Any) -> None:
        _mark_gathered(group)

    return hook


def _mark_gathered_hook(group: Any):
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        _mark_gathered(group)

    return hook


def _whole_values(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: a parameter whose unit is gathered is given as its whole value (a copy: the gathered
    buffer is freed by the next backward) or, with ``keep_vars``, as the gathered parameter."""
    from torch import nn

    if _sharded_depth:
        return
    for name, fsdp_param in module.__dict__[_OWNED].items():
        key = prefix + name
        if key not in state or not fsdp_param._torsh_group.is_unsharded:
            continue
        whole = fsdp_param.unsharded_param
        state[key] = whole if isinstance(state[key], nn.Parameter) else whole.detach().clone()


def make_whole(model: nn.Module) -> None:
    """Gather every unit of ``model`` (collective: every rank calls it) and keep the shards on the modules until
    the unit's next forward, so that a state dict read on any rank has the whole values."""
    import torch

    model.__dict__[_KEEP_WHOLE] = True
    for group in _groups(model):
        if not group.is_unsharded:
            group.lazy_init()
            with torch.no_grad():
                group.unshard()
                group.wait_for_unshard()  # puts the gathered parameters on the modules
        for fsdp_param in group.fsdp_params:
            fsdp_param._setattr_on_modules(fsdp_param.sharded_param)
            fsdp_param.sharded_param._torsh_fsdp_param = fsdp_param
        setattr(group, _SHOWING_SHARDS, True)


def reshard(model: nn.Module) -> None:
    """Free every gathered unit of ``model`` (no communication)."""
    for group in _groups(model):
        if not group.is_sharded:
            _reshard(group)


def stale(param: torch.Tensor) -> None:
    """``param``'s shard was written directly: its unit's gathered copy is out of date and is dropped (the next
    forward gathers it again). Every rank writes the same value, so every rank drops it."""
    fsdp_param = getattr(param, "_torsh_fsdp_param", None)
    if fsdp_param is not None and not fsdp_param._torsh_group.is_sharded:
        _reshard(fsdp_param._torsh_group)


@contextlib.contextmanager
def sharded_state(model: nn.Module) -> Iterator[None]:
    """Inside: state dicts hold the shards (DTensors), as DCP needs; collective (every rank enters). After it, at
    stage 2 (once :func:`make_whole` has run), the units are gathered again (a load has changed the shards)."""
    global _sharded_depth
    groups = _groups(model)
    if not groups:
        yield
        return
    reshard(model)
    _sharded_depth += 1
    try:
        yield
    finally:
        _sharded_depth -= 1
    if model.__dict__.get(_KEEP_WHOLE):
        make_whole(model)
