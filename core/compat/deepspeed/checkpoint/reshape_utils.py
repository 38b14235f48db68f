"""``deepspeed.checkpoint.reshape_utils``: finding the files of a DeepSpeed checkpoint folder, splitting a list of
rank indices into equal parts, and merging the state dicts of several ranks (tensors concatenated on dim 0)."""

from __future__ import annotations

import os
import re
from collections import OrderedDict

import torch

from .constants import BF16_ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, MODEL_FILE_PREFIX, ZERO_FILE_PREFIX


def basic_folder_validation(dir) -> None:
    """Raise ``FileNotFoundError`` / ``NotADirectoryError`` unless ``dir`` is an existing folder."""
    if not os.path.exists(dir):
        raise FileNotFoundError(f"{dir}: the checkpoint folder does not exist")
    if not os.path.isdir(dir):
        raise NotADirectoryError(f"{dir}: is a file, not a checkpoint folder")


def get_files(dir) -> list[str]:
    """Every file under ``dir`` (recursively), as paths."""
    return [os.path.join(root, name) for root, _, names in os.walk(dir) for name in names]


def get_files_with_prefix(all_files, prefix) -> list[str]:
    """The paths among ``all_files`` whose file name starts with ``prefix``, sorted."""
    return sorted(path for path in all_files if os.path.basename(path).startswith(prefix))


def report_missing_files(file_list) -> list[str]:
    """Print, and return, the paths of ``file_list`` that are not (or no longer) regular files."""
    missing = [path for path in file_list if not os.path.isfile(path)]
    for path in missing:
        print(f"{path}: listed as a checkpoint file but no such file")
    return missing


def validate_files(file_list) -> None:
    """Print each path of ``file_list`` that is not a file."""
    report_missing_files(file_list)


def sort_zero_files(files, prefix) -> list[str]:
    """ZeRO optimizer files ordered by (data-parallel rank, model-parallel rank): file ``i`` of the result is data
    rank ``i // mp`` and model rank ``i % mp``."""
    pattern = re.compile(f"{re.escape(prefix)}([0-9]+)_{MODEL_FILE_PREFIX}([0-9]+)")
    ranked = []
    for path in files:
        found = pattern.search(path)
        if found is None:
            raise ValueError(f"{path}: cannot read the data-parallel and model-parallel ranks from this ZeRO file name "
                             f"(expected {prefix}<dp rank>_{MODEL_FILE_PREFIX}<mp rank>...)")  # fmt: skip
        ranked.append((int(found.group(1)), int(found.group(2)), path))
    return [path for _, _, path in sorted(ranked)]


def get_zero_files(dir) -> list[str]:
    """The ZeRO optimizer-state files of ``dir`` (plain, fp16 or bf16 names; the first kind found), rank-ordered."""
    files = get_files(dir)
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        found = get_files_with_prefix(files, prefix)
        if found:
            return sort_zero_files(found, prefix)
    return []


def partition_data(data_list, num_partitions) -> list[list]:
    """``data_list`` cut into ``num_partitions`` consecutive parts of equal length."""
    if num_partitions < 1 or len(data_list) % num_partitions:
        raise ValueError(f"cannot split {len(data_list)} items into {num_partitions} equal parts: a checkpoint "
                         "reshapes only to degrees that divide the source's")  # fmt: skip
    size = len(data_list) // num_partitions
    return [data_list[i:i + size] for i in range(0, len(data_list), size)]


def merge_state(state_a, state_b, key_list=()):
    """Two ranks' states as one: dicts merged key by key (a key of one only is kept), lists and tuples item by item,
    tensors concatenated on dim 0, any other value (a scalar tensor such as a step count too) taken from
    ``state_a``."""
    where = ".".join(str(k) for k in key_list) or "<root>"
    if type(state_a) is not type(state_b):
        raise ValueError(f"cannot merge checkpoint states at {where}: {type(state_a).__name__} and "
                         f"{type(state_b).__name__}")  # fmt: skip
    if isinstance(state_a, (dict, OrderedDict)):
        merged = type(state_a)()
        for key, value in state_a.items():
            merged[key] = merge_state(value, state_b[key], [*key_list, key]) if key in state_b else value
        for key, value in state_b.items():
            merged.setdefault(key, value)
        return merged
    if isinstance(state_a, (list, tuple)):
        if len(state_a) != len(state_b):
            raise ValueError(f"cannot merge checkpoint states at {where}: lists of {len(state_a)} and {len(state_b)}")
        return type(state_a)(merge_state(a, b, [*key_list, i]) for i, (a, b) in enumerate(zip(state_a, state_b)))
    if torch.is_tensor(state_a) and state_a.dim() > 0:
        return torch.cat([state_a, state_b], 0)
    return state_a
