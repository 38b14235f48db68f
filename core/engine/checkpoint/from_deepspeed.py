"""Loading checkpoints written by DeepSpeed 0.19.8 into the torsh engine (ZeRO stages 0-3, any world size).

DeepSpeed's layout (``save_dir/<tag>/``)::

    mp_rank_00_model_states.pt                        # stages 0-2: module, counters, scheduler, client state
    zero_pp_rank_<r>_mp_rank_00_model_states.pt       # stage 3: the same per rank (weights are placeholders)
    [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt  # stages 1-3: rank r's flat fp32 partition + its
                                                        # optimizer state over that partition

Stage 0 keeps the torch optimizer's ``state_dict`` inside the model states. Stages 1/2 flatten each parameter
group (in ``param_shapes`` order, with ``param_alignment_paddings`` between parameters) and cut the flat vector
into one contiguous partition per rank. Stage 3 cuts every parameter into ``ceil(numel / W)`` pieces, rank r's
flat group being the concatenation of its pieces. Both are reassembled here into full tensors keyed by parameter
name (fp32 masters, and every optimizer state tensor the same way), then installed into the engine's model and
optimizer with the same calls as a torsh checkpoint, so the current world size and stage do not matter.

Under a Megatron-style ``mpu`` DeepSpeed writes the same files once per model-parallel rank, ``mp_rank_XX`` naming
the rank (``mp_rank_01_model_states.pt``, ``zero_pp_rank_<r>_mp_rank_01_optim_states.pt``), each holding that
rank's slices and ZeRO-partitioned over its data-parallel group only. Each model-parallel rank of the engine reads
the files of its own ``mp_rank_XX`` exactly as above; a checkpoint with another number of model-parallel ranks
than the engine's is refused.

Files are read with ``torch.load(weights_only=True)``; the DeepSpeed classes its pickles name (the loss scaler,
``ZeroStageEnum``, ``fragment_address``) are mapped to inert stand-ins that only keep the saved attributes, so
reading needs no DeepSpeed install and runs no code from the file. Anything that cannot be read or does not line
up with the model is a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
from pathlib import Path
from typing import Any

from .ds_model_states import model_states_file
from .io import CheckpointError
from .moe_experts import EXPERT_FILE

__all__ = ["is_deepspeed_checkpoint", "load_deepspeed_checkpoint", "load_file"]

_RANK_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")
_MP_MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
# What DeepSpeed's load_checkpoint keeps out of client_state (engine.py, _load_checkpoint).
_DEEPSPEED_KEYS = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
                   "random_ltd")  # fmt: skip


def is_deepspeed_checkpoint(path: Path) -> bool:
    """True if ``path`` holds DeepSpeed model-state files and no DCP files (a torsh checkpoint may hold DeepSpeed's
    ``mp_rank_00_model_states.pt`` too, beside its DCP ``.metadata``)."""
    return path.is_dir() and any(path.glob("*model_states.pt")) and not (path / ".metadata").is_file()


# --------------------------------------------------------------------------------------------------
# safe reading


class _Saved:
    """Stands in for a DeepSpeed object inside a checkpoint (loss scaler, fragment address): it keeps the saved
    attributes and has no behaviour."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"<saved DeepSpeed object {self.__dict__}>"


_STAND_INS: list[tuple[Any, str]] = [
    (_Saved, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Saved, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_Saved, "deepspeed.utils.tensor_fragment.fragment_address"),
    (int, "deepspeed.runtime.zero.config.ZeroStageEnum"),  # an int Enum, pickled as ZeroStageEnum(<value>)
    argparse.Namespace,  # Megatron-DeepSpeed saves its arguments (``args``): attributes only
]


def load_file(path: Any) -> dict[str, Any]:
    """One file of a DeepSpeed (or Megatron-DeepSpeed) checkpoint, read safely as :func:`load_deepspeed_checkpoint`
    reads them (``weights_only``, DeepSpeed's classes as inert stand-ins); a :class:`CheckpointError` naming the
    file when it cannot be."""
    return _load(Path(path))


def _load(path: Path) -> dict[str, Any]:
    import torch
    import torch.serialization

    if not path.is_file():  # a FIFO or device would block or never end
        raise CheckpointError(f"DeepSpeed checkpoint file {path} is missing or not a regular file")
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            try:  # memory-mapped: every rank reads every file, without holding all of them in memory
                data = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                data = torch.load(path, weights_only=True, map_location="cpu")  # the legacy (non-zip) format
    except Exception as exc:  # noqa: BLE001 - refused global, truncated zip, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path} safely (weights_only=True): "
                              f"{first}") from None  # fmt: skip
    if not isinstance(data, dict):
        raise CheckpointError(f"DeepSpeed checkpoint file {path} holds a {type(data).__name__}, not a dict")
    return data


def _need(data: dict, key: str, path: Path) -> Any:
    if key not in data:
        raise CheckpointError(f"DeepSpeed checkpoint file {path} has no '{key}' entry")
    return data[key]


# --------------------------------------------------------------------------------------------------
# the files of one checkpoint


class _Layout:
    """The files of a DeepSpeed checkpoint directory that model-parallel rank ``mp_rank`` of ``mp_size`` reads, by
    kind and data-parallel rank (DeepSpeed names every file by its model-parallel rank: ``mp_rank_XX``)."""

    def __init__(self, path: Path, mp_rank: int = 0, mp_size: int = 1) -> None:
        self.path = path
        found, mp_ranks = _files_of(path, mp_rank)
        _check_model_parallel(path, mp_ranks, mp_size)
        self.mp_size = max(mp_ranks, default=0) + 1
        optim = found["optim"]
        self.optim_files = [optim[r] for r in sorted(optim)]
        if not _ranks_complete(optim):
            raise CheckpointError(f"DeepSpeed checkpoint {path} is incomplete: optimizer files for ranks "
                                  f"{sorted(optim)} (expected 0..{len(optim) - 1})")  # fmt: skip
        self.model_files = _model_files(path, found, model_states_file(mp_rank))


def _files_of(path: Path, mp_rank: int) -> tuple[dict[str, dict[int, Path]], set[int]]:
    """The files of model-parallel rank ``mp_rank`` by kind and data-parallel rank, and every model-parallel rank
    that has files."""
    found: dict[str, dict[int, Path]] = {"model": {}, "optim": {}, "single": {}}
    mp_ranks: set[int] = set()
    for file in path.iterdir():
        kind = _rank_file(file)
        if kind is not None:
            mp_ranks.add(kind[2])
            if kind[2] == mp_rank:
                found[kind[0]][kind[1]] = file
    return found, mp_ranks


def _model_files(path: Path, found: dict[str, dict[int, Path]], name: str) -> list[Path]:
    """The model-states file ``name`` (stages 0-2), else the per-data-parallel-rank files (stage 3)."""
    model = found["model"]
    if found["single"]:
        return [path / name]
    if not model:
        raise CheckpointError(f"DeepSpeed checkpoint {path} has no {name}")
    if not _ranks_complete(model):
        raise CheckpointError(f"DeepSpeed checkpoint {path} is incomplete: model files for ranks "
                              f"{sorted(model)}")  # fmt: skip
    return [model[r] for r in sorted(model)]


def _rank_file(file: Path) -> tuple[str, int, int] | None:
    """``(kind, data-parallel rank, model-parallel rank)`` for a model- or optimizer-state file of DeepSpeed's
    (kind ``"single"``: a stage 0-2 ``mp_rank_XX_model_states.pt``; ``"model"`` / ``"optim"``: a data-parallel
    rank's file), None for any other file; the files of a pipeline-parallel checkpoint are refused."""
    match = _RANK_FILE.match(file.name)
    if match:
        return match.group(3), int(match.group(1)), int(match.group(2))
    match = _MP_MODEL_FILE.match(file.name)
    if match:
        return "single", 0, int(match.group(1))
    if EXPERT_FILE.match(file.name):  # an MoE expert's weights (read by moe_experts)
        return None
    if file.name.endswith("model_states.pt"):
        raise CheckpointError(f"{file} is not a DeepSpeed data-parallel checkpoint file nor a model-parallel "
                              f"rank's (mp_rank_XX); pipeline checkpoints cannot be loaded")  # fmt: skip
    return None


def _check_model_parallel(path: Path, mp_ranks: set[int], mp_size: int) -> None:
    """The checkpoint holds the files of model-parallel ranks 0..mp_size-1, as many as the engine has (torsh
    neither merges nor splits the slices of a model-parallel layer)."""
    if not mp_ranks or sorted(mp_ranks) == list(range(mp_size)):
        return
    if sorted(mp_ranks) != list(range(len(mp_ranks))):
        raise CheckpointError(f"DeepSpeed checkpoint {path} is incomplete: it holds the files of model-parallel "
                              f"ranks {sorted(mp_ranks)} (mp_rank_XX), expected 0..{max(mp_ranks)}")  # fmt: skip
    saved = len(mp_ranks)
    how = ("initialize the engine with the Megatron-style mpu it was saved under (mpu=..., model-parallel size "
           f"{saved})") if mp_size == 1 else f"initialize the engine with an mpu of model-parallel size {saved}"
    raise CheckpointError(f"the DeepSpeed checkpoint {path} holds the files of {saved} model-parallel rank(s) "
                          f"(mp_rank_00..mp_rank_{saved - 1:02d}) but this engine has model-parallel size {mp_size}: "
                          f"{how}; torsh does not merge or split model-parallel slices")  # fmt: skip


def _ranks_complete(files: dict[int, Path]) -> bool:
    """The ranks are 0..n-1 without a gap."""
    return sorted(files) == list(range(len(files)))


# --------------------------------------------------------------------------------------------------
# reassembling full tensors


def _numel(shape: Any) -> int:
    return int(math.prod(shape))


def _split_stage12(flats: list[Any], shapes: dict[str, Any], paddings: list[int] | None, where: str
                   ) -> dict[str, Any]:  # fmt: skip
    """Full tensors from one parameter group's per-rank contiguous partitions (ZeRO-1/2)."""
    import torch

    full = torch.cat([f.reshape(-1) for f in flats])
    out, offset = {}, 0
    if paddings is not None and len(paddings) != len(shapes):
        raise CheckpointError(f"{where}: {len(paddings)} alignment paddings for {len(shapes)} parameters")
    for i, (name, shape) in enumerate(shapes.items()):
        n = _numel(shape)
        if offset + n > full.numel():
            raise CheckpointError(f"{where}: the flat partitions hold {full.numel()} values, fewer than the "
                                  f"parameters need (at {name})")  # fmt: skip
        out[name] = full.narrow(0, offset, n).view(shape)
        offset += n + (paddings[i] if paddings else 0)
    return out


def _split_stage3(flats: list[Any], shapes: dict[str, Any], where: str) -> dict[str, Any]:
    """Full tensors from per-rank flat groups in which each parameter has a ceil(numel / W) piece (ZeRO-3)."""
    import torch

    world = len(flats)
    out, offset = {}, 0
    for name, shape in shapes.items():
        n = _numel(shape)
        piece = math.ceil(n / world)
        if offset + piece > flats[0].numel():
            raise CheckpointError(f"{where}: the flat partitions are too short for the parameters (at {name})")
        out[name] = torch.cat([f.narrow(0, offset, piece) for f in flats])[:n].view(shape)
        offset += piece
    if any(f.numel() != offset for f in flats):
        raise CheckpointError(f"{where}: the flat partitions hold {flats[0].numel()} values per rank, the parameters "
                              f"{offset}; the checkpoint does not match its param_shapes")  # fmt: skip
    return out


def _per_param_state(flat_states: list[dict[str, Any]], split: Any, names: list[str], where: str
                     ) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per-parameter optimizer state from per-rank states over flat partitions: tensors as long as the
    partition are cut like the weights, scalars (``step``) are given to every parameter."""
    if not flat_states or not flat_states[0]:
        return {}
    state: dict[str, dict[str, Any]] = {name: {} for name in names}
    for key in flat_states[0]:
        for name, value in _one_key_per_param(flat_states, key, split, names).items():
            state[name][key] = value
    return state


def _one_key_per_param(flat_states: list[dict[str, Any]], key: str, split: Any, names: list[str]
                       ) -> dict[str, Any]:  # fmt: skip
    """One optimizer state entry for each parameter: a tensor over the flat partition cut like the weights, a
    scalar copied to each."""
    import torch

    value = flat_states[0][key]
    if torch.is_tensor(value) and value.dim() > 0:
        pieces = split([s[key] for s in flat_states])
        return {name: pieces[name].clone() for name in names}
    return {name: value.clone() if torch.is_tensor(value) else value for name in names}


class _Restored:
    """A DeepSpeed checkpoint reassembled: full fp32 weights and buffers, per-parameter optimizer state and
    hyper-parameters keyed by name, and the engine-level states."""

    def __init__(self) -> None:
        self.weights: dict[str, Any] = {}
        self.optim_state: dict[str, dict[str, Any]] = {}
        self.hyper: dict[str, dict[str, Any]] = {}  # name -> the hyper-parameters of its DeepSpeed group
        self.loss_scaler: Any = None
        self.model_states: dict[str, Any] = {}
        self.model_file: Path = Path()
        self.stage0: dict[str, Any] | None = None  # stage 0: the torch optimizer state, indexed by position
        self.aliases: dict[str, str] = {}  # a tied parameter's other names -> the name it was saved under first


def _read(layout: _Layout, with_optimizer: bool, experts: Any = None) -> _Restored:
    out = _Restored()
    out.model_file = layout.model_files[0]
    ms = out.model_states = _load(out.model_file)
    module = _need(ms, "module", out.model_file)
    _check_saved_mp_size(ms, layout, out.model_file)
    out.aliases = _tied_names(module)
    if _holds_experts(ms, experts):
        _read_moe(layout, out, with_optimizer, experts)
        return out
    buffers = set(ms.get("buffer_names") or [])
    out.weights.update({k: v for k, v in module.items() if k in buffers})
    if not layout.optim_files:  # stage 0: weights and the torch optimizer live in the model states
        out.weights.update({k: v for k, v in module.items() if k not in buffers})
        optimizer = ms.get("optimizer")
        if with_optimizer and optimizer is not None:
            _read_stage0_optimizer(optimizer, out, out.model_file)
        return out
    _read_partitioned(layout, ms, out, with_optimizer)
    _frozen(ms, layout, out)
    _shared_params(ms, out)
    return out


def _check_saved_mp_size(ms: dict[str, Any], layout: _Layout, file: Path) -> None:
    """The model-parallel ranks with files are as many as the saved ``mp_world_size`` (DeepSpeed's check)."""
    saved = ms.get("mp_world_size")
    if isinstance(saved, int) and saved != layout.mp_size:
        raise CheckpointError(f"{file}: checkpoint count {layout.mp_size} is different from saved mp_world_size "
                              f"{saved}; the checkpoint is incomplete")  # fmt: skip


def _holds_experts(ms: dict[str, Any], experts: Any) -> bool:
    """The checkpoint or the model has MoE layers (DeepSpeed's ``num_experts`` entry; the model's layers)."""
    return experts is not None or "num_experts" in ms


def _read_moe(layout: _Layout, out: _Restored, with_optimizer: bool, experts: Any) -> None:
    """A model with MoE layers (DeepSpeed's ``_save_moe_checkpoint``): the module without the experts, this
    rank's experts from their files, and at stage 0 the optimizer state of this rank's ``expp_rank`` file."""
    from .moe_experts import optimizer_file

    ms, file = out.model_states, out.model_file
    if experts is None or "num_experts" not in ms:
        which = "holds MoE experts and this model has no MoE layers" if experts is None else (
            "has no MoE experts (no 'num_experts') and this model has MoE layers")
        raise CheckpointError(f"the DeepSpeed checkpoint {layout.path} {which}; load it into the model it was "
                              "saved from")  # fmt: skip
    experts.check_saved(ms, file)
    out.weights.update(ms["module"])
    out.weights.update(experts.read_experts(layout.path, _load))
    if not with_optimizer:
        return
    if layout.optim_files:
        raise CheckpointError(f"the optimizer state of the DeepSpeed MoE checkpoint {layout.path} (ZeRO stage 1-2: "
                              "each expert group partitioned over its own ranks) is not read by the torsh engine; "
                              "load it with load_optimizer_states=False or load_module_only=True (the weights load, "
                              "the optimizer starts afresh)")  # fmt: skip
    optim = layout.path / optimizer_file(experts.ep_rank)
    if not optim.is_file():
        raise CheckpointError(f"the DeepSpeed MoE checkpoint {layout.path} has no {optim.name} (the optimizer state "
                              "of this rank's experts); load it with load_optimizer_states=False")  # fmt: skip
    _read_stage0_optimizer(_need(_load(optim), "optimizer", optim), out, optim)


def _read_partitioned(layout: _Layout, ms: dict[str, Any], out: _Restored, with_optimizer: bool) -> None:
    """Stages 1-3: the fp32 masters and optimizer state from the per-rank optimizer files, by the stage's
    reader."""
    shapes_by_group = _need(ms, "param_shapes", out.model_file)
    optim = [_need(_load(f), "optimizer_state_dict", f) for f in layout.optim_files]
    first = layout.optim_files[0]
    stage = int(_need(optim[0], "zero_stage", first))
    counts = optim[0].get("partition_count")
    count = max(counts) if isinstance(counts, list) else counts
    if count != len(optim):
        raise CheckpointError(f"DeepSpeed checkpoint {layout.path} was written by {count} ranks but has "
                              f"{len(optim)} optimizer files")  # fmt: skip
    reader = _STAGE_READERS.get(stage)
    if reader is None:
        raise CheckpointError(f"{first}: unknown ZeRO stage {stage}")
    reader(optim, shapes_by_group, out, with_optimizer, layout)
    scaler = optim[0].get("loss_scaler")
    if isinstance(scaler, _Saved) and getattr(scaler, "dynamic", False):
        out.loss_scaler = dict(scaler.__dict__)


def _shared_params(ms: dict[str, Any], out: _Restored) -> None:
    """Tied weights DeepSpeed saved once (``shared_params``: alias -> source) get the source's value."""
    for alias, source in (ms.get("shared_params") or {}).items():
        if source in out.weights:
            out.weights.setdefault(alias, out.weights[source])
            out.aliases.setdefault(alias, source)


def _tied_names(module: dict[str, Any]) -> dict[str, str]:
    """The names under which the module states hold a tensor already held under an earlier name: a tied weight
    (``lm_head.decoder.weight`` *is* the word embeddings), which ``torch.save`` keeps as one storage."""
    import torch

    first: dict[tuple, str] = {}
    aliases = {}
    for name, value in module.items():
        if not torch.is_tensor(value) or value.numel() == 0:
            continue
        where = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride())
        if where in first:
            aliases[name] = first[where]
        else:
            first[where] = name
    return aliases


def _read_checked(path: Path, with_optimizer: bool, experts: Any = None, model_parallel: tuple[int, int] = (0, 1)
                  ) -> _Restored:  # fmt: skip
    """:func:`_read` of the files of model-parallel rank ``model_parallel[0]`` of ``model_parallel[1]``, with any
    surprise in the files' structure reported as a CheckpointError naming them."""
    try:
        return _read(_Layout(path, *model_parallel), with_optimizer, experts)
    except CheckpointError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError, IndexError, RuntimeError) as exc:
        raise CheckpointError(f"the DeepSpeed checkpoint {path} does not have the layout DeepSpeed 0.19.8 writes "
                              f"({type(exc).__name__}: {exc})") from None  # fmt: skip


def _read_stage0_optimizer(optimizer: dict[str, Any], out: _Restored, file: Path) -> None:
    """Stage 0: a torch ``state_dict`` indexed by position (fp32), or DeepSpeed's fp16/bf16 wrapper around one
    with the fp32 masters in ``fp32_groups``."""
    inner = optimizer.get("optimizer_state_dict", optimizer)
    if "state" not in inner or "param_groups" not in inner:
        raise CheckpointError(f"{file}: the optimizer entry is not a torch optimizer state_dict")
    groups = inner["param_groups"]
    out.stage0 = {"order": _flatten([group["params"] for group in groups]), "state": inner["state"],
                  "groups": groups, "group_of": _group_of(groups),
                  "masters": _flatten(optimizer.get("fp32_groups") or [])}  # fmt: skip
    if optimizer.get("dynamic_loss_scale"):
        out.loss_scaler = {k: optimizer[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter")
                           if k in optimizer}  # fmt: skip


def _group_of(param_groups: list[dict[str, Any]]) -> dict[int, int]:
    """Parameter index -> the position of its group, in the groups' order of parameters."""
    return {i: g for g, group in enumerate(param_groups) for i in group["params"]}


def _flatten(groups: list[list[Any]]) -> list[Any]:
    return [t for group in groups for t in group]


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's hyper-parameters: everything but its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def _read_stage12(optim: list[dict], shapes_by_group: list[dict], out: _Restored, with_optimizer: bool,
                  layout: _Layout) -> None:  # fmt: skip
    first = layout.optim_files[0]
    partitions = [_need(o, "single_partition_of_fp32_groups", first) for o in optim]
    paddings = optim[0].get("param_alignment_paddings")
    if len(partitions[0]) != len(shapes_by_group):
        raise CheckpointError(f"{first}: {len(partitions[0])} flat groups for {len(shapes_by_group)} parameter "
                              f"groups in {layout.model_files[0]}")  # fmt: skip
    for g, shapes in enumerate(shapes_by_group):
        where = f"{layout.path} (parameter group {g})"
        split = functools.partial(_split_stage12, shapes=shapes, paddings=paddings[g] if paddings else None,
                                  where=where)  # fmt: skip
        out.weights.update(split([p[g] for p in partitions]))
        if not with_optimizer:
            continue
        states, hyper = _stage12_group_state(optim, g, first)
        names = list(shapes)
        out.optim_state.update(_per_param_state(states, split, names, where))
        out.hyper.update({name: hyper for name in names})


def _stage12_group_state(optim: list[dict], g: int, first: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each rank's optimizer state over its partition of group ``g``, and the group's hyper-parameters."""
    base = [_need(o, "base_optimizer_state", first) for o in optim]
    if isinstance(base[0], dict):  # a torch state_dict over the flat partition, one parameter per group
        return [b["state"].get(g, {}) for b in base], _hyper(base[0]["param_groups"][g])
    # elastic: a list of per-group states without padding, the step stored beside it
    states = [dict(b[g]) for b in base]
    step = optim[0].get("base_optimizer_state_step")
    if step is not None:
        for s in states:
            s.setdefault("step", step)
    return states, {}


def _read_stage3(optim: list[dict], shapes_by_group: list[dict], out: _Restored, with_optimizer: bool,
                 layout: _Layout) -> None:  # fmt: skip
    import torch

    first = layout.optim_files[0]
    shapes = {name: shape for group in shapes_by_group for name, shape in group.items()}
    flats_per_rank = [_need(o, "fp32_flat_groups", first) for o in optim]
    where = str(layout.path)
    split = functools.partial(_split_stage3, shapes=shapes, where=where)
    out.weights.update(split([torch.cat([f.reshape(-1) for f in flats]) for flats in flats_per_rank]))
    if with_optimizer:
        _read_stage3_optimizer(optim, flats_per_rank, shapes, split, out, first, where)


def _read_stage3_optimizer(optim: list[dict], flats_per_rank: list[list[Any]], shapes: dict[str, Any], split: Any,
                           out: _Restored, first: Path, where: str) -> None:  # fmt: skip
    """Stage 3's optimizer state: per rank one state per sub-group, merged over the rank's flat partition and
    cut like the weights; the hyper-parameters by sub-group."""
    inner = [_need(o, "optimizer_state_dict", first) for o in optim]
    keys = {k for s in inner[0]["state"].values() for k in s}
    per_rank = [_stage3_rank_state(rank_sd["state"], len(flats), keys)
                for rank_sd, flats in zip(inner, flats_per_rank)]  # fmt: skip
    out.optim_state.update(_per_param_state(per_rank, split, list(shapes), where))
    sub_sizes = [f.numel() for f in flats_per_rank[0]]
    out.hyper.update(_stage3_hyper(shapes, sub_sizes, inner[0].get("param_groups") or [], len(optim)))


def _stage3_rank_state(state: dict[int, dict[str, Any]], sub_groups: int, keys: set[str]) -> dict[str, Any]:
    """One rank's optimizer state over its whole flat partition: each tensor the concatenation of its
    sub-groups' (a scalar such as ``step`` is the first sub-group's)."""
    import torch

    merged: dict[str, Any] = {}
    for key in keys:
        values = [state.get(i, {}).get(key) for i in range(sub_groups)]
        if all(torch.is_tensor(v) and v.dim() > 0 for v in values):
            merged[key] = torch.cat([v.reshape(-1) for v in values])
        else:
            merged[key] = values[0]
    return merged


def _stage3_hyper(shapes: dict[str, Any], sub_sizes: list[int], groups: list[dict[str, Any]], world: int
                  ) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Each parameter takes the hyper-parameters of the sub-group its piece lies in."""
    hyper = {}
    sub, consumed = 0, 0
    for name, shape in shapes.items():
        while sub < len(sub_sizes) - 1 and consumed >= sub_sizes[sub]:
            consumed -= sub_sizes[sub]
            sub += 1
        if sub < len(groups):
            hyper[name] = _hyper(groups[sub])
        consumed += math.ceil(_numel(shape) / world)
    return hyper


_STAGE_READERS = {1: _read_stage12, 2: _read_stage12, 3: _read_stage3}


def _frozen(ms: dict[str, Any], layout: _Layout, out: _Restored) -> None:
    """Parameters without gradients: full in ``module`` at stages 1/2, in per-rank fragments at stage 3."""
    import torch

    frozen = ms.get("frozen_param_shapes") or {}
    if not frozen:
        return
    module = ms["module"]
    if len(layout.model_files) == 1:
        out.weights.update({name: module[name] for name in frozen if name in module})
        return
    fragments = [_need(_load(f), "frozen_param_fragments", f) for f in layout.model_files]
    for name, shape in frozen.items():
        out.weights[name] = torch.cat([f[name].reshape(-1) for f in fragments])[:_numel(shape)].view(shape)


# --------------------------------------------------------------------------------------------------
# installing into the engine


def load_deepspeed_checkpoint(path: Path, *, model: Any, optimizer: Any, lr_scheduler: Any, loss_scaler: Any,
                              strict: bool, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                              load_module_only: bool, experts: Any = None, model_parallel: tuple[int, int] = (0, 1)
                              ) -> tuple[str, dict, dict | None]:  # fmt: skip
    """Load the DeepSpeed checkpoint directory ``path`` (one tag) into the engine's model and optimizer.

    Returns ``(model states file, client_state, engine_state)`` like DeepSpeed's ``load_checkpoint``: the
    client state is every entry of the model states that DeepSpeed does not consume itself. ``experts``: the
    model's MoE layers (:class:`~torsh.engine.checkpoint.moe_experts.ExpertCheckpoint`), whose expert files it
    reads. ``model_parallel``: ``(model-parallel rank, model-parallel size)`` of this rank under a Megatron-style
    mpu; each model-parallel rank reads its own ``mp_rank_XX`` files (DeepSpeed's names), whose number must be the
    size.
    """
    from .state import _on_every_rank, _torch_optimizer

    optimizer = _torch_optimizer(optimizer) if load_optimizer_states and not load_module_only else None
    # every rank reads the files (a failure on one rank is raised on all, before any collective)
    restored = _on_every_rank(_read_checked, path, optimizer is not None, experts, model_parallel)
    _install(restored, model, optimizer, strict=strict, file=restored.model_file)
    ms = restored.model_states
    engine_state = None
    if not load_module_only:
        _load_scheduler(restored, lr_scheduler if load_lr_scheduler_states else None)
        _load_loss_scaler(restored, loss_scaler if optimizer is not None else None)
        engine_state = {k: ms[k] for k in ("global_steps", "global_samples", "skipped_steps", "dp_world_size",
                                           "mp_world_size") if k in ms}  # fmt: skip
    client_state = _client_state(restored, load_module_only=load_module_only,
                                 load_lr_scheduler_states=load_lr_scheduler_states,
                                 load_optimizer_states=load_optimizer_states,
                                 optimizer_loaded=optimizer is not None)  # fmt: skip
    return str(restored.model_file), client_state, engine_state


def _load_scheduler(restored: _Restored, lr_scheduler: Any) -> None:
    saved = restored.model_states.get("lr_scheduler")
    if lr_scheduler is None or saved is None:
        return
    try:
        lr_scheduler.load_state_dict(saved)
    except Exception as exc:  # noqa: BLE001 - another scheduler than the one saved
        raise CheckpointError(f"the lr_scheduler state in {restored.model_file} does not fit this job's "
                              f"scheduler {type(lr_scheduler).__name__}: {exc}") from None  # fmt: skip


def _load_loss_scaler(restored: _Restored, loss_scaler: Any) -> None:
    """The saved dynamic loss scale, over the keys this job's scaler has (a key saved as None keeps its value)."""
    if loss_scaler is None or not restored.loss_scaler:
        return
    current = loss_scaler.state_dict()
    current.update({k: v for k, v in restored.loss_scaler.items() if k in current and v is not None})
    loss_scaler.load_state_dict(current)


def _client_state(restored: _Restored, *, load_module_only: bool, load_lr_scheduler_states: bool,
                  load_optimizer_states: bool, optimizer_loaded: bool) -> dict[str, Any]:  # fmt: skip
    """client_state as DeepSpeed returns it: every entry of the model states it does not consume itself."""
    ms = restored.model_states
    excluded = {"module"} if load_module_only else set(_DEEPSPEED_KEYS)
    if load_lr_scheduler_states:
        excluded.add("lr_scheduler")
    if load_optimizer_states:
        excluded.add("optimizer")
    client_state = {k: v for k, v in ms.items() if k not in excluded}
    if restored.stage0 is not None and optimizer_loaded:
        client_state["optimizer"] = ms["optimizer"]  # DeepSpeed hands stage 0's optimizer state back too
    return client_state


def _install(restored: _Restored, model: Any, optimizer: Any, *, strict: bool, file: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from .state import _param_names

    names = _param_names(model)
    if restored.stage0 is not None and optimizer is not None:
        # DeepSpeed's optimizer state_dict numbers the parameters in its param_groups' order (the same groups as
        # this optimizer's), not the model's: a no-decay group first puts the biases before the weights
        _stage0_to_names(restored, [names[id(p)] for g in optimizer.param_groups for p in g["params"]], file)
    weights = dict(restored.weights)
    _check_keys(model, weights, strict, file, restored.aliases)
    options = StateDictOptions(full_state_dict=True, strict=strict)
    try:
        _set_states(restored, model, optimizer, names, weights, options)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - shapes or names that do not fit this model
        raise CheckpointError(f"the DeepSpeed checkpoint {file.parent} does not fit this model: {exc}") from None


def _set_states(restored: _Restored, model: Any, optimizer: Any, names: dict[int, str], weights: dict[str, Any],
                options: Any) -> None:  # fmt: skip
    """The weights into the model and, with an optimizer, the state into it: a ZeRO optimizer by its own load,
    a torch optimizer together with the model."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    from .state import _is_zero, _zero_load, _zero_param_groups

    if optimizer is None:
        set_model_state_dict(model, weights, options=options)
        return
    if _is_zero(optimizer):
        set_model_state_dict(model, weights, options=options)
        groups = _with_hyper(_zero_param_groups(optimizer, names), restored)
        _zero_load(optimizer, names, {"state": restored.optim_state, "param_groups": groups})
        return
    groups = [{**_hyper(g), "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    osd = {"state": restored.optim_state, "param_groups": _with_hyper(groups, restored)}
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=osd, options=options)


def _check_keys(model: Any, weights: dict[str, Any], strict: bool, file: Path, aliases: dict[str, str]) -> None:
    """With ``strict`` (DeepSpeed's ``load_module_strict``) the checkpoint and the model must hold the same
    names; otherwise what the model lacks is dropped and what the checkpoint lacks keeps its current value.
    Another name of a tied weight the model holds under its first name (the engine's fp32 masters name each
    parameter once) is the same value, not an extra one: it is dropped, as loading it would write that value twice."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    expected = set(get_model_state_dict(model))
    for alias in [a for a, source in aliases.items() if a in weights and a not in expected and source in expected]:
        del weights[alias]
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if strict and (missing or unexpected):
        raise CheckpointError(f"the DeepSpeed checkpoint {file.parent} does not fit this model: it "
                              f"{_mismatch(missing, unexpected)} (load_module_strict=False loads what "
                              f"matches)")  # fmt: skip
    for name in unexpected:
        del weights[name]


def _mismatch(missing: list[str], unexpected: list[str]) -> str:
    """``has no values for a, b and has values this model lacks: c`` (up to 8 names each)."""
    parts = [f"{label} {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
             for label, names in (("has no values for", missing), ("has values this model lacks:", unexpected))
             if names]  # fmt: skip
    return " and ".join(parts)


def _stage0_to_names(restored: _Restored, ordered: list[str], file: Path) -> None:
    """Stage 0 optimizer state is indexed by position in the optimizer's parameter groups, one after the other
    (``ordered``: the names in that order). Checked against the shapes so a different order is an error, not
    silently wrong state."""
    info = restored.stage0
    if len(info["order"]) != len(ordered):
        raise CheckpointError(f"{file}: the optimizer holds {len(info['order'])} parameters, the model "
                              f"{len(ordered)}; it was saved for another model or parameter grouping")  # fmt: skip
    for position, index in enumerate(info["order"]):
        name = ordered[position]
        if info["masters"]:
            restored.weights[name] = info["masters"][position]
        state = _stage0_state(info["state"].get(index, {}), restored.weights.get(name), index, name, file)
        if state:
            restored.optim_state[name] = state
        restored.hyper[name] = _hyper(info["groups"][info["group_of"][index]])


def _stage0_state(saved: dict[str, Any], weight: Any, index: int, name: str, file: Path) -> dict[str, Any]:
    """One parameter's stage-0 optimizer state, cloned (the optimizer keeps these tensors, which would otherwise
    stay views of the memory-mapped file), each tensor state checked against the parameter's shape."""
    state = {k: v.clone() if hasattr(v, "clone") else v for k, v in saved.items()}
    for key, value in state.items():
        if hasattr(value, "dim") and value.dim() > 0 and weight is not None and value.shape != weight.shape:
            raise CheckpointError(f"{file}: optimizer state '{key}' of parameter #{index} has shape "
                                  f"{tuple(value.shape)} but {name} is {tuple(weight.shape)}; the order of "
                                  f"parameters differs from this model's")  # fmt: skip
    return state


def _with_hyper(groups: list[dict[str, Any]], restored: _Restored) -> list[dict[str, Any]]:
    """The engine's parameter groups with the hyper-parameters DeepSpeed saved for their parameters (only the
    keys the engine's optimizer has, so another optimizer class keeps its own options)."""
    out = []
    for group in groups:
        saved = restored.hyper.get(group["params"][0], {}) if group["params"] else {}
        out.append({**group, **{k: v for k, v in saved.items() if k in group and k != "params"}})
    return out
