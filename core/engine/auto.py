"""Resolve every ``"auto"`` value of a config against the running job, saying where each value came from.

One rule set, applied before anything is built: batch sizes from the dataloader that was passed (or a clear
error), bucket sizes from the model's hidden size, optimizer and scheduler values from the optimizer that was
passed. Each resolved value is logged once on rank 0 with its source (user pain: "auto" means different
things to different consumers, and nobody says which value was picked).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from torsh.config import OffloadConfig, ResolvedBatch, TorshConfig
from torsh.deferred import is_deferred
from torsh.errors import ConfigError, Problem
from torsh.sharding_plan import DEEPSPEED_DEFAULTS

log = logging.getLogger("torsh.engine")

#: Resolved when "auto": DeepSpeed 0.19.8 and the HF Trainer both default gradient clipping to 1.0.
DEFAULT_CLIP = 1.0


def hidden_size(model: torch.nn.Module) -> tuple[int, str]:
    """The model's hidden size and where it was found: ``config.hidden_size`` (Hugging Face), else the
    widest dimension of any 2-D weight (so models without a ``config`` still resolve)."""
    config = getattr(model, "config", None)
    for attr in ("hidden_size", "d_model", "n_embd"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value, f"model.config.{attr}"
    sizes = getattr(config, "hidden_sizes", None)
    if isinstance(sizes, (list, tuple)) and sizes:
        return max(sizes), "max(model.config.hidden_sizes)"
    shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in model.parameters()]  # whole, if zero.Init partitioned
    widest = max((max(shape) for shape in shapes if len(shape) == 2), default=0)
    if widest:
        return widest, "the widest 2-D parameter of the model"
    raise ConfigError([Problem("ddp.bucket_cap_mb", "auto", "cannot infer the model's hidden size (no "
                               "model.config.hidden_size and no 2-D weight); give a number")])  # fmt: skip


class _Resolution:
    """The "auto" values resolved so far (``{path: (value, source)}``) and the problems, for the deferred paths
    only: a rule for a path the config does not leave "auto" does nothing."""

    def __init__(self, cfg: TorshConfig) -> None:
        self.values: dict[str, tuple[Any, str]] = {}
        self.problems: list[Problem] = []
        self.deferred = set(cfg.deferred_paths())

    def fill(self, path: str, value: Any, origin: str) -> None:
        """Record ``value`` for ``path`` with where it came from (``origin``, logged), if ``path`` is "auto"."""
        if path in self.deferred:
            self.values[path] = (value, origin)

    def fail(self, path: str, reason: str) -> None:
        if path in self.deferred:
            self.problems.append(Problem(path, "auto", reason))


def resolve_auto(cfg: TorshConfig, *, model: torch.nn.Module, optimizer: Any, training_data: Any,
                 world_size: int) -> tuple[TorshConfig, ResolvedBatch, dict[str, tuple[Any, str]]]:  # fmt: skip
    """The config with every "auto" the engine uses filled in, the resolved batch, and ``{path: (value, source)}``.

    ``optimizer`` is the optimizer instance the script passed (or None); ``training_data`` what it passed
    as training data (a DataLoader's ``batch_size`` resolves the micro-batch size).
    """
    r = _Resolution(cfg)
    _resolve_batch(r, training_data)
    if "ddp.bucket_cap_mb" in r.deferred:
        # DeepSpeed / HF Trainer use hidden_size**2 elements; DDP counts MiB of gradient bytes.
        size, source = hidden_size(model)
        grad_bytes = torch.tensor([], dtype=_first_float_dtype(model)).element_size()
        r.fill("ddp.bucket_cap_mb", size * size * grad_bytes / 2**20,
               f"hidden_size**2 elements, hidden_size from {source}")
    _resolve_buckets(r)
    _resolve_optimizer(r, optimizer)
    _resolve_scheduler(r, cfg, training_data, world_size)
    r.fill("gradients.clip_max_norm", DEFAULT_CLIP, "DeepSpeed 0.19.8's and the HF Trainer's default")
    r.fill("offload.nvme_sub_group_size", OffloadConfig.model_fields["nvme_sub_group_size"].default,
           "DeepSpeed's default sub_group_size")  # fmt: skip
    if "sharding.hybrid_shard_size" in r.deferred:
        _resolve_hybrid_shard_size(r)
    r.fill("parallelism.pp", 1, "no pipeline: DeepSpeed's \"auto\" takes the stages of a PipelineModule, and none "
           "was passed")  # fmt: skip
    r.fail("precision.param_dtype", "has no source here (the HF Trainer fills it from --bf16/--fp16): give fp32, "
           "bf16 or fp16")  # fmt: skip

    # Whatever is still "auto" has no rule: a clear error naming it, never a value guessed later.
    handled = set(r.values) | {p.path for p in r.problems}
    problems = r.problems + [Problem(path, "auto", "torsh.initialize has no rule to resolve it; give a value")
                             for path in sorted(r.deferred - handled)]  # fmt: skip
    if problems:
        raise ConfigError(problems)
    values = r.values
    resolved = cfg.resolve_deferred({path: value for path, (value, _) in values.items()}) if values else cfg
    return resolved, resolved.batch.resolve(world_size), values


def _resolve_batch(r: _Resolution, training_data: Any) -> None:
    """The micro batch is the one number only the data can give; the other two are derived from it."""
    loader_bs = getattr(training_data, "batch_size", None) if isinstance(training_data, torch.utils.data.DataLoader) \
        else None
    if loader_bs:
        r.fill("batch.micro_batch_size", loader_bs, "the batch_size of the DataLoader passed as training_data")
    else:
        r.fail("batch.micro_batch_size", "needs the data: pass a DataLoader as training_data or give a number")
    for key in ("global_batch_size", "gradient_accumulation_steps"):
        r.fill(f"batch.{key}", None, "derived from the other batch sizes and the world size")


def _resolve_buckets(r: _Resolution) -> None:
    """DeepSpeed's sizes left "auto" take DeepSpeed's default, as DeepSpeed reads "auto" itself (the Hugging Face
    Trainer fills them from the model's hidden size before it calls ``initialize``)."""
    for path in sorted(p for p in r.deferred if p.startswith("sharding.buckets.")):
        r.fill(path, DEEPSPEED_DEFAULTS[path.rsplit(".", 1)[-1]], "DeepSpeed's default: DeepSpeed reads \"auto\" "
               "as its default (the HF Trainer fills it from the hidden size before initialize)")


def _resolve_optimizer(r: _Resolution, optimizer: Any) -> None:
    """A passed optimizer overrides the section; its values fill the section's "auto"s."""
    defaults = dict(getattr(optimizer, "defaults", {}) or {})
    for key in ("lr", "weight_decay", "betas", "eps", "momentum"):
        path = f"optimizer.{key}"
        if key in defaults:
            value = tuple(defaults[key]) if key == "betas" else defaults[key]
            r.fill(path, value, f"the {type(optimizer).__name__} passed to initialize")
        elif key == "lr":
            r.fail(path, "needs an optimizer passed to initialize to take it from; give a number")
        else:
            r.fill(path, None, "the optimizer class's default")


def _resolve_scheduler(r: _Resolution, cfg: TorshConfig, training_data: Any, world_size: int) -> None:
    """The peak lr is the optimizer's lr; step counts need the data and data.epochs."""
    lr = r.values.get("optimizer.lr", (None,))[0]
    if lr is None and cfg.optimizer is not None and not is_deferred(cfg.optimizer.lr):
        lr = cfg.optimizer.lr
    for path in ("scheduler.warmup_max_lr", "scheduler.cycle_max_lr"):
        if lr is not None:
            r.fill(path, lr, "the optimizer's lr")
        else:
            r.fail(path, "needs the optimizer's lr (pass an optimizer or set optimizer.lr); give a number")
    r.fill("scheduler.warmup_min_lr", 0.0, "the HF Trainer convention (0)")
    r.fail("scheduler.cycle_min_lr", "has no source to resolve from; give a number")
    steps = _total_steps(cfg, training_data, world_size, r.values)
    if steps is not None:
        r.fill("scheduler.total_num_steps", steps, "data.epochs x optimizer steps per epoch of training_data")
    else:
        r.fail("scheduler.total_num_steps", "needs training_data and data.epochs to count the steps; give a number")
    r.fail("scheduler.warmup_num_steps", "has no source to resolve from; give a number")


def _resolve_hybrid_shard_size(r: _Resolution) -> None:
    """Hybrid sharding without a mesh (FSDP1 HYBRID_SHARD): shard within a node, replicate across nodes."""
    from torsh.ranks import discover

    local = discover().local_world_size
    if local:
        r.fill("sharding.hybrid_shard_size", local, "the processes on one node (the launcher's local world size)")
    else:
        r.fail("sharding.hybrid_shard_size", "the launcher does not say how many processes share a node; give a "
               "number")  # fmt: skip


def _total_steps(cfg: TorshConfig, training_data: Any, world_size: int, values: dict) -> int | None:
    epochs = cfg.data.epochs
    if epochs is None or training_data is None:
        return None
    try:
        n = len(training_data.dataset if isinstance(training_data, torch.utils.data.DataLoader) else training_data)
    except TypeError:
        return None
    batch = cfg.batch.model_copy(update={k.split(".")[1]: v for k, (v, _) in values.items() if k.startswith("batch.")})
    try:
        rb = batch.resolve(world_size)
    except ConfigError:
        return None
    per_rank = -(-n // world_size)
    micro_batches = per_rank // rb.micro_batch_size if cfg.data.drop_last else -(-per_rank // rb.micro_batch_size)
    return max(1, epochs * micro_batches // rb.gradient_accumulation_steps)


def _first_float_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def log_resolved(values: dict[str, tuple[Any, str]], rank: int) -> None:
    """Log each resolved "auto" once, on rank 0, with its source."""
    if rank != 0:
        return
    for path, (value, source) in sorted(values.items()):
        shown = "derived" if value is None and path.startswith("batch.") else value
        log.info('"auto" %s = %s (from %s)', path, shown, source)
