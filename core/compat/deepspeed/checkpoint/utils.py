"""``deepspeed.checkpoint.utils``: copying a state dict for ``torch.save``."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: Any = torch.device("cpu")) -> Any:
    """A copy of ``item`` with every tensor in it (nested in lists, tuples and dicts) cloned onto ``device``, as
    DeepSpeed's. A parameter sharded by the torsh engine (a DTensor at stages 2/3, where DeepSpeed's ZeRO-2 keeps
    whole parameters) is gathered into its full tensor first, so the copy holds the whole weights: every rank
    must then call it, as Accelerate's ``get_state_dict`` does."""
    from ..utils import _full  # a sharded parameter's full value (collective), else the tensor detached

    if torch.is_tensor(item):
        item = _full(item)
        device = torch.device(device) if isinstance(device, str) else device
        return item.clone() if item.device == device else item.to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
