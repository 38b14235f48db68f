"""What torsh's checkpoints and the reader of DeepSpeed's share: collectives that also work without a process group
(a failure on one rank raised on every rank), and the optimizer's state by parameter name, including the
partitions of a ZeroRedundancyOptimizer (ZeRO-1)."""

from __future__ import annotations

from typing import Any

from ..agreement import gather as _gather
from .io import CheckpointError


# --------------------------------------------------------------------------------------------------
# process-group helpers (everything also works without torch.distributed initialised)


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def _world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist else 1


def _barrier() -> None:
    dist = _dist()
    if dist:
        dist.barrier()


def _on_every_rank(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on each rank; if it raised :class:`CheckpointError` on any rank, every rank raises it (a
    rank failing alone would leave the others waiting in the next collective)."""
    try:
        result, error = fn(*args), None
    except CheckpointError as exc:
        result, error = None, str(exc)
    errors = [e for e in _gather(error) if e]
    if errors:
        raise CheckpointError(errors[0]) from None
    return result


def _broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    dist = _dist()
    if not dist:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --------------------------------------------------------------------------------------------------
# model and optimizer state


def _torch_optimizer(optimizer: Any) -> Any:
    from torch.optim import Optimizer

    if optimizer is None or isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer")


def _is_zero(optimizer: Any) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _param_names(model: Any) -> dict[int, str]:
    """id(param) -> name as ``get_state_dict`` spells it (wrapper prefixes such as DDP's ``module.``, compile's
    ``_orig_mod.`` and activation checkpointing's removed), so ZeRO state keys match every other layout."""
    try:  # torch's own canonicalisation, the one get_state_dict uses
        from torch.distributed.checkpoint.state_dict import _get_fqns

        return {id(p): next(iter(_get_fqns(model, name))) for name, p in model.named_parameters()}
    except ImportError:  # pragma: no cover - a torch without the private helper
        from torch.nn.parallel import DistributedDataParallel

        inner = model.module if isinstance(model, DistributedDataParallel) else model
        return {id(p): name for name, p in inner.named_parameters()}


def _zero_param_groups(zero: Any, names: dict[int, str]) -> list[dict[str, Any]]:
    """The global parameter groups with every hyper-parameter (the local optimizer has the class defaults) and
    parameters as names, in the format ``get_optimizer_state_dict`` produces."""
    groups = []
    for global_group, local_group in zip(zero.param_groups, zero.optim.param_groups):
        group = {k: v for k, v in local_group.items() if k != "params"}
        group.update({k: v for k, v in global_group.items() if k != "params"})
        group["params"] = [names[id(p)] for p in global_group["params"]]
        groups.append(group)
    return groups


RANK_STATE = "torsh_zero_partition"
"""The key marking a ZeroRedundancyOptimizer ``state_dict()`` that holds one rank's partition (the pipeline engine's
ZeRO-1 writes it; the engine's ZeRO-1 wrote it before it ran on the flat partition, which still loads it)."""


def give_rank_state_dict(optimizer: Any) -> None:
    """``optimizer.state_dict()`` / ``load_state_dict()`` without a collective on a ZeroRedundancyOptimizer (ZeRO-1),
    as on DeepSpeed's ZeRO optimizer, whose ``state_dict()`` is the calling rank's partition: scripts save it on
    every rank with ``torch.save`` (DeepSpeed's ImageNet example). torch's own raises "Optimizer state has not been
    consolidated on this rank" unless ``consolidate_state_dict`` ran on every rank first; once it has, its global
    state is what ``state_dict()`` gives, as before. The partition is in torch's format (global parameter indices,
    only the state of the parameters this rank owns), so torch's ``load_state_dict`` reads it back on this rank."""
    import types

    if not _is_zero(optimizer) or "state_dict" in optimizer.__dict__:
        return
    cls = type(optimizer)

    def state_dict(self: Any) -> dict[str, Any]:
        if self._all_state_dicts:  # consolidated here: torch's global state
            return cls.state_dict(self)
        from torch.optim import Optimizer

        out = Optimizer.state_dict(self)  # the global parameter groups, parameters as global indices
        index = self._param_to_index
        out["state"] = {index[p]: dict(s) for p, s in self.optim.state.items() if s}
        out[RANK_STATE] = {"rank": self.rank, "world_size": self.world_size}
        return out

    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get(RANK_STATE) if isinstance(state_dict, dict) else None
        if saved is not None and (saved["rank"], saved["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"this optimizer state is rank {saved['rank']}'s partition of {saved['world_size']} "
                             f"ranks; load it on rank {saved['rank']} of a job of that size (this is rank "
                             f"{self.rank} of {self.world_size}), or save engine.save_checkpoint() checkpoints, "
                             "which load at any world size")  # fmt: skip
        cls.load_state_dict(self, {k: v for k, v in state_dict.items() if k != RANK_STATE})

    optimizer.state_dict = types.MethodType(state_dict, optimizer)
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)


def _zero_state_dict(zero: Any, names: dict[int, str]) -> dict[str, Any]:
    """This rank's share of a ZeroRedundancyOptimizer's state, keyed by parameter name."""
    state = {names[id(p)]: dict(s) for p, s in zero.optim.state.items() if s}
    return {"state": state, "param_groups": _zero_param_groups(zero, names)}


def _zero_load_template(zero: Any, names: dict[int, str], metadata: Any) -> dict[str, Any]:
    """Empty tensors shaped like the saved state of the parameters this rank now owns (read from DCP metadata)."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    state: dict[str, dict[str, Any]] = {}
    for group in zero.optim.param_groups:
        for p in group["params"]:
            prefix = f"optim.state.{names[id(p)]}."
            for key, md in metadata.state_dict_metadata.items():
                if not key.startswith(prefix):
                    continue
                leaf = key[len(prefix):]
                slot = state.setdefault(names[id(p)], {})
                if isinstance(md, TensorStorageMetadata):
                    slot[leaf] = torch.empty(md.size, dtype=md.properties.dtype)
                else:
                    slot[leaf] = None  # a pickled value; DCP replaces it
    return {"state": state, "param_groups": _zero_param_groups(zero, names)}


def _zero_load(zero: Any, names: dict[int, str], loaded: dict[str, Any]) -> None:
    """Install loaded name-keyed state into the local optimizer and the hyper-parameters into both groups."""
    local_groups, index, local_state = [], 0, {}
    for local_group, saved_group in zip(zero.optim.param_groups, loaded["param_groups"]):
        hyper = {k: v for k, v in saved_group.items() if k != "params"}
        ids = []
        for p in local_group["params"]:
            if names[id(p)] in loaded["state"]:
                local_state[index] = loaded["state"][names[id(p)]]
            ids.append(index)
            index += 1
        local_groups.append({**hyper, "params": ids})
    zero.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
    for global_group, local_group in zip(zero.param_groups, zero.optim.param_groups):
        global_group.update({k: v for k, v in local_group.items() if k != "params"})
