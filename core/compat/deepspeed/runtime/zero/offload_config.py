"""``deepspeed.runtime.zero.offload_config``: the enums scripts pass to ``engine.offload_states``."""

from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """Where offloaded state goes."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """Which engine state ``offload_states(include=...)`` moves."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

from pydantic import Field, model_validator  # noqa: E402

from ..config_utils import DeepSpeedConfigModel, pp_int  # noqa: E402


class DeepSpeedZeroOffloadParamConfig(DeepSpeedConfigModel):
    """``zero_optimization.offload_param`` (stage 3), with DeepSpeed's fields and defaults."""

    device: OffloadDeviceEnum = "none"
    nvme_path: Optional[Path] = None
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(pp_int(1e8), ge=0)
    max_in_cpu: int = Field(pp_int(1e9), ge=0)
    pin_memory: bool = True


class DeepSpeedZeroOffloadOptimizerConfig(DeepSpeedConfigModel):
    """``zero_optimization.offload_optimizer``, with DeepSpeed's fields and defaults; ``pipeline`` is set when
    either of ``pipeline_read`` / ``pipeline_write`` is."""

    device: OffloadDeviceEnum = "none"
    nvme_path: Optional[Path] = None
    buffer_count: int = Field(4, ge=0)
    pin_memory: bool = True
    pipeline: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: bool = False
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _pipeline(self):
        pipeline = self.pipeline_read or self.pipeline_write
        if self.pipeline != pipeline:
            self.__dict__["pipeline"] = pipeline  # not through validate_assignment (it would re-run this)
        return self
