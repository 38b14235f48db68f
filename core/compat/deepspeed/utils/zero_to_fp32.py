"""``deepspeed.utils.zero_to_fp32``: one full fp32 state dict from a checkpoint directory, as DeepSpeed's functions
give it (same names, arguments and return values).

Both kinds of checkpoint are read: torsh's (``engine.save_checkpoint``, ``torch.distributed.checkpoint`` shards)
and DeepSpeed's own ZeRO 0-3 files, through the reader of ``torsh-migrate merge``, which never runs code from the
checkpoint. The weights are the fp32 master weights when the job kept them, and buffers are as saved.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torsh.errors import ConfigError, Problem

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_state_dict",
           "convert_zero_checkpoint_to_fp32_state_dict", "load_state_dict_from_zero_checkpoint", "get_optim_files",
           "get_model_state_files"]  # fmt: skip


def _natural_key(path: str) -> list:
    import re

    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _files(checkpoint_dir: Any, pattern: str) -> list[str]:
    import glob

    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    files = sorted(glob.glob(os.path.join(str(checkpoint_dir), pattern)), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"can't find {pattern} files in directory '{checkpoint_dir}'")
    return files


def get_optim_files(checkpoint_dir) -> list[str]:
    """The ``*_optim_states.pt`` files of a DeepSpeed checkpoint tag directory, in rank order (``zero_2`` before
    ``zero_10``); ``FileNotFoundError`` when there are none."""
    return _files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir) -> list[str]:
    """The ``*_model_states.pt`` files of a DeepSpeed checkpoint tag directory, in rank order."""
    return _files(checkpoint_dir, "*_model_states.pt")


def _tag_dir(checkpoint_dir: Any, tag: Any) -> Path:
    """``checkpoint_dir/<tag>``, the tag from ``latest`` when not given; DeepSpeed's errors when either is missing."""
    root = Path(checkpoint_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise ValueError(f"Unable to find 'latest' file at {latest}")
        tag = latest.read_text(encoding="utf-8", errors="replace").strip()
    path = root / str(tag)
    if not path.is_dir():
        raise FileNotFoundError(f"Directory '{path}' doesn't exist")
    return path


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False) -> dict[str, Any]:  # fmt: skip
    """The model's full state dict on the CPU (fp32 weights; buffers as saved). ``lazy_mode`` gives the same
    tensors (already loaded; ``.contiguous()`` returns them)."""
    from torsh.engine.checkpoint.merge import merged_weights

    path = _tag_dir(checkpoint_dir, tag)
    state, _, frozen = merged_weights(path)
    if exclude_frozen_parameters:
        if frozen is None:
            raise ConfigError([Problem("exclude_frozen_parameters", True, f"{path} is a torsh checkpoint, which does "
                                       "not record which parameters were frozen; load it without this argument and "
                                       "drop the names of parameters whose requires_grad is False")])  # fmt: skip
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=None, max_shard_size="5GB",
                                          safe_serialization=False, tag=None, exclude_frozen_parameters=False) -> None:
    """Write the state dict to ``output_dir`` as ``pytorch_model.bin`` or ``model.safetensors``, floating-point
    tensors in ``dtype`` (default fp32), in shards of at most ``max_shard_size`` with the Hugging Face index file
    when it is larger (the shards are planned by ``huggingface_hub``, as DeepSpeed does); each file is written as
    ``torsh-migrate merge`` writes it (atomically; a tied weight is one tensor under both names in
    ``pytorch_model.bin``, as DeepSpeed writes it, and two in ``.safetensors``, which cannot share)."""

    from torsh.engine.checkpoint.merge import write

    dtype = _output_dtype(dtype)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    converted: dict[int, Any] = {}  # by id: a tied weight (one tensor under two names) stays one tensor
    for value in state.values():
        if id(value) not in converted:
            converted[id(value)] = value.to(dtype) if value.is_floating_point() else value
    state = {k: converted[id(v)] for k, v in state.items()}
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    shards, index = _shards(state, name, max_shard_size)
    os.makedirs(output_dir, exist_ok=True)
    for file, keys in shards.items():
        write({k: state[k] for k in keys}, Path(output_dir) / file, "safetensors" if safe_serialization else "torch")
    if index is not None:
        import json

        index_name = "model.safetensors.index.json" if safe_serialization else "pytorch_model.bin.index.json"
        with open(os.path.join(output_dir, index_name), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None,
                                               exclude_frozen_parameters=False) -> None:  # fmt: skip
    """:func:`convert_zero_checkpoint_to_state_dict` in fp32."""
    convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=None, max_shard_size=max_shard_size,
                                          safe_serialization=safe_serialization, tag=tag,
                                          exclude_frozen_parameters=exclude_frozen_parameters)  # fmt: skip


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Move ``model`` to the CPU, load the checkpoint's fp32 weights into it (``strict=False``) and return it;
    ``engine.module`` of a sharded job (ZeRO 2/3) takes each rank's shard of those weights. Inside
    ``deepspeed.zero.GatheredParameters`` (DeepSpeed's ZeRO-3 use: load, then read ``model.state_dict()`` in the
    context) the gathered full parameters take the weights and the model stays where it is (a sharded module is
    moved only as a whole, outside the context); what the context does on exit decides what is kept, as in
    DeepSpeed."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    params = list(model.parameters())
    sharded = [isinstance(p, DTensor) for p in params]
    if not _is_fsdp(model):
        model = model.cpu()
        model.load_state_dict(state, strict=False)
    elif all(sharded):
        # engine.module at ZeRO 2/3 (FSDP2-sharded): each rank takes its shard of the full fp32 values
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model = model.cpu()
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        # gathered by GatheredParameters: FSDP2's own loading (and moving) would put shards back, so each value is
        # copied into the parameter the module holds now (a gathered one whole, a shard its part)
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        with torch.no_grad():
            for name, value in state.items():
                target = tensors.get(name)
                if target is None:
                    continue
                value = value.to(device=target.device, dtype=target.dtype)
                if isinstance(target, DTensor):
                    value = distribute_tensor(value, target.device_mesh, target.placements)
                target.copy_(value)
    return model


def _is_fsdp(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _output_dtype(dtype: Any) -> Any:
    import torch

    names = {None: torch.float32, "fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
             "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}  # fmt: skip
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        return dtype
    key = dtype.lower().removeprefix("torch.") if isinstance(dtype, str) else dtype
    if key not in names:
        raise ValueError(f"dtype must be float32, float16 or bfloat16 (a torch dtype or its name), got {dtype!r}")
    return names[key]


def _shards(state: dict[str, Any], name: str, max_shard_size: Any) -> tuple[dict[str, list[str]], dict | None]:
    """``{file: keys}`` and the index (None: one file), split by ``huggingface_hub`` as DeepSpeed splits it."""
    if max_shard_size is None:
        return {name: list(state)}, None
    try:
        from huggingface_hub import split_torch_state_dict_into_shards
    except ModuleNotFoundError:
        raise ModuleNotFoundError("splitting the state dict into max_shard_size shards needs huggingface_hub (pip "
                                  "install huggingface_hub), as DeepSpeed's; or pass max_shard_size=None for one "
                                  "file") from None  # fmt: skip
    pattern = name.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
    split = split_torch_state_dict_into_shards(state, filename_pattern=pattern, max_shard_size=max_shard_size)
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename} if split.is_sharded else None
    return dict(split.filename_to_tensors), index
