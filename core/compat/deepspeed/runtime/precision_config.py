"""``deepspeed.runtime.precision_config``: the ``bf16`` (or old ``bfloat16``) and ``fp16`` sections as DeepSpeed
reads them (fields, defaults and checks), for scripts and libraries that inspect a DeepSpeed config."""

from __future__ import annotations

import math

from pydantic import field_validator, model_validator

from .config_utils import DeepSpeedConfigModel

BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"
FP16 = "fp16"


class DeepSpeedBF16Config(DeepSpeedConfigModel):
    """The ``bf16`` section."""

    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


class DeepSpeedFP16Config(DeepSpeedConfigModel):
    """The ``fp16`` section (``loss_scale`` 0: dynamic loss scaling from ``2**initial_scale_power``)."""

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: int = 1
    fp16_master_weights_and_grads: bool = False

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _loss_scale(cls, v):
        if isinstance(v, bool):
            raise ValueError("fp16.loss_scale must be a number, not bool")
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise ValueError("fp16.loss_scale must be a number") from None
        if not math.isfinite(v) or v < 0:
            raise ValueError("fp16.loss_scale must be a finite number >= 0 (0 enables dynamic loss scaling)")
        return v

    @field_validator("loss_scale_window", "min_loss_scale", mode="before")
    @classmethod
    def _integer_not_bool(cls, v, info):
        # pydantic would read True as 1 and pass the positivity check below; DeepSpeed refuses a bool here
        if isinstance(v, bool):
            raise ValueError(f"fp16.{info.field_name} must be an integer, not bool")
        return v

    @model_validator(mode="after")
    def _dynamic(self):
        if self.enabled and self.loss_scale == 0:
            if self.loss_scale_window <= 0:
                raise ValueError("fp16.loss_scale_window must be > 0 when dynamic loss scaling is enabled "
                                 "(loss_scale=0)")  # fmt: skip
            if self.min_loss_scale <= 0:
                raise ValueError("fp16.min_loss_scale must be > 0 when dynamic loss scaling is enabled (loss_scale=0)")
        return self

    def initial_dynamic_scale(self):
        return 2**self.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict:
        return {"init_scale": 2**self.initial_scale_power, "scale_window": self.loss_scale_window,
                "delayed_shift": self.hysteresis, "consecutive_hysteresis": self.consecutive_hysteresis,
                "min_scale": self.min_loss_scale}  # fmt: skip


def get_bfloat16_config(param_dict: dict) -> DeepSpeedBF16Config:
    section = param_dict.get(BFLOAT16)
    if section is None:
        section = param_dict.get(BFLOAT16_OLD, {})
    return DeepSpeedBF16Config(**section)


def get_float16_config(param_dict: dict) -> DeepSpeedFP16Config:
    return DeepSpeedFP16Config(**param_dict.get(FP16, {}))
