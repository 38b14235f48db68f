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

# DeepSpeed's module globals, under DeepSpeed's names (scripts and tests read and save them around configure()).
deepspeed_checkpointing_enabled = False
mpu = None
PARTITION_ACTIVATIONS = False
CONTIGUOUS_CHECKPOINTING = False
num_layers = None
CPU_CHECKPOINT = False
SYNCHRONIZE = False
PROFILE_TIME = False

#: configure()'s argument -> the module global that holds it.
_GLOBALS = {"partition_activations": "PARTITION_ACTIVATIONS", "contiguous_checkpointing": "CONTIGUOUS_CHECKPOINTING",
            "num_checkpoints": "num_layers", "checkpoint_in_cpu": "CPU_CHECKPOINT", "synchronize": "SYNCHRONIZE",
            "profile": "PROFILE_TIME"}  # fmt: skip
_DEFAULTS = {"partition_activations": False, "contiguous_checkpointing": False, "num_checkpoints": None,
             "checkpoint_in_cpu": False, "synchronize": False, "profile": False}  # fmt: skip


class _Options:
    """The options by configure()'s argument names, read from and written to the module globals."""

    def __getitem__(self, key):
        return globals()[_GLOBALS[key]]

    def __setitem__(self, key, value) -> None:
        globals()[_GLOBALS[key]] = value


_options = _Options()


class CheckpointingConfigError(ValueError, AssertionError):
    """An impossible combination of options (an ``AssertionError`` too, as DeepSpeed's ``assert`` raises)."""


def checkpoint(function, *args, **kwargs):
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in backward."""
    offload = torch.autograd.graph.save_on_cpu(pin_memory=False) if CPU_CHECKPOINT else None
    with offload or contextlib.nullcontext():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                                 **kwargs)  # fmt: skip


def non_reentrant_checkpoint(function, *args, **kwargs):
    """DeepSpeed's non-reentrant variant: the same recomputation as :func:`checkpoint` here (torsh's ``checkpoint``
    is non-reentrant too), kept a function of its own because DeepSpeed's pipeline engine tells the two apart: with
    ``checkpoint`` it marks the first stage's inputs as requiring a gradient (reentrant checkpointing needs that),
    with this one it does not."""
    return checkpoint(function, *args, **kwargs)


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
    """Set DeepSpeed's activation-checkpointing options: each call starts from the defaults, then takes the
    config's ``activation_checkpointing`` section, then the arguments given (DeepSpeed's order); see the module
    docstring for what each does here."""
    global deepspeed_checkpointing_enabled, mpu
    section = _config_section(deepspeed_config)
    given = {"partition_activations": partition_activations, "contiguous_checkpointing": contiguous_checkpointing,
             "num_checkpoints": num_checkpoints, "checkpoint_in_cpu": checkpoint_in_cpu,
             "synchronize": synchronize, "profile": profile}  # fmt: skip
    for key, value in given.items():
        if value is None:
            value = section.get(_CONFIG_KEYS.get(key, key), _DEFAULTS[key])
        _options[key] = value
    deepspeed_checkpointing_enabled = True
    if mpu_ is not None:
        mpu = mpu_
        log.warning("deepspeed.checkpointing.configure: mpu is ignored (torsh runs data parallelism only)")
    if CONTIGUOUS_CHECKPOINTING and not PARTITION_ACTIVATIONS:
        raise CheckpointingConfigError("contiguous_checkpointing (contiguous_memory_optimization) needs "
                                       "partition_activations: set both, or neither")
    if CONTIGUOUS_CHECKPOINTING and num_layers is None:
        raise CheckpointingConfigError("contiguous_checkpointing needs the number of layers: pass num_checkpoints= "
                                       "(or number_checkpoints in the activation_checkpointing section)")


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
    return deepspeed_checkpointing_enabled


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; there are none."""


def set_num_layers(nlayers) -> None:
    global num_layers
    num_layers = nlayers


def partition_activations_in_checkpoint(partition_activation) -> None:
    global PARTITION_ACTIVATIONS
    PARTITION_ACTIVATIONS = bool(partition_activation)


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
