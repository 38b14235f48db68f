"""``deepspeed.checkpoint.ds_to_universal``: DeepSpeed's converter to a universal checkpoint. torsh does not write
universal checkpoints (a torsh checkpoint loads at any world size and ZeRO stage by itself, and ``torsh-migrate
merge`` writes one consolidated state dict); ``main`` says so. What the converter checks first, that the AutoEP
metadata of a ZeRO-1/2 checkpoint's model-state files is consistent, is here."""

from __future__ import annotations

from .._unsupported import unsupported_function
from .constants import AUTOEP_EXPERT_KEY_PREFIX, AUTOEP_LAYERS_KEY, PARAM_SHAPES
from .deepspeed_checkpoint import USE_DATA_BEFORE_EXPERT_PARALLELISM

main = unsupported_function("checkpoint.ds_to_universal.main", "torsh writes no universal checkpoint; a torsh "
                            "checkpoint loads at any world size and stage, and torsh-migrate merge writes one state "
                            "dict")  # fmt: skip


def _aggregate_autoep_zero12_metadata(model_state_metadata):
    """From ``DeepSpeedCheckpoint.model_state_metadata``: the parameter shapes of each file, the AutoEP layers
    (one entry per expert key prefix, or None), and the ds_config's ``use_data_before_expert_parallelism`` (which
    every file must agree on). A malformed entry is a ``RuntimeError`` naming its file."""
    shapes_per_file, layers, first_file, ordering = [], {}, {}, {}
    for path, metadata in model_state_metadata:
        shapes = metadata[PARAM_SHAPES]
        if not isinstance(shapes, dict):
            raise RuntimeError(f"DeepSpeed checkpoint {PARAM_SHAPES} must contain dictionaries in {path}.")
        shapes_per_file.append(shapes)
        autoep = metadata[AUTOEP_LAYERS_KEY]
        if autoep is not None and not isinstance(autoep, list):
            raise RuntimeError(f"AutoEP metadata must be a list in {path}.")
        for layer in autoep or []:
            if not isinstance(layer, dict):
                raise RuntimeError(f"AutoEP layer metadata must contain dictionaries in {path}.")
            prefix = layer.get(AUTOEP_EXPERT_KEY_PREFIX)
            if not isinstance(prefix, str) or not prefix:
                raise RuntimeError(f"AutoEP expert_key_prefix must be a non-empty string in {path}.")
            if prefix in layers and layers[prefix] != layer:
                raise RuntimeError(f"Conflicting AutoEP metadata for expert_key_prefix {prefix!r} in "
                                   f"{first_file[prefix]} and {path}.")  # fmt: skip
            layers.setdefault(prefix, layer)
            first_file.setdefault(prefix, path)
        config = metadata["ds_config"]
        if not isinstance(config, dict):
            raise RuntimeError(f"DeepSpeed checkpoint ds_config must be a dictionary in {path}.")
        value = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        if not isinstance(value, bool):
            raise RuntimeError(f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} must be a boolean "
                               f"in {path}.")
        ordering[path] = value
    if len(set(ordering.values())) != 1:
        raise RuntimeError(f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} disagrees across model-state "
                           f"files: {ordering}")  # fmt: skip
    return shapes_per_file, list(layers.values()) or None, next(iter(ordering.values()))
