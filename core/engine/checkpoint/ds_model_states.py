"""DeepSpeed's own model-states file in a torsh checkpoint: ``<tag>/mp_rank_00_model_states.pt``.

A torsh checkpoint keeps the model and optimizer state in DCP files, which reshard on load. DeepSpeed, and what
reads its checkpoints, open ``mp_rank_00_model_states.pt`` instead: its ``module`` entry is the model's
``state_dict()`` as the engine holds it (the compute dtype, e.g. bf16, with the buffers), beside the counters, the
scheduler, the config and the client state. Where every rank holds the whole model (stages 0-2 without tensor
parallelism) rank 0 writes that file too, with DeepSpeed's keys, so that

- real DeepSpeed's ``engine.load_checkpoint(dir)`` loads the weights, counters and scheduler of a torsh
  checkpoint, and at ZeRO stage 0 with a plain torch optimizer (no fp32 masters) its optimizer state too: the
  entry ``optimizer`` holds the optimizer's ``state_dict()``, as DeepSpeed writes it for an unwrapped optimizer.
  Elsewhere the optimizer state is in the DCP files only and ``optimizer`` is None (as in DeepSpeed's ZeRO files):
  DeepSpeed loads such a checkpoint with ``load_module_only=True`` or ``load_optimizer_states=False``;
- a script that opens the file (``torch.load(...)["module"]``) finds the weights, without the frozen parameters
  when saved with ``exclude_frozen_parameters=True``.

Its tensors are CPU copies, so the file loads on any device, and it loads with ``torch.load(weights_only=True)``.
At ZeRO-3 (FSDP2) and under tensor parallelism no rank holds the whole model and no such file is written (DeepSpeed
writes one per rank there, of partitioned placeholders); the torsh loader never reads it (it reads the DCP files).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


def model_states_file(mp_rank: int = 0) -> str:
    """DeepSpeed's name of model-parallel rank ``mp_rank``'s model-states file (stages 0-2)."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


MODEL_STATES = model_states_file(0)
VERSION = "0.19.8+torsh"
"""``ds_version``: the DeepSpeed version whose format this is, with a local label saying torsh wrote it."""


def model_states(engine: Any, *, client_state: dict, exclude_frozen: bool) -> dict | None:
    """The contents of DeepSpeed's model-states file for ``engine``'s checkpoint (only rank 0 writes it, or under a
    Megatron-style mpu each model-parallel rank's first data-parallel rank; None on the other ranks and where no
    rank holds the whole model)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    stage = engine.zero_optimization_stage()
    mpu = engine.__dict__.get("_mpu")  # under an mpu the first rank of each data-parallel group writes its own
    writer = mpu.data_rank == 0 if mpu is not None else not (dist.is_initialized() and dist.get_rank() != 0)
    if not writer or stage >= 3 or any(
            isinstance(p, DTensor) for p in engine.module.parameters()):  # fmt: skip
        return None
    module = engine.module_state_dict(exclude_frozen_parameters=exclude_frozen)
    if any(isinstance(t, DTensor) for t in module.values()):
        return None
    names = {}
    for name, p in engine.module.named_parameters():
        names.setdefault(id(p), name)
    part = engine._shard.partition
    optimized = {id(p) for ps in part.group_params for p in ps} if part is not None else set()
    frozen = [(n, p) for n, p in engine.module.named_parameters() if id(p) not in optimized]
    keep_frozen = stage >= 2 and not exclude_frozen  # DeepSpeed writes them where gradients are partitioned
    return {
        "module": OrderedDict((k, cpu_copy(v)) for k, v in module.items()),
        "buffer_names": _buffer_names(engine.module),
        "optimizer": stage0_optimizer_state(engine),  # else in the DCP files only
        "param_shapes": [OrderedDict((names[id(p)], p.shape) for p in ps) for ps in part.group_params]
        if part is not None else None,
        "frozen_param_shapes": OrderedDict((n, p.shape) for n, p in frozen) if keep_frozen else None,
        "shared_params": shared_params(engine.module) if stage >= 1 else None,
        "frozen_param_fragments": OrderedDict((n, cpu_copy(p)) for n, p in frozen) if keep_frozen else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        # DeepSpeed records the ranks the gradients were reduced over: under sequence parallelism every rank
        "dp_world_size": engine.seq_dp_world_size if engine.sequence_parallel_size > 1 else engine.dp_world_size,
        "mp_world_size": engine.mp_world_size,
        "ds_config": engine.config if isinstance(engine.config, dict) else None,
        "ds_version": VERSION,
        **dict(client_state),
    }


def stage0_optimizer_state(engine: Any) -> dict | None:
    """A CPU copy of the optimizer's ``state_dict()`` where DeepSpeed saves its optimizer that way: ZeRO stage 0
    with a plain torch optimizer holding the model's parameters (no fp32 masters, whose state DeepSpeed's
    fp16/bf16 wrappers save in a format of their own); None elsewhere."""
    import torch

    optimizer = engine.optimizer
    plain = isinstance(optimizer, torch.optim.Optimizer) and engine._precision.masters is None
    return cpu_copy(optimizer.state_dict()) if engine.zero_optimization_stage() == 0 and plain else None


def cpu_copy(obj: Any) -> Any:
    """A CPU copy of its own (not a view of a larger storage, which ``torch.save`` would write whole) of a tensor,
    or of each tensor in nested dicts, lists and tuples (an optimizer's ``state_dict()``); other values as they
    are."""
    if hasattr(obj, "detach"):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, cpu_copy(v)) for k, v in obj.items()) if isinstance(obj, OrderedDict) else {
            k: cpu_copy(v) for k, v in obj.items()}  # fmt: skip
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v) for v in obj)
    return obj


def _buffer_names(module: Any) -> list[str]:
    """The persistent buffers' names, as ``state_dict()`` holds them."""
    return [f"{prefix}.{name}" if prefix else name for prefix, sub in module.named_modules()
            for name, buf in sub._buffers.items()
            if buf is not None and name not in sub._non_persistent_buffers_set]  # fmt: skip


def shared_params(module: Any) -> dict[str, str]:
    """Each further name of a tied parameter -> the first name it has (DeepSpeed's ``shared_params``)."""
    first: dict[int, str] = {}
    shared = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            shared[name] = first[id(p)]
        else:
            first[id(p)] = name
    return shared
