"""``deepspeed.runtime.config``: the config as a script can read it back."""

from __future__ import annotations

import json
from typing import Any


class DeepSpeedConfigError(Exception):
    """A DeepSpeed config that cannot be read."""


class DeepSpeedConfig:
    """A DeepSpeed config (dict or JSON path) read the torsh way; its resolved values as DeepSpeed names them.

    ``_param_dict`` is the dict as given; the attributes scripts read (``train_batch_size``,
    ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``zero_optimization_stage``,
    ``zero_enabled``, ``fp16_enabled``, ``bfloat16_enabled``, ``gradient_clipping``) come from torsh's reading,
    with the batch sizes resolved against the world size (``"auto"`` left unresolved is None).
    """

    def __init__(self, config: str | dict, mpu=None, mesh_device=None):
        if isinstance(config, dict):
            self._param_dict = config
        else:
            try:
                with open(config) as f:
                    self._param_dict = json.load(f)
            except (OSError, ValueError) as exc:
                raise DeepSpeedConfigError(f"cannot read the DeepSpeed config {config!r}: {exc}") from exc
        from torsh import adapters

        self.torsh_config = adapters.load(self._param_dict).result
        self._read_batch()
        cfg = self.torsh_config
        self.zero_optimization_stage = cfg.sharding.stage
        self.zero_enabled = cfg.sharding.stage > 0
        self.fp16_enabled = cfg.precision.param_dtype == "fp16"
        self.bfloat16_enabled = cfg.precision.param_dtype == "bf16"
        self.gradient_clipping = float(cfg.gradients.clip_max_norm or 0.0)

    def _read_batch(self) -> None:
        cfg: Any = self.torsh_config
        batch = cfg.batch
        self.train_batch_size = _number(batch.global_batch_size)
        self.train_micro_batch_size_per_gpu = _number(batch.micro_batch_size)
        self.gradient_accumulation_steps = _number(batch.gradient_accumulation_steps)
        try:
            import torch.distributed as dist

            world = dist.get_world_size() if dist.is_initialized() else 1
            resolved = batch.resolve(world)
        except Exception:  # unresolvable ("auto" left, or inconsistent): keep what the file says
            resolved = None
        if resolved is not None:
            self.train_batch_size = resolved.global_batch_size
            self.train_micro_batch_size_per_gpu = resolved.micro_batch_size
            self.gradient_accumulation_steps = resolved.gradient_accumulation_steps


def _number(value):
    return value if isinstance(value, int) else None
