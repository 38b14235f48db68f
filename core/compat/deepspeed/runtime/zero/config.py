"""``deepspeed.runtime.zero.config``: ``ZeroStageEnum`` and ``DeepSpeedZeroConfig``, the ``zero_optimization``
section as DeepSpeed reads it (its fields, aliases such as ``stage3_prefetch_bucket_size``, defaults and checks).

The torsh engine reads the section through its own config model; this class is for scripts and libraries that
build or inspect DeepSpeed's (``DeepSpeedZeroConfig(**cfg["zero_optimization"]).stage``). ``ZeroStageEnum`` is
also what scripts pass to ``torch.serialization.add_safe_globals`` so that a DeepSpeed checkpoint loads under
torch's ``weights_only`` default; torsh's own checkpoints pickle no DeepSpeed class."""

from __future__ import annotations

import logging
import sys
from enum import Enum
from typing import Optional

from pydantic import Field, model_validator

from ..config_utils import DeepSpeedConfigModel, get_scalar_param, pp_int
from .leaf_module_config import DeepSpeedZeroLeafModuleConfig
from .offload_config import (  # noqa: F401
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)

log = logging.getLogger("DeepSpeed")

ZERO_OPTIMIZATION = "zero_optimization"


class ZeroStageEnum(int, Enum):
    """DeepSpeed's ZeRO stages (``zero_stage`` in its checkpoints)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


def _offload_param(on):
    return DeepSpeedZeroOffloadParamConfig(device=OffloadDeviceEnum.cpu) if on else None


def _offload_optimizer(on):
    return DeepSpeedZeroOffloadOptimizerConfig(device=OffloadDeviceEnum.cpu) if on else None


def _deprecated(new_param: str = "", **extra):
    return {"deprecated": True, "new_param": new_param, **extra}


class DeepSpeedZeroConfig(DeepSpeedConfigModel):
    """The ``zero_optimization`` section with DeepSpeed 0.19.8's fields and defaults. ``overlap_comm`` left
    unset is True at stage 3 and False below; the ``stage3_*`` names are aliases of the fields without the
    prefix; ``cpu_offload`` / ``cpu_offload_param`` / ``stage3_gather_fp16_weights_on_model_save`` are the
    deprecated spellings, carried over to ``offload_optimizer`` / ``offload_param`` /
    ``gather_16bit_weights_on_model_save``."""

    stage: ZeroStageEnum = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(pp_int(5e8), gt=0)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(pp_int(5e8), ge=0)
    overlap_comm: Optional[bool] = None
    compute_grad_norm: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: Optional[DeepSpeedZeroOffloadParamConfig] = None
    offload_optimizer: Optional[DeepSpeedZeroOffloadOptimizerConfig] = None
    zenflow: Optional[dict] = None
    sub_group_size: int = Field(pp_int(1e9), ge=0)
    cpu_offload_param: Optional[bool] = Field(None, json_schema_extra=_deprecated(
        "offload_param", new_param_fn=_offload_param))
    cpu_offload_use_pin_memory: Optional[bool] = Field(None, json_schema_extra=_deprecated(
        "offload_param or offload_optimizer", set_new_param=False))
    cpu_offload: Optional[bool] = Field(None, json_schema_extra=_deprecated(
        "offload_optimizer", new_param_fn=_offload_optimizer))
    prefetch_bucket_size: int = Field(pp_int(5e7), ge=0, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: int = Field(pp_int(1e5), ge=0, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = Field(pp_int(sys.maxsize, "sys.maxsize"), ge=0,
                                             alias="stage3_model_persistence_threshold")  # fmt: skip
    max_live_parameters: int = Field(pp_int(1e9), ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: int = Field(pp_int(1e9), ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold: int = Field(pp_int(0), alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    stage3_gather_fp16_weights_on_model_save: bool = Field(False, json_schema_extra=_deprecated(
        "gather_16bit_weights_on_model_save"))
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    parameter_alignment: bool = False
    zero_hpz_partition_size: int = Field(1, ge=0)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: DeepSpeedZeroLeafModuleConfig = Field(default_factory=DeepSpeedZeroLeafModuleConfig)

    @model_validator(mode="after")
    def _dynamic_defaults(self):
        if self.overlap_comm is None:
            self.__dict__["overlap_comm"] = self.stage == ZeroStageEnum.weights
        if not self.compute_grad_norm and self.stage not in (1, 2):
            raise ValueError("compute_grad_norm=false is supported only with ZeRO Stage 1 or 2")
        if self.offload_optimizer is not None and self.offload_optimizer.ratio < 1.0:
            assert self.stage == ZeroStageEnum.weights, "Partial offloading only supported for ZeRO Stage 3."
        if self.stage == ZeroStageEnum.weights and self.elastic_checkpoint:  # DeepSpeed's warning, on its logger
            log.warning("ZeRO-3 elastic checkpointing is deprecated and no longer supported. Use Universal "
                        "Checkpointing instead.")
        return self


def read_zero_config_deprecated(param_dict: dict) -> dict:
    """The old boolean form (``"zero_optimization": true``: stage 1, ``allgather_size``) as the section dict."""
    section = {"stage": 1 if param_dict[ZERO_OPTIMIZATION] else 0}
    if section["stage"] > 0:
        section["allgather_bucket_size"] = get_scalar_param(param_dict, "allgather_size", 5e8)
    log.warning("DeepSpeedConfig: \"zero_optimization\": true is deprecated; give the section as a dict "
                "({\"stage\": 1, ...})")  # fmt: skip
    return section


def get_zero_config(param_dict: dict) -> DeepSpeedZeroConfig:
    """The ``zero_optimization`` section of a whole DeepSpeed config dict (absent: every default)."""
    section = param_dict.get(ZERO_OPTIMIZATION, {})
    if isinstance(section, bool):
        section = read_zero_config_deprecated(param_dict)
    return DeepSpeedZeroConfig(**section)
