"""Checkpoints of a model with DeepSpeed MoE layers: DeepSpeed's files for the experts, and the renaming that lets
the ranks' different experts share one set of DCP files.

DeepSpeed 0.19.8 (``DeepSpeedEngine._save_moe_checkpoint`` / ``load_moe_state_dict``) saves a model with MoE
layers as:

- ``mp_rank_00_model_states.pt`` (data-parallel rank 0): the module state *without* the experts (a key of an MoE
  layer naming ``expert``, the router ``deepspeed_moe.gate.wg.weight`` excepted), with ``num_experts`` (one entry
  per MoE layer);
- ``layer_<L>_expert_<E>_mp_rank_00_model_states.pt``: expert ``E`` (its global id) of the ``L``-th MoE layer (in
  ``named_modules`` order), written by the first rank of each expert-data-parallel group; its keys are the
  module's with the local expert id replaced by the global one (``expert-parallel rank * local experts + local
  id``);
- stage 0: ``expp_rank_<r>_mp_rank_00_optim_states.pt`` (``{"optimizer": state_dict}``), one per expert-parallel
  rank; stages 1-2: the ZeRO optimizer files of every rank.

A torsh checkpoint keeps its model and optimizer state in DCP files. Each rank's local experts are saved there
under their global names too (:meth:`ExpertCheckpoint.global_names`): ranks of one expert-parallel group hold
different tensors under the same local name, which one set of DCP files could keep only once; under the global
name each expert is one entry, written once by the ranks that hold it. Loading asks for this rank's global
names and renames them back. Beside the DCP files torsh writes DeepSpeed's model-states and expert files, so
DeepSpeed loads the weights (``load_module_only`` / ``load_optimizer_states=False``), and at stage 0 with a plain
torch optimizer the ``expp_rank`` optimizer files too (the optimizer state the model-states file holds as well, see
:func:`~torsh.engine.checkpoint.ds_model_states.stage0_optimizer_state`), so DeepSpeed loads the optimizer state.

A DeepSpeed checkpoint of a model with MoE layers loads into the torsh engine (:meth:`ExpertCheckpoint.merge`):
the module state with this rank's experts read from their files; the stage-0 optimizer state from this rank's
``expp_rank`` file.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .ds_model_states import cpu_copy, stage0_optimizer_state
from .io import CheckpointError

EXPERT_FILE = re.compile(r"^(?:layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt$")
"""A DeepSpeed expert file (``layer_<L>_expert_<E>_...``; DeepSpeed before 0.6 wrote ``expert_<E>_...``)."""
EXPERT_OPTIM_FILE = re.compile(r"^expp_rank_\d+_mp_rank_\d+_optim_states\.pt$")
_KEY = re.compile(r"^(?P<head>.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(?P<id>\d+)(?P<tail>\..*)$")
_GATE = "moe.gate.wg.weight"


@dataclass(frozen=True)
class _Layer:
    """One MoE layer as DeepSpeed's checkpoint sees it."""

    index: int
    prefix: str  # its module path with a trailing dot ("" for the root)
    num_local: int
    ep_rank: int
    writer: bool  # the first rank of its expert-data-parallel group: writes its expert files

    def first(self) -> int:
        """The global id of this rank's first expert."""
        return self.ep_rank * self.num_local


def _rank_in(group: Any) -> int:
    """This rank's rank in ``group`` (0 without one or without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def expert_file(layer: int, expert: int, mp_rank: int = 0) -> str:
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def optimizer_file(ep_rank: int, mp_rank: int = 0) -> str:
    return f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


class ExpertCheckpoint:
    """The MoE layers of ``module`` (``layers``: the plan's, modules with ``num_local_experts`` and
    ``expert_group_name``), with this rank's place in their expert groups."""

    def __init__(self, module: Any, layers: list) -> None:
        from ..parallel.moe import EXPERT_DATA_PARALLEL, EXPERT_PARALLEL

        ids = {id(m) for m in layers}
        self.layers: list[_Layer] = []
        self.max_group = max((m.expert_group_name for m in layers), key=lambda n: int(n.rsplit("_", 1)[1]),
                             default=None)  # fmt: skip
        for name, m in module.named_modules():
            if id(m) not in ids:
                continue
            group = m.expert_group_name
            writer = _rank_in(EXPERT_DATA_PARALLEL.get(group)) == 0
            self.layers.append(_Layer(len(self.layers), f"{name}." if name else "", m.num_local_experts,
                                      _rank_in(EXPERT_PARALLEL.get(group)), writer))  # fmt: skip
        self.ep_rank = _rank_in(EXPERT_PARALLEL.get(self.max_group))
        """This rank's place in the largest expert-parallel group (DeepSpeed's ``expp_rank`` files)."""
        self.writes_optimizer = _rank_in(EXPERT_DATA_PARALLEL.get(self.max_group)) == 0
        self.num_experts = [m.num_experts for m in layers]

    # ---- names

    def _layer_of(self, key: str) -> _Layer | None:
        """The MoE layer whose expert ``key`` names (DeepSpeed's rule), None for any other key."""
        for layer in self.layers:
            if key.startswith(layer.prefix) and "expert" in key[len(layer.prefix):] and _GATE not in key:
                return layer
        return None

    def is_expert(self, key: str) -> bool:
        return self._layer_of(key) is not None

    def global_name(self, key: str) -> str:
        """``key`` with its local expert id replaced by the global one (other keys unchanged)."""
        layer = self._layer_of(key)
        match = _KEY.match(key) if layer is not None else None
        if match is None:
            return key
        return f"{match['head']}{layer.first() + int(match['id'])}{match['tail']}"

    def global_names(self, keys: Any) -> dict[str, str]:
        """local -> global name of each expert key of ``keys`` whose name changes."""
        return {k: g for k in keys if (g := self.global_name(k)) != k}

    def local_name(self, key: str) -> str | None:
        """The local name of a global expert key, None when another rank holds that expert."""
        layer = self._layer_of(key)
        match = _KEY.match(key) if layer is not None else None
        if match is None:
            return key
        local = int(match["id"]) - layer.first()
        return f"{match['head']}{local}{match['tail']}" if 0 <= local < layer.num_local else None

    # ---- DeepSpeed's files

    def non_expert(self, state: dict) -> OrderedDict:
        """``state`` without the expert entries (the module of DeepSpeed's ``mp_rank_00_model_states.pt``)."""
        return OrderedDict((k, v) for k, v in state.items() if not self.is_expert(k))

    def expert_files(self, state: dict) -> dict[str, dict]:
        """DeepSpeed's expert files this rank writes (file name -> {global key: CPU tensor}): those of the layers
        where it is the first rank of the expert-data-parallel group."""
        files: dict[str, dict] = {}
        for key, value in state.items():
            layer = self._layer_of(key)
            match = _KEY.match(key) if layer is not None else None
            if match is None or not layer.writer:
                continue
            expert = layer.first() + int(match["id"])
            files.setdefault(expert_file(layer.index, expert), {})[self.global_name(key)] = cpu_copy(value)
        return files

    def read_experts(self, path: Path, load: Any) -> dict[str, Any]:
        """This rank's experts from DeepSpeed's expert files in ``path``, under their local names (``load``:
        reads one file safely)."""
        out: dict[str, Any] = {}
        for layer in self.layers:
            for local in range(layer.num_local):
                file = path / expert_file(layer.index, layer.first() + local)
                if not file.is_file():
                    raise CheckpointError(f"the DeepSpeed MoE checkpoint {path} has no {file.name} (expert "
                                          f"{layer.first() + local} of MoE layer {layer.index}); it was saved for "
                                          "another number of experts or expert-parallel size")  # fmt: skip
                for key, value in load(file).items():
                    local_key = self.local_name(key)
                    if local_key is None:
                        raise CheckpointError(f"{file} holds {key}, not an expert of this rank's")
                    out[local_key] = value
        return out

    def check_saved(self, model_states: dict, file: Path) -> None:
        """A DeepSpeed MoE checkpoint must have been saved with this model's experts per layer."""
        saved = model_states.get("num_experts")
        if isinstance(saved, list) and saved != self.num_experts:
            raise CheckpointError(f"{file} was saved with num_experts {saved} per MoE layer; this model has "
                                  f"{self.num_experts}")  # fmt: skip


def rename_state(state: dict, names: dict[str, str] | None) -> dict:
    """``{"model": ..., "optim": {"state": ...}}`` (DCP's state) with the model keys and the optimizer's
    per-parameter state keys renamed by ``names`` (the optimizer's ``param_groups`` keep the local names: they are
    the same on every rank, and DCP keeps one copy of them)."""
    if not names:
        return state
    out = dict(state)
    out["model"] = {names.get(k, k): v for k, v in state["model"].items()}
    optim = state.get("optim")
    if isinstance(optim, dict) and isinstance(optim.get("state"), dict):
        out["optim"] = {**optim, "state": {names.get(k, k): v for k, v in optim["state"].items()}}
    return out


# --------------------------------------------------------------------------------------------------
# the engine's side


def engine_experts(engine: Any) -> ExpertCheckpoint | None:
    """The MoE layers of ``engine``'s model (None: it has none, or ZeRO-3 holds it). DeepSpeed writes its MoE
    layout whenever the model has MoE layers (``has_moe_layers``), at any ``ep_size``: also where every rank holds
    every expert (``ep_size=1``, or one rank), so the layers are those of the model, not of the local experts."""
    from ..parallel.moe import moe_layers

    layers = moe_layers(engine.module)
    if not layers or engine.zero_optimization_stage() >= 3:
        return None
    return ExpertCheckpoint(engine.module, layers)


def for_load(engine: Any) -> tuple[dict[str, str], ExpertCheckpoint | None]:
    """(local -> global names of this rank's expert keys, the model's MoE layers) for a load (({}, None) without
    MoE layers)."""
    experts = engine_experts(engine)
    return (experts.global_names(engine.module.state_dict()) if experts is not None else {}), experts


def for_save(engine: Any, model_states: dict | None, *,
             exclude_frozen: bool) -> tuple[dict | None, dict[str, Any], dict[str, str]]:  # fmt: skip
    """What a save writes for a model with MoE layers, as :func:`save_files` (and the renaming of
    :func:`for_load`); without MoE layers ``(model_states, {}, {})``."""
    key_map, experts = for_load(engine)
    if experts is None:
        return model_states, {}, {}
    return (*save_files(engine, experts, model_states, exclude_frozen=exclude_frozen), key_map)


def save_files(engine: Any, experts: ExpertCheckpoint, model_states: dict | None, *,
               exclude_frozen: bool) -> tuple[dict | None, dict[str, Any]]:  # fmt: skip
    """DeepSpeed's layout for a model with MoE layers: rank 0's model states without the experts (with
    ``num_experts``), and this rank's files (expert files; at stage 0 with a plain torch optimizer the
    ``expp_rank`` optimizer file, as DeepSpeed writes it for its unwrapped optimizer)."""
    files = experts.expert_files(engine.module_state_dict(exclude_frozen_parameters=exclude_frozen))
    if model_states is not None:
        model_states = {**model_states, "module": experts.non_expert(model_states["module"]),
                        "num_experts": list(experts.num_experts), "ds_autoep_layers": None}  # fmt: skip
    if experts.writes_optimizer:
        optimizer = model_states["optimizer"] if model_states is not None else stage0_optimizer_state(engine)
        if optimizer is not None:
            files[optimizer_file(experts.ep_rank)] = {"optimizer": optimizer}
    return model_states, files
