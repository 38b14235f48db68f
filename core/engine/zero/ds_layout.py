"""DeepSpeed's ZeRO-3 layout shown over FSDP2's shards: the parameter objects FSDP2 replaced, and the optimizer's
gradient partitions.

DeepSpeed partitions a model's parameters in place: the objects a script built stay the model's parameters, with
``data`` empty and this rank's partition in ``param.ds_tensor`` (the flattened parameter cut into
``ceil(numel / W)`` elements per rank, the last one padded with zeros). FSDP2 registers new parameters instead
(DTensor shards, cut along the first dimension). A script that kept the objects it passed to the model (DeepSpeed's
own tests keep the list of weights they build a model from, and write their partitions) would find them whole and
frozen at their initial values: :func:`link_originals` turns each into DeepSpeed's partitioned form instead, tied
to the shard that replaced it:

- ``ds_tensor`` is this rank's partition in DeepSpeed's layout, read from the shard the first time it is asked for
  (a collective over the shard group: every rank reads it, as every rank enters ``GatheredParameters``) and kept
  up to date at each forward and optimizer step, points every rank passes;
- a write to it (``p.ds_tensor.data = ...``, or in place) reaches the shard before the next forward or step: they
  agree over the ranks on which partitions changed (one small all-reduce, once a partition was handed out) and
  write their whole values into the shards. (A shard changed otherwise - a checkpoint load - shows at the next
  forward or step.)

:func:`attach_views` gives the optimizer DeepSpeed's ZeRO-3 views of the gradients in the same layout
(``averaged_gradients``, ``get_fp32_grad_partitions()``) and of the last norm (``_global_grad_norm``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import params as zero_params
from .construction import GatherDone, all_gather_into, comm_device, keep_own, partition_numel
from .whole_params import ZeroParamStatus

LINK = "_torsh_shard_link"
ORIGINALS = "_torsh_originals"  # on the sharded model: its Originals


@dataclass(frozen=True)
class Cut:
    """A rank's place in the group a parameter is cut over."""

    group: Any
    world: int
    rank: int


def shard_cut(shard: torch.Tensor) -> Cut:
    """The group FSDP2 cuts ``shard`` (a DTensor) over: the mesh's last (shard) dimension."""
    mesh = shard.device_mesh
    return Cut(mesh.get_group(mesh.ndim - 1), mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1))


def flat_partition(whole: torch.Tensor, cut: Cut) -> torch.Tensor:
    """This rank's partition of ``whole`` in DeepSpeed's layout (a new tensor; zeros past the end)."""
    out = torch.zeros(partition_numel(whole.numel(), cut.world), dtype=whole.dtype, device=whole.device)
    keep_own(out, whole, cut)
    return out


def _whole(shard: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return shard.full_tensor() if isinstance(shard, DTensor) else shard.detach()


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t._version


@dataclass
class _Link:
    """An original parameter object tied to the FSDP2 parameter that replaced it."""

    shard: nn.Parameter
    cut: Cut
    mirror: torch.Tensor | None = None
    """The partition handed out by ``ds_tensor`` (kept: a script may write it later)."""
    written: tuple[int, int] = (0, 0)
    """The mirror's storage and version when it last matched the shard."""

    @torch.no_grad()
    def refresh(self) -> torch.Tensor:
        """The mirror, holding this rank's partition of the shard's current value (collective: a shard's version
        counter does not move when the optimizer steps it, so it is read each time)."""
        part = flat_partition(_whole(self.shard), self.cut)
        if self.mirror is None or self.mirror.shape != part.shape:
            self.mirror = part
        else:
            self.mirror.copy_(part.to(self.mirror.device, self.mirror.dtype))
        self.written = _stamp(self.mirror)
        return self.mirror

    def changed(self) -> bool:
        return self.mirror is not None and _stamp(self.mirror) != self.written

    @torch.no_grad()
    def write_back(self, mine: bool) -> None:
        """Every rank's partition (its written mirror when ``mine``, else its partition of the shard) into the
        shard (collective over the shard group)."""
        whole = _whole(self.shard)
        own = self.mirror if mine else flat_partition(whole, self.cut)
        device = comm_device(self.cut.group)
        own = own.detach().to(device=device, dtype=whole.dtype).reshape(-1).contiguous()
        everyone = torch.empty(own.numel() * self.cut.world, dtype=own.dtype, device=device)
        all_gather_into(everyone, own, group=self.cut.group)
        zero_params.write_whole(self.shard, everyone[:whole.numel()])
        self.refresh()  # the same mirror object, which the script may still hold, now shows what the shard holds


class OriginalParameter(nn.Parameter):
    """A parameter object FSDP2 replaced, in DeepSpeed's partitioned form (its class is switched to this one)."""

    @property
    def ds_tensor(self) -> torch.Tensor:
        return _mirror(self)

    @ds_tensor.setter
    def ds_tensor(self, value: torch.Tensor) -> None:
        _mirror(self).data = value.data if isinstance(value, torch.Tensor) else torch.as_tensor(value)

    def partition_numel(self) -> int:
        return _mirror(self).numel()

    @torch.no_grad()
    def all_gather(self, param_list=None, async_op=False, hierarchy=0) -> None:  # noqa: ARG002  (DeepSpeed's)
        """DeepSpeed's ``param.all_gather()``: ``data`` becomes the shard's whole value (collective)."""
        for p in param_list or [self]:
            if isinstance(p, OriginalParameter) and p.ds_status is ZeroParamStatus.NOT_AVAILABLE:
                p.data = _whole(p.__dict__[LINK].shard).to(p.dtype).view(p.ds_shape)
                p.ds_status = ZeroParamStatus.AVAILABLE

    def all_gather_coalesced(self, params, safe_mode=False, quantize=False) -> GatherDone:  # noqa: ARG002
        """DeepSpeed's ``param.all_gather_coalesced(params)``: each of ``params`` gathered now (collective); the
        handle returned has nothing left to wait for."""
        self.all_gather(list(params))
        return GatherDone()

    @torch.no_grad()
    def partition(self, param_list=None, hierarchy=0, has_been_updated=False, free_data=True) -> None:  # noqa: ARG002
        """DeepSpeed's ``param.partition()``: ``data`` is freed again; ``has_been_updated``: what was written to the
        whole value first becomes the shard's (every rank writes the same value)."""
        for p in param_list or [self]:
            if isinstance(p, OriginalParameter) and p.ds_status is ZeroParamStatus.AVAILABLE:
                if has_been_updated:
                    zero_params.write_whole(p.__dict__[LINK].shard, p.data)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE

    ds_summary = zero_params.ds_summary


def _mirror(param: OriginalParameter) -> torch.Tensor:
    """The partition of ``param`` handed out to the script: read from the shard the first time (collective), then
    kept up to date at every forward and optimizer step (:meth:`Originals.sync`, :meth:`Originals.refresh`)."""
    link: _Link = param.__dict__[LINK]
    if link.mirror is None:
        link.refresh()
    param.__dict__["_torsh_links"].handed_out.add(id(link))
    return link.mirror


@dataclass
class Originals:
    """The links of one model, and which partitions were handed out (checked before each forward)."""

    links: dict[int, _Link] = field(default_factory=dict)
    handed_out: set[int] = field(default_factory=set)

    @torch.no_grad()
    def sync(self, *_: Any) -> None:
        """Before a forward: partitions written since they were read reach their shards; the others are read again
        from their shards (both collective, over the partitions handed out on every rank)."""
        watched = self._watched()
        if not watched:
            return
        flags = torch.tensor([link.changed() for link in watched], dtype=torch.uint8, device=comm_device(None))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        for link, mine, anyone in zip(watched, [link.changed() for link in watched], flags.tolist()):
            if anyone:
                link.write_back(mine)
            else:
                link.refresh()

    def _watched(self) -> list[_Link]:
        return [self.links[k] for k in sorted(self.handed_out, key=lambda k: self.links[k].shard.ds_id)]

    @torch.no_grad()
    def refresh(self, *_: Any) -> None:
        """After an optimizer step: the partitions handed out show the stepped shards (collective)."""
        for link in self._watched():
            link.refresh()


def before_sharding(model: nn.Module) -> list[tuple[nn.Module, str, weakref.ref]]:
    """Where each parameter object of ``model`` is, before ``fully_shard`` replaces them (weakly: an object nothing
    else holds is freed as FSDP2 replaces it, as before)."""
    return [(m, n, weakref.ref(p)) for m in model.modules() for n, p in m._parameters.items() if p is not None]


def link_originals(model: nn.Module, before: list[tuple[nn.Module, str, weakref.ref]]) -> Originals:
    """Each object of ``before`` that FSDP2 replaced and something else still holds becomes DeepSpeed's partitioned
    parameter tied to its shard (after :func:`.params.mark_partitioned`: the shard's ``ds_id``); the model checks
    them before each forward."""
    originals = Originals()
    for module, name, ref in before:
        old, new = ref(), module._parameters.get(name)
        if old is None or new is None or new is old or not hasattr(new, "ds_id") or type(old) is not nn.Parameter:
            continue  # kept, not replaced, already linked (a tied weight), or a parameter class of a library's own
        link = _Link(new, shard_cut(new))
        with torch.no_grad():
            old.data = torch.empty(0, dtype=old.dtype, device=old.device)
        old.__class__ = OriginalParameter
        for key in ("ds_id", "ds_shape", "ds_numel", "ds_persist"):
            old.__dict__[key] = getattr(new, key)
        old.__dict__.update(ds_status=ZeroParamStatus.NOT_AVAILABLE, _torsh_links=originals)
        old.__dict__[LINK] = link
        originals.links[id(link)] = link
    if originals.links:
        model.register_forward_pre_hook(originals.sync, prepend=True)  # before FSDP2 gathers the first unit
        model.__dict__[ORIGINALS] = originals  # the optimizer's step syncs them too (attach_views)
    return originals


# --- comparing shards ------------------------------------------------------------------------------------------


def allow_allclose() -> None:
    """``torch.allclose`` on FSDP2's DTensor parameters (DTensor has no rule for it, so scripts and DeepSpeed's tests
    that compare two models' parameters after a checkpoint load failed): each rank compares its shards and the
    ranks agree (one all-reduce per mesh dimension); operands laid out differently are compared whole."""
    from torch.distributed.tensor import DTensor

    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    if isinstance(handlers, dict):
        handlers.setdefault(torch.ops.aten.allclose.default, _allclose)


def _allclose(op_call: Any, args: tuple, kwargs: dict) -> bool:
    from torch.distributed.tensor import DTensor

    a, b, *rest = args
    same = isinstance(a, DTensor) and isinstance(b, DTensor) and a.placements == b.placements \
        and a.device_mesh == b.device_mesh and a.shape == b.shape
    if not same:
        return op_call(_whole(a) if isinstance(a, DTensor) else a, _whole(b) if isinstance(b, DTensor) else b,
                       *rest, **kwargs)  # fmt: skip
    local = op_call(a.to_local(), b.to_local(), *rest, **kwargs)
    differs = torch.tensor([0 if local else 1], dtype=torch.int32, device=a.to_local().device)
    for dim in range(a.device_mesh.ndim):
        dist.all_reduce(differs, group=a.device_mesh.get_group(dim))
    return int(differs.item()) == 0


# --- the optimizer's views ----------------------------------------------------------------------------------------


def _grad_partitions(optimizer: torch.optim.Optimizer, dtype: torch.dtype | None) -> dict[int, list[torch.Tensor]]:
    out = {}
    for index, group in enumerate(optimizer.param_groups):
        parts = []
        for p in group["params"]:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            cut = shard_cut(p) if hasattr(p, "device_mesh") else Cut(None, 1, 0)
            part = flat_partition(_whole(grad), cut)
            parts.append(part if dtype is None else part.to(dtype))
        out[index] = parts
    return out


def _get_fp32_grad_partitions(self) -> dict[int, dict[int, torch.Tensor]]:
    """DeepSpeed's ``get_fp32_grad_partitions()``: per group, per parameter, this rank's partition of the
    gradient in DeepSpeed's layout, fp32 (collective)."""
    return {g: dict(enumerate(parts)) for g, parts in _grad_partitions(self, torch.float32).items()}


def _averaged_gradients(self) -> dict[int, list[torch.Tensor]]:
    """DeepSpeed's ``averaged_gradients``: per group, this rank's partitions of the (reduced) gradients in DeepSpeed's
    layout (collective)."""
    return _grad_partitions(self, None)


def _global_norm(self) -> float:
    """The global gradient norm of the last step the engine took, else of the gradients held now (collective)."""
    engine = self.__dict__.get("_torsh_engine")
    recorded = None if engine is None else engine() and engine()._global_grad_norm
    if recorded is not None:
        return float(recorded)
    grads = [_whole(p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
                 ) if grads else 0.0  # fmt: skip


def _shards(self) -> list[torch.Tensor]:
    return [p for group in self.param_groups for p in group["params"]]


_VIEWS = {"averaged_gradients": property(_averaged_gradients), "_global_grad_norm": property(_global_norm),
          "get_fp32_grad_partitions": _get_fp32_grad_partitions,
          # DeepSpeed's sub-groups of the ZeRO-3 optimizer: here one per parameter, its shard the tensor stepped
          # (the key of its optimizer state)
          "fp16_groups": property(lambda self: [[p] for p in _shards(self)]),
          "fp32_partitioned_groups_flat": property(_shards)}  # fmt: skip
_view_classes: dict[type, type] = {}
_VIEWS_OF = "_torsh_views_of"  # on a class attach_views made: the class it extends


def attach_views(optimizer: torch.optim.Optimizer, engine: Any) -> None:
    """Give ``optimizer`` (the torch optimizer of the FSDP2 shards) DeepSpeed's ZeRO-3 gradient views: its class
    becomes a subclass of its own with them (same name; ``isinstance`` unchanged)."""
    if _VIEWS_OF in type(optimizer).__dict__ or any(name in optimizer.__dict__ for name in _VIEWS):
        return
    optimizer.__class__ = _with_views(type(optimizer))
    _hook_steps(optimizer)
    optimizer.__dict__["_torsh_engine"] = weakref.ref(engine)
    originals = engine.module.__dict__.get(ORIGINALS)
    if originals is not None:  # a partition written since the last forward is what the step updates, and a
        # partition the script holds shows the stepped value (the step is a point every rank passes)
        optimizer.register_step_pre_hook(lambda *_: originals.sync())
        optimizer.register_step_post_hook(lambda *_: originals.refresh())


def _with_views(cls: type) -> type:
    if cls not in _view_classes:
        _view_classes[cls] = type(cls.__name__, (cls,), {**_VIEWS, _VIEWS_OF: cls, "__module__": cls.__module__})
    return _view_classes[cls]


def base_class(optimizer: Any) -> type:
    """The optimizer's class, without the views :func:`attach_views` added."""
    return type(optimizer).__dict__.get(_VIEWS_OF, type(optimizer))


def retype(optimizer: Any, cls: type) -> None:
    """Make ``optimizer`` an instance of ``cls`` (the drop-in's ``FusedAdam`` for a torch Adam), keeping its views."""
    optimizer.__class__ = _with_views(cls) if _VIEWS_OF in type(optimizer).__dict__ else cls
    _hook_steps(optimizer)


def _hook_steps(optimizer: Any) -> None:
    """torch runs an optimizer's step hooks through its class's ``step``, wrapped when the first instance of the
    class is built: a class given afterwards is wrapped here."""
    patch = getattr(optimizer, "_patch_step_function", None)
    if callable(patch):
        patch()
