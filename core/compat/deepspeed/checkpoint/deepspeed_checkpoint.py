"""``deepspeed.checkpoint.deepspeed_checkpoint``: ``DeepSpeedCheckpoint``, a reader of a Megatron-DeepSpeed
checkpoint folder (``mp_rank_XX_model_states.pt`` per pipeline x tensor rank, ``layer_NN-model_XX_model_states.pt``
per pipeline layer and tensor rank, ZeRO files per data rank) that hands out each rank's state for a target shape
whose degrees divide the source's (conversion tools build universal or Megatron checkpoints from it).

Each model-state file is loaded once, when the reader is built, into a ``ModelFileSummary`` (its parallel degrees,
parameter shapes, AutoEP layers and expert-data ordering); ``model_state_metadata`` lists them as
``(path, {field: value})`` pairs, and the iteration, args and checkpoint infos are kept from the first file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from torsh.engine.checkpoint.from_deepspeed import load_file

from .constants import (AUTOEP_LAYERS_KEY, AUTOEP_LAYERS_KEY_LEGACY, AUTOEP_ZERO12_REQUIRED_FIELDS,
                        CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE, LAYER_FILE_PREFIX,
                        MODEL_FILE_PREFIX, PARAM_SHAPES, UNIVERSAL_CHECKPOINT_INFO)  # fmt: skip
from .reshape_3d_utils import get_model_3d_descriptor_from_metadata, model_3d_desc
from .reshape_meg_2d import meg_2d_parallel_map, reshape_meg_2d_parallel
from .reshape_utils import basic_folder_validation, get_files, get_files_with_prefix, get_zero_files, merge_state
from .reshape_utils import partition_data, report_missing_files
from .zero_checkpoint import ZeROCheckpoint

EMBEDDING_LAYER_INDEX = 0
FINAL_LAYER_NORM_INDEX = -1
ARGS_KEY = "args"
CHECKPOINT_INFO_KEY = "checkpoint_info"
ITERATION_KEY = "iteration"
LAYER_FILE_PREFIX_PATTERN = r"layer_(\d+)-model_.*"
USE_DATA_BEFORE_EXPERT_PARALLELISM = "use_data_before_expert_parallelism"
AUTOEP_METADATA_FIELDS = ("moe_layer_id", "module_path") + AUTOEP_ZERO12_REQUIRED_FIELDS
#: Megatron layer weights every tensor rank holds whole (taken from the first rank, not concatenated)
SEQUENTIAL_LAYERS = ["input_layernorm.weight", "input_layernorm.bias", "self_attention.dense.bias",
                     "post_attention_layernorm.weight", "post_attention_layernorm.bias", "mlp.dense_4h_to_h.bias",
                     "position_embeddings.weight"]  # fmt: skip
#: row-parallel Megatron weights: tensor slices concatenate on dim 1 (the others on dim 0)
LAYER_CONCAT_DIM = {"self_attention.dense.weight": 1, "mlp.dense_4h_to_h.weight": 1}


def _load(path):
    return load_file(path)  # safely: weights_only, DeepSpeed's classes as inert stand-ins


@dataclass(frozen=True)
class ModelFileSummary:
    """What one ``mp_rank_XX_model_states.pt`` file says about the checkpoint, read once when the reader is built.

    A field whose stored value has an unexpected type holds that type's name instead, so the checks that consume
    ``model_state_metadata`` can refuse it naming the file; None means the file records nothing for that field."""

    path: str
    parallel_dims: object
    param_shapes: object
    autoep_layers: object
    ds_config: object

    @classmethod
    def of(cls, path: str, state: dict) -> "ModelFileSummary":
        autoep = state.get(AUTOEP_LAYERS_KEY)
        return cls(path=path,
                   parallel_dims=_keep_if(state.get(CHECKPOINT_PARALLEL_DIMS), dict, _degrees_only),
                   param_shapes=_keep_if(state.get(PARAM_SHAPES), (list, tuple), _flatten_shape_groups),
                   autoep_layers=_keep_if(state.get(AUTOEP_LAYERS_KEY_LEGACY) if autoep is None else autoep, list,
                                          lambda layers: [_keep_if(entry, dict, _autoep_fields, absent="NoneType") for entry in layers]),
                   ds_config=_keep_if(state.get("ds_config", {}), dict, _expert_ordering, absent="NoneType"))  # fmt: skip

    def as_metadata(self) -> tuple:
        """The ``(path, {field: value})`` pair ``model_state_metadata`` lists per file."""
        return self.path, {CHECKPOINT_PARALLEL_DIMS: self.parallel_dims, PARAM_SHAPES: self.param_shapes,
                           AUTOEP_LAYERS_KEY: self.autoep_layers, "ds_config": self.ds_config}  # fmt: skip


class DeepSpeedCheckpoint:
    """The checkpoint in folder ``dir``, read for ``tp_degree`` x ``pp_degree`` x ``dp_degree`` (default: its own)."""

    def __init__(self, dir, tp_degree=None, pp_degree=None, dp_degree=None,
                 final_layer_norm_idx=FINAL_LAYER_NORM_INDEX):  # fmt: skip
        basic_folder_validation(dir)
        self.dir = dir
        self.final_layer_norm_idx = final_layer_norm_idx
        source = self._scan_folder()
        self._choose_target(source, tp=tp_degree, pp=pp_degree, dp=dp_degree)
        self._sanity_check()
        self._map_layer_files()

    # ---- reading the folder and choosing the target shape -----------------------------------------------------------
    def _scan_folder(self) -> model_3d_desc:
        """List the files, summarise each model-state file (one load each) and return the source shape."""
        self.file_list = get_files(self.dir)
        self.layer_files = sorted(path for path in self.file_list
                                  if re.fullmatch(LAYER_FILE_PREFIX_PATTERN, os.path.basename(path)))  # fmt: skip
        self._validate_folder(self.dir, pipeline_parallel=bool(self.layer_files))
        self.mp_rank_files = get_files_with_prefix(self.file_list, MODEL_FILE_PREFIX)
        self.model_file_summaries = []
        self._first_file_values = {}
        for path in self.mp_rank_files:
            state = _load(path)
            self.model_file_summaries.append(ModelFileSummary.of(path, state))
            if not self._first_file_values:
                self._first_file_values = {key: state.get(key) for key in (ARGS_KEY, CHECKPOINT_INFO_KEY,
                                                                            UNIVERSAL_CHECKPOINT_INFO)}  # fmt: skip
                self._first_file_values[ITERATION_KEY] = state.get(ITERATION_KEY, 0)
        self.model_state_metadata = [summary.as_metadata() for summary in self.model_file_summaries]
        source = get_model_3d_descriptor_from_metadata(self.file_list, get_zero_files(self.dir),
                                                       self.model_state_metadata)  # fmt: skip
        self.zero_checkpoint = ZeROCheckpoint(self.dir, source_3d=source)
        self.layer_keys = self._get_layer_keys()
        self.layer_count = len(self.layer_keys)
        return source

    def _choose_target(self, source: model_3d_desc, tp, pp, dp) -> None:
        """Fix the target degrees (the source's where not given) and reshape the ZeRO files' map to them."""
        self.tp_degree, self.pp_degree, self.dp_degree = (own if wanted is None else wanted for own, wanted in
                                                          ((source.tp_degree, tp), (source.pp_degree, pp),
                                                           (source.dp_degree, dp)))  # fmt: skip
        self.original_world_size = source.world_size()
        self.world_size = self.tp_degree * self.pp_degree * self.dp_degree
        self.old_2d_map = meg_2d_parallel_map(source.pp_degree, source.tp_degree)
        self.old_2d_map.simple_init()
        self.new_2d_map = reshape_meg_2d_parallel(source.pp_degree, source.tp_degree, self.pp_degree, self.tp_degree)
        if (self.tp_degree, self.pp_degree, self.dp_degree) != (source.tp_degree, source.pp_degree, source.dp_degree):
            self.zero_checkpoint.reshape(model_3d_desc(self.pp_degree, self.tp_degree, self.dp_degree))

    def _map_layer_files(self) -> None:
        self.pp_to_transformer_map = self._build_pp_transformer_map()
        self.transformer_file_map = self._build_transformer_file_map()
        self.tp_to_embedding_map = self._build_tp_other_layer_map(EMBEDDING_LAYER_INDEX)
        self.tp_to_final_norm_map = self._build_tp_other_layer_map(self.final_layer_norm_idx)

    # ---- values of the first model-state file --------------------------------------------------------------------------
    def _get_checkpoint_value(self, key):
        if key not in self._first_file_values:
            self._first_file_values[key] = _load(self.mp_rank_files[0]).get(key)
        return self._first_file_values[key]

    def get_iteration(self):
        return self._get_checkpoint_value(ITERATION_KEY)

    def get_args(self):
        return self._get_checkpoint_value(ARGS_KEY)

    def get_checkpoint_info(self, info_key=CHECKPOINT_INFO_KEY):
        return self._get_checkpoint_value(info_key)

    # ---- degrees -----------------------------------------------------------------------------------------------------
    def is_change_tp_degree(self) -> bool:
        return self.tp_degree != self.zero_checkpoint.get_src_tp_degree()

    def is_change_pp_degree(self) -> bool:
        return self.pp_degree != self.zero_checkpoint.get_src_pp_degree()

    def is_change_dp_degree(self) -> bool:
        return self.dp_degree != self.zero_checkpoint.get_src_dp_degree()

    # ---- states per target rank ------------------------------------------------------------------------------------
    def get_zero_checkpoint_state(self, pp_index, tp_index, dp_index, strip_tensor_paddings: bool = True) -> dict:
        return self.zero_checkpoint.get_state_for_rank(pp_index, tp_index, dp_index, keys_to_ignore=[PARAM_SHAPES],
                                                       strip_tensor_paddings=strip_tensor_paddings)  # fmt: skip

    def get_zero_files(self, pp_index, tp_index, dp_index) -> list:
        return self.zero_checkpoint.get_files_for_rank(pp_index, tp_index, dp_index)

    def get_2d_parallel_files(self, tp_index: int, pp_index: int) -> list:
        return [self.mp_rank_files[i] for i in self.new_2d_map.get_data(pp_index=pp_index, tp_index=tp_index)]

    def get_2d_parallel_state(self, tp_index: int, pp_index: int) -> dict:
        merged = None
        for path in self.get_2d_parallel_files(tp_index=tp_index, pp_index=pp_index):
            state = _load(path)
            merged = state if merged is None else merge_state(merged, state)
        return merged

    def get_embedding_layer_id(self):
        return self.layer_keys[EMBEDDING_LAYER_INDEX]

    def get_final_norm_layer_id(self):
        return self.layer_keys[self.final_layer_norm_idx]

    def get_embedding_files(self, tp_index: int) -> list:
        return self._layer_files(self.tp_to_embedding_map, tp_index, "embedding")

    def get_embedding_state(self, tp_index: int) -> dict:
        return self._merge_state_dicts([_load(p) for p in self.get_embedding_files(tp_index)])

    def get_final_norm_files(self, tp_index: int) -> list:
        return self._layer_files(self.tp_to_final_norm_map, tp_index, "final norm")

    def get_final_norm_state(self, tp_index: int) -> dict:
        return _load(self.get_final_norm_files(tp_index)[0])

    def get_pp_transformer_map(self, pp_index: int) -> list:
        return self.pp_to_transformer_map[pp_index]

    def get_transformer_state(self, tp_index: int, pp_index: int) -> list:
        """Per transformer layer of that pipeline stage, the tensor slices of that rank merged."""
        return [self._merge_state_dicts([_load(p) for p in paths])
                for paths in self.transformer_file_map[(tp_index, pp_index)]]  # fmt: skip

    # ---- printing ----------------------------------------------------------------------------------------------------
    def show_2d_mapping(self) -> None:
        print(f"model-state files per target (pipeline, tensor) rank, {self.pp_degree} x {self.tp_degree}:")
        for pp_index in range(self.pp_degree):
            for tp_index in range(self.tp_degree):
                files = self.get_2d_parallel_files(pp_index=pp_index, tp_index=tp_index)
                print(f"  pipeline {pp_index}, tensor {tp_index}: {files}")

    def show_tp_embedding_map(self) -> None:
        _dump(self.tp_to_embedding_map, "tp_to_embedding_layers")

    def show_tp_final_norm_map(self) -> None:
        _dump(self.tp_to_final_norm_map, "tp_to_final_norm_layers")

    def show_pp_transformer_map(self) -> None:
        _dump(self.pp_to_transformer_map, "pp_to_transformer_layers")

    def show_transformer_file_map(self) -> None:
        _dump(self.transformer_file_map, "rank_to_transformer_files")

    def validate_files(self) -> None:
        report_missing_files(self.file_list)

    # ---- layer files -------------------------------------------------------------------------------------------------
    def _get_layer_keys(self) -> list[str]:
        ids = {re.fullmatch(LAYER_FILE_PREFIX_PATTERN, os.path.basename(p)).group(1) for p in self.layer_files}
        return [LAYER_FILE_PREFIX + i for i in sorted(ids, key=int)]

    def _transformer_layer_keys(self) -> list[str]:
        return self.layer_keys[1:self.final_layer_norm_idx]

    def _build_pp_transformer_map(self) -> dict:
        layers = self._transformer_layer_keys()
        per_stage = len(layers) // self.pp_degree
        return {i: layers[i * per_stage:(i + 1) * per_stage] for i in range(self.pp_degree)}

    def _build_transformer_file_map(self) -> dict:
        layers = self._transformer_layer_keys()
        per_stage = max(1, len(layers) // self.pp_degree)
        file_map: dict = {}
        for index, key in enumerate(layers):
            slices = partition_data(get_files_with_prefix(self.layer_files, key + "-"), self.tp_degree)
            for tp_index, paths in enumerate(slices):
                file_map.setdefault((tp_index, index // per_stage), []).append(paths)
        return file_map

    def _build_tp_other_layer_map(self, layer_index: int) -> dict:
        if not self.layer_files:
            return {}
        paths = get_files_with_prefix(self.layer_files, self.layer_keys[layer_index])
        return dict(enumerate(partition_data(paths, self.tp_degree)))

    def _layer_files(self, table: dict, tp_index: int, what: str) -> list:
        if tp_index not in table:
            raise KeyError(f"no {what} layer files for tensor rank {tp_index} (pipeline layer files: "
                           f"{len(self.layer_files)}, tensor degree {self.tp_degree})")  # fmt: skip
        return table[tp_index]

    def _merge_state_dicts(self, states: list) -> dict:
        return {key: states[0][key] if key in SEQUENTIAL_LAYERS
                else torch.cat([s[key] for s in states], dim=LAYER_CONCAT_DIM.get(key, 0))
                for key in states[0]}  # fmt: skip

    # ---- checks ------------------------------------------------------------------------------------------------------
    def _validate_folder(self, dir, pipeline_parallel: bool) -> None:
        prefixes = [MODEL_FILE_PREFIX] + ([LAYER_FILE_PREFIX, f"{LAYER_FILE_PREFIX}01"] if pipeline_parallel else [])
        for prefix in prefixes:
            if not get_files_with_prefix(self.file_list, prefix):
                raise FileNotFoundError(f"{dir} seems a bogus DeepSpeed checkpoint folder: Cannot find {prefix}* "
                                        "files in there.")  # fmt: skip

    def _sanity_check(self) -> None:
        zero_files = self.zero_checkpoint.num_files
        if len(self.mp_rank_files) % self.tp_degree or zero_files % (self.pp_degree * self.tp_degree):
            raise ValueError(f"{self.dir}: {len(self.mp_rank_files)} model-state and {zero_files} "
                             f"ZeRO files do not divide into tensor degree {self.tp_degree} x pipeline degree "
                             f"{self.pp_degree}")  # fmt: skip


# ---- summarising one model-state file ----------------------------------------------------------------------------
def _keep_if(value, expected, keep, absent=None):
    """``keep(value)`` when it has the expected type; its type's name when not; ``absent`` when it is None."""
    if value is None:
        return absent
    return keep(value) if isinstance(value, expected) else type(value).__name__


def _degrees_only(dims: dict) -> dict:
    return {key: dims.get(key) for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE)}


def _flatten_shape_groups(groups):
    """One {name: shape} over all parameter groups (the groups' container type's name if one is not a dict)."""
    if any(not isinstance(group, dict) for group in groups):
        return type(groups).__name__
    return {name: shape for group in groups for name, shape in group.items()}


def _autoep_fields(entry: dict) -> dict:
    return {field: entry[field] for field in AUTOEP_METADATA_FIELDS if field in entry}


def _expert_ordering(config: dict) -> dict:
    return {USE_DATA_BEFORE_EXPERT_PARALLELISM: _keep_if(config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False), bool,
                                                         lambda flag: flag, absent="NoneType")}  # fmt: skip


def _dump(table: dict, tag: str) -> None:
    print(f"{tag} ({len(table)} entries):")
    for key, value in table.items():
        print(f"  {key}: {value}")
