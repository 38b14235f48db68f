"""``deepspeed.checkpoint.utils``: the names of the files in a DeepSpeed checkpoint tag folder, and copying a state
dict for ``torch.save``."""

from __future__ import annotations

import os
from typing import Any

import torch

from .constants import CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE
from .constants import MODEL_FILE_PREFIX, MODEL_FILE_SUFFIX, OPTIM_FILE_SUFFIX, ZERO_FILE_PREFIX


def get_model_ckpt_name_for_rank(base_folder, mp_rank_str) -> str:
    """The model-state file of model-parallel rank ``mp_rank_str`` (a string, DeepSpeed writes two digits: "00")
    in the tag folder ``base_folder``: ``<base_folder>/mp_rank_<mp_rank_str>_model_states.pt``. DeepSpeed writes
    and reads its module, counters and client state there; torsh's pipeline engine writes its per-stage state
    under the same name, and torsh's engine reads a DeepSpeed checkpoint from it (a torsh checkpoint of a
    non-pipeline engine keeps its model state in ``torch.distributed.checkpoint`` files instead)."""
    return os.path.join(base_folder, MODEL_FILE_PREFIX + mp_rank_str + MODEL_FILE_SUFFIX)


def get_zero_ckpt_name_for_rank(base_folder, dp_rank, mp_rank) -> str:
    """The ZeRO optimizer-state file of data-parallel rank ``dp_rank`` and model-parallel rank ``mp_rank`` (ints):
    ``<base_folder>/zero_pp_rank_<dp_rank>_mp_rank_<mp_rank, two digits>_optim_states.pt``."""
    name = f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{OPTIM_FILE_SUFFIX}"
    return os.path.join(base_folder, name)


def get_layer_ckpt_name_for_rank(base_folder, layer_id, tp_rank) -> str:
    """A pipeline layer's file for tensor-parallel rank ``tp_rank`` (an int): ``<base_folder>/<layer_id>-model_<tp_rank,
    two digits>_model_states.pt`` (``layer_id`` as given, e.g. ``layer_03``)."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{MODEL_FILE_SUFFIX}")


def checkpoint_parallel_metadata(mpu) -> dict:
    """What DeepSpeed records in each model-state file about the run's model parallelism:
    ``{CHECKPOINT_PARALLEL_DIMS: {pp_degree, tp_degree}}`` from a Megatron or DeepSpeed ``mpu`` (1 and 1 without
    one), which the checkpoint readers use instead of counting files. DeepSpeed's engine names it
    ``_checkpoint_parallel_metadata``."""
    pp = _mpu_size(mpu, "get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")
    tp = _mpu_size(mpu, "get_tensor_model_parallel_world_size", "get_slice_parallel_world_size",
                   "get_model_parallel_world_size")  # fmt: skip
    return {CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: pp, CHECKPOINT_TP_DEGREE: tp}}


def _mpu_size(mpu, *methods) -> int:
    """The first of ``methods`` ``mpu`` has, called (the spellings Megatron and DeepSpeed versions use); else 1."""
    for name in methods:
        if mpu is not None and hasattr(mpu, name):
            return getattr(mpu, name)()
    return 1


def clone_tensors_for_torch_save(item: Any, device: Any = torch.device("cpu")) -> Any:
    """A copy of ``item`` with every tensor in it (nested in lists, tuples and dicts) cloned onto ``device``, as
    DeepSpeed's. A parameter sharded by the torsh engine (a DTensor at stages 2/3, where DeepSpeed's ZeRO-2 keeps
    whole parameters) is gathered into its full tensor first, so the copy holds the whole weights: every rank
    must then call it, as Accelerate's ``get_state_dict`` does."""
    from torch.distributed.tensor import DTensor

    if torch.is_tensor(item):
        item = item.full_tensor() if isinstance(item, DTensor) else item.detach()  # gathering is collective
        device = torch.device(device) if isinstance(device, str) else device
        return item.clone() if item.device == device else item.to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
