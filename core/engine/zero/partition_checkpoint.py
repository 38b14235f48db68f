"""The checkpoint side of :class:`torsh.engine.zero.partition.ZeroPartition`: whole per-parameter views of its
flat fp32 masters and optimizer state, in the form stage 0 with master weights saves and loads (so checkpoints move
between stages 0-3 and world sizes unchanged), and the loading of what ZeRO-1 saved before it ran on the partition.

A base class of the partition (it reads the partition's buckets, masters and collectives).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.state import RANK_STATE


class CheckpointViews:
    """Whole views of a ZeroPartition's masters and optimizer state (methods of the partition)."""

    @contextlib.contextmanager
    def full_view(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                  load: bool) -> Iterator[tuple[nn.Module, Any]]:  # fmt: skip
        """A module of whole fp32 parameters (the masters; a parameter outside the partition its own value in
        fp32) and persistent buffers, and an optimizer of ``optimizer``'s class over them with the whole state:
        what stage 0 with master weights saves. Collective. With ``load``, what was loaded into them is sliced
        back into this rank's partition afterwards and the parameters gathered. Under NVMe offload the state is
        read back from its files for the duration (and a loaded one written out after)."""
        from .nvme import resident

        with resident(optimizer):
            root, view_of = self._module_view(module)
            view_opt = self._optimizer_view(optimizer, view_of) if optimizer is not None else None
            yield root, view_opt
            if load:
                self._load_view(module, optimizer, view_opt, view_of)

    def _module_view(self, module: nn.Module) -> tuple[nn.Module, dict[int, nn.Parameter]]:
        wholes: dict[int, torch.Tensor] = {}
        for gi, m in enumerate(self.masters):
            wholes.update(self._split(self._gather_flat(m.data), gi))
        root = nn.Module()
        view_of: dict[int, nn.Parameter] = {}
        for n, p in module.named_parameters(remove_duplicate=False):  # a tied weight under each of its names
            if id(p) not in view_of:
                value = wholes.get(id(p))
                view_of[id(p)] = nn.Parameter(value if value is not None else p.detach().float().clone(),
                                              requires_grad=p.requires_grad)  # fmt: skip
            attach(root, n, view_of[id(p)], parameter=True)
        attach_buffers(root, module)
        return root, view_of

    @torch.no_grad()
    def _load_view(self, module: nn.Module, optimizer: Any, view_opt: Any, view_of: dict[int, nn.Parameter]) -> None:
        for b in self.buckets:
            self._own(b).copy_(self._local_of(b, [view_of[id(p)].detach() for p in b.params]))
        held = {id(p) for b in self.buckets for p in b.params}
        for p in module.parameters():
            if id(p) not in held:
                p.data.copy_(view_of[id(p)].detach())
        if view_opt is not None:
            self._load_optimizer(optimizer, view_opt, view_of)
        self.gather_params()

    def _optimizer_view(self, optimizer: torch.optim.Optimizer, view_of: dict[int, nn.Parameter]) -> Any:
        cls = type(optimizer)
        groups = [{**_hyper(g), "params": [view_of[id(p)] for p in self.group_params[gi]]}
                  for gi, g in enumerate(optimizer.param_groups)]  # fmt: skip
        view = cls.__new__(cls)
        torch.optim.Optimizer.__init__(view, groups, dict(optimizer.defaults))
        for vgroup, group in zip(view.param_groups, optimizer.param_groups):
            for key in set(vgroup) - set(group):  # what the defaults added: saved, then loaded back, they would
                del vgroup[key]  # give the groups keys they did not have (the drop-in's FusedAdam's defaults)
        for gi, m in enumerate(self.masters):
            state = optimizer.state.get(m)
            if not state:
                continue
            split = {key: self._split(self._gather_flat(value), gi) for key, value in state.items()
                     if _is_flat(value, m)}  # fmt: skip
            for p in self.group_params[gi]:
                view.state[view_of[id(p)]] = {k: split[k][id(p)] if k in split else _copy(v)
                                              for k, v in state.items()}  # fmt: skip
        return view

    def _load_optimizer(self, optimizer: torch.optim.Optimizer, view: Any, view_of: dict[int, nn.Parameter]) -> None:
        for gi, (group, vgroup) in enumerate(zip(optimizer.param_groups, view.param_groups)):
            group.update(_hyper(vgroup))
            loaded = {id(p): view.state.get(view_of[id(p)], {}) for p in self.group_params[gi]}
            keys = {k for s in loaded.values() for k in s}
            if keys:
                state = optimizer.state.setdefault(self.masters[gi], {})
                for key in keys:
                    state[key] = self._partition_of(gi, key, loaded)

    def _partition_of(self, gi: int, key: str, loaded: dict[int, dict]) -> Any:
        """This rank's flat partition of optimizer state ``key`` of group ``gi`` from per-parameter values (a
        scalar such as ``step`` as it is)."""
        first = next(s[key] for s in loaded.values() if key in s)
        if not (torch.is_tensor(first) and first.dim() > 0):
            return _copy(first).to(self.master_device) if torch.is_tensor(first) else first
        flat = torch.zeros(self.masters[gi].numel(), dtype=first.dtype, device=self.master_device)
        for b in self.buckets:
            if b.group == gi:
                values = [loaded[id(p)].get(key) for p in b.params]
                flat[b.master_offset:b.master_offset + b.chunk] = self._local_of(b, values).to(first.dtype)
        return flat

    def load_legacy_state(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        """Load what ``optimizer.state_dict()`` gave at stage 1 before stage 1 ran on this partition: torch's
        ``ZeroRedundancyOptimizer`` format of one rank (global parameter indices, the state of the parameters
        that rank owned; marked ``torsh_zero_partition``). Collective: every rank passes its own, and together
        they hold every parameter's state, which is then sliced into this rank's flat partition."""
        merged = self._legacy_states(state_dict[RANK_STATE], state_dict["state"])
        with self.full_view(self.model, optimizer, load=True) as (_, view):
            view_of = {id(p): v for gi, g in enumerate(view.param_groups)
                       for p, v in zip(self.group_params[gi], g["params"])}  # fmt: skip
            for group, saved in zip(view.param_groups, state_dict["param_groups"]):
                group.update(_hyper(saved))
            for i, p in enumerate(self.legacy_order):
                if i in merged and id(p) in view_of:
                    view.state[view_of[id(p)]] = merged[i]

    def _legacy_states(self, mark: dict, states: dict) -> dict[int, dict]:
        """Every rank's legacy ZeRO-1 state together, by global parameter index (collective); a ValueError unless
        they are all the ranks of one job of this size."""
        pieces: list[Any] = [None] * self.world
        dist.all_gather_object(pieces, (mark, states), group=self.group)
        ranks = {m["rank"] for m, _ in pieces}
        sizes = {m["world_size"] for m, _ in pieces}
        if sizes != {self.world} or len(ranks) != self.world:
            raise ValueError(f"optimizer.load_state_dict(): these are ZeRO-1 optimizer states of rank(s) "
                             f"{sorted(ranks)} of {sorted(sizes)} ranks, written before stage 1 partitioned a flat "
                             f"fp32 master; they load on a job of that size, each rank its own (this job has "
                             f"{self.world}); engine.save_checkpoint() checkpoints load at any world size")  # fmt: skip
        return {int(i): s for _, piece in pieces for i, s in piece.items()}


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _is_flat(value: Any, master: torch.Tensor) -> bool:
    """An optimizer state tensor shaped like the flat master (split per parameter in a whole view)."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == master.numel() and master.numel() > 0


def attach_buffers(root: nn.Module, module: nn.Module) -> None:
    """``module``'s persistent buffers under their names in ``root`` (as ``module.state_dict()`` holds them)."""
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                attach(root, f"{prefix}.{name}" if prefix else name, buf, parameter=False)


def _copy(value: Any) -> Any:
    return value.detach().clone() if torch.is_tensor(value) else value


def attach(root: nn.Module, dotted: str, tensor: torch.Tensor, *, parameter: bool) -> None:
    *parents, leaf = dotted.split(".")
    node = root
    for part in parents:
        if part not in node._modules:
            node.add_module(part, nn.Module())
        node = node._modules[part]
    if parameter:
        node.register_parameter(leaf, tensor)
    else:
        node.register_buffer(leaf, tensor)
