"""``deepspeed.checkpointing``: activation checkpointing on ``torch.utils.checkpoint``.

``checkpoint(function, *args)`` recomputes ``function`` in backward (non-reentrant, so keyword tensors and
parameters get gradients). ``configure`` records DeepSpeed's options; ``checkpoint_in_cpu`` keeps the saved
inputs in host memory (``torch.autograd.graph.save_on_cpu``). Partitioning activations across model-parallel
ranks, contiguous buffers and profiling have no meaning without model parallelism and are accepted as no-ops.
The RNG state is restored on recomputation (dropout gives the same masks), as DeepSpeed's CUDA RNG tracker does.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.utils.checkpoint

log = logging.getLogger("torsh.compat")

_configured = False
_options = {"partition_activations": False, "contiguous_checkpointing": False, "num_checkpoints": None,
            "checkpoint_in_cpu": False, "synchronize": False, "profile": False}  # fmt: skip


def checkpoint(function, *args, **kwargs):
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in backward."""
    offload = torch.autograd.graph.save_on_cpu(pin_memory=False) if _options["checkpoint_in_cpu"] else None
    with offload or contextlib.nullcontext():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                                 **kwargs)  # fmt: skip


non_reentrant_checkpoint = checkpoint


def detach_variable(inputs, device=None):
    """Each tensor of the tuple ``inputs`` detached from its graph (moved to ``device`` first when given), keeping
    whether it requires a gradient; other items unchanged (DeepSpeed's helper, which checkpointing code imports)."""
    if not isinstance(inputs, tuple):
        raise RuntimeError(f"detach_variable takes a tuple of tensors, not {type(inputs).__name__}")
    out = []
    for item in inputs:
        if isinstance(item, torch.Tensor):
            detached = (item if device is None else item.to(device=device)).detach()
            detached.requires_grad = item.requires_grad
            item = detached
        out.append(item)
    return tuple(out)


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None):  # fmt: skip
    """Record DeepSpeed's activation-checkpointing options (from the arguments, else the config's
    ``activation_checkpointing`` section); see the module docstring for what each does here."""
    global _configured
    section = _config_section(deepspeed_config)
    given = {"partition_activations": partition_activations, "contiguous_checkpointing": contiguous_checkpointing,
             "num_checkpoints": num_checkpoints, "checkpoint_in_cpu": checkpoint_in_cpu,
             "synchronize": synchronize, "profile": profile}  # fmt: skip
    for key, value in given.items():
        if value is None:
            value = section.get(_CONFIG_KEYS.get(key, key))
        if value is not None:
            _options[key] = value
    if mpu_ is not None:
        log.warning("deepspeed.checkpointing.configure: mpu is ignored (torsh runs data parallelism only)")
    _configured = True


#: configure()'s argument -> the key of the config's ``activation_checkpointing`` section (DeepSpeed's names).
_CONFIG_KEYS = {"num_checkpoints": "number_checkpoints", "synchronize": "synchronize_checkpoint_boundary",
                "checkpoint_in_cpu": "cpu_checkpointing", "contiguous_checkpointing": "contiguous_memory_optimization"}


def _config_section(deepspeed_config) -> dict:
    if deepspeed_config is None:
        return {}
    if isinstance(deepspeed_config, dict):
        return deepspeed_config.get("activation_checkpointing", {})
    import json

    with open(deepspeed_config) as f:
        return json.load(f).get("activation_checkpointing", {})


def is_configured() -> bool:
    """Whether :func:`configure` was called."""
    return _configured


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; there are none."""


def set_num_layers(nlayers) -> None:
    _options["num_checkpoints"] = nlayers


def partition_activations_in_checkpoint(partition_activation) -> None:
    _options["partition_activations"] = bool(partition_activation)


def model_parallel_cuda_manual_seed(seed) -> None:
    """Seed the accelerator (there is one model-parallel rank)."""
    from ...accelerator import get_accelerator

    get_accelerator().manual_seed(seed)


class _RngTracker:
    """DeepSpeed's CUDA RNG tracker, reduced to one default state: ``fork()`` runs the block as is."""

    def fork(self, name="model-parallel-rng"):
        return contextlib.nullcontext()

    def add(self, name, seed) -> None:
        pass

    def reset(self) -> None:
        pass

    def get_states(self) -> dict:
        return {}

    def set_states(self, states) -> None:
        pass


_tracker = _RngTracker()


def get_cuda_rng_tracker() -> _RngTracker:
    return _tracker
