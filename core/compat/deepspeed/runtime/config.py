"""``deepspeed.runtime.config``: ``DeepSpeedConfig`` (a DeepSpeed config read with DeepSpeed's meaning), the
optimizer-name constants and the ``get_*`` readers of single keys, as DeepSpeed 0.19.8 has them.

``DeepSpeedConfig(config)`` takes a dict, a JSON/HJSON file path or base64-encoded JSON. It resolves the batch
sizes against the world size (``torch.distributed``'s, 1 before it is initialised) with DeepSpeed's rule (any two
of ``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps`` give the third;
inconsistent ones are an ``AssertionError``) and checks what DeepSpeed checks (``gradient_allreduce_op``, bf16
with fp16). ``torsh_config`` is the same config read the torsh way (what the torsh engine runs).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

from torsh.engine.engine_members import register_config_view
from torsh.errors import ConfigError

from .config_utils import dict_raise_error_on_duplicate_keys, get_scalar_param
from .constants import *  # noqa: F401,F403 (DeepSpeed's module re-exports its constants)
from .constants import (
    CHECKPOINT,
    CHECKPOINT_TAG_VALIDATION,
    CHECKPOINT_TAG_VALIDATION_DEFAULT,
    CHECKPOINT_TAG_VALIDATION_MODES,
    GRADIENT_ALLREDUCE_OP,
    GRADIENT_ALLREDUCE_OP_DEFAULT,
    GRADIENT_ALLREDUCE_OP_SUM,
    GRADIENT_ALLREDUCE_OP_SUPPORTED,
    GRADIENT_CLIPPING,
    GRADIENT_CLIPPING_DEFAULT,
    LOG_LEVEL,
    LOG_LEVEL_DEFAULT,
    ValidationMode,
)
from .precision_config import get_bfloat16_config, get_float16_config

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, MUADAM_OPTIMIZER,
                        MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER]  # fmt: skip
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True
TENSOR_CORE_ALIGN_SIZE = 8


class DeepSpeedConfigError(Exception):
    """A DeepSpeed config that cannot be read."""


class InvalidConfig(ConfigError, DeepSpeedConfigError):
    """A config ``deepspeed.initialize`` refuses: torsh's ``ConfigError`` (every problem, each naming its key),
    caught by ``except deepspeed.DeepSpeedConfigError`` as DeepSpeed's refusals are (and by ``except
    ValueError``)."""


class _UnreadableConfig(DeepSpeedConfigError, ValueError):
    """The config file is not valid JSON/HJSON or gives a key twice (DeepSpeed raises ``ValueError`` there)."""


# ---- readers of single keys (DeepSpeed's get_* functions: the value, or DeepSpeed's default) ----------------


def get_train_batch_size(param_dict):
    return get_scalar_param(param_dict, "train_batch_size", None)


def get_train_micro_batch_size_per_gpu(param_dict):
    return get_scalar_param(param_dict, "train_micro_batch_size_per_gpu", None)


def get_gradient_accumulation_steps(param_dict):
    return get_scalar_param(param_dict, "gradient_accumulation_steps", None)


def get_steps_per_print(param_dict):
    return get_scalar_param(param_dict, "steps_per_print", None)


def get_gradient_clipping(param_dict):
    """``gradient_clipping``; DeepSpeed 0.19.8's default is 1.0 (0 disables clipping)."""
    return get_scalar_param(param_dict, GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT)


def get_log_level(param_dict):
    """``log_level`` (None: the DeepSpeed logger's level is left as it is)."""
    return get_scalar_param(param_dict, LOG_LEVEL, LOG_LEVEL_DEFAULT)


def get_gradient_allreduce_op(param_dict):
    """``gradient_allreduce_op``, lower-cased: ``"mean"`` (default) or ``"sum"``; anything else is a
    ``ValueError``."""
    value = get_scalar_param(param_dict, GRADIENT_ALLREDUCE_OP, GRADIENT_ALLREDUCE_OP_DEFAULT)
    if isinstance(value, str):
        value = value.lower()
    if value not in GRADIENT_ALLREDUCE_OP_SUPPORTED:
        raise ValueError(f"Invalid {GRADIENT_ALLREDUCE_OP}. Supported operations: "
                         f"{list(GRADIENT_ALLREDUCE_OP_SUPPORTED)}. Got: {value!r}")  # fmt: skip
    return value


def _check_allreduce_op(op: str, stage, zenflow: bool, deepcompile: bool) -> None:
    """DeepSpeed's refusals of ``gradient_allreduce_op: "sum"`` (its config's error check), same messages."""
    if op == GRADIENT_ALLREDUCE_OP_SUM:
        if stage == 3:
            raise ValueError(f"{GRADIENT_ALLREDUCE_OP}='sum' is not supported with ZeRO stage 3")
        if zenflow:
            raise ValueError(f"{GRADIENT_ALLREDUCE_OP}='sum' is not supported with ZenFlow")
        if deepcompile:
            raise ValueError(f"{GRADIENT_ALLREDUCE_OP}='sum' is not supported with DeepCompile")


def _as_dict(config) -> dict | None:
    """``config`` (a dict, a JSON path or a base64 string) as a dict; None when it is unreadable or no object, which
    the reader that reads it whole reports."""
    try:
        d = config if isinstance(config, dict) else _read(config)
    except Exception:  # noqa: BLE001 - an unreadable config is reported by the reader that reads it whole
        return None
    return d if isinstance(d, dict) else None


def check_gradient_allreduce_op(config) -> None:
    """What DeepSpeed's engine refuses about ``gradient_allreduce_op`` when it reads ``config`` (a dict, a JSON
    path or a base64 string): an unknown operation, and ``"sum"`` at ZeRO-3, with ZenFlow or with DeepCompile
    (``ValueError``, DeepSpeed's messages). Other problems are left to the config's full reading."""
    d = _as_dict(config)
    if d is None:
        return
    op = get_gradient_allreduce_op(d)
    zero = d.get("zero_optimization") if isinstance(d.get("zero_optimization"), dict) else {}
    compile_ = d.get("compile") if isinstance(d.get("compile"), dict) else {}
    stage = 3 if str(zero.get("stage")) == "3" else zero.get("stage")
    _check_allreduce_op(op, stage, zero.get("zenflow") is not None, bool(compile_.get("deepcompile")))


def check_optimizer_construction(config, optimizer) -> None:
    """What DeepSpeed's engine refuses when it sets up the optimizer for ``config`` (read as by
    :func:`check_gradient_allreduce_op`) and the ``optimizer`` the script passed, with its exceptions and messages:
    ZeRO-Offload of the optimizer (``offload_optimizer.device`` cpu or nvme) with an optimizer object that is not
    ``DeepSpeedCPUAdam`` / ``DeepSpeedCPULion``, unless ``zero_force_ds_cpu_optimizer: false``
    (``ZeRORuntimeException``); at ZeRO 1/2 with an optimizer, an ``allgather_bucket_size`` that is not a multiple
    of 2 (``AssertionError``)."""
    import torch

    d = _as_dict(config)
    if d is None:
        return
    zero = d.get("zero_optimization") if isinstance(d.get("zero_optimization"), dict) else {}
    offload = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
    if (isinstance(optimizer, torch.optim.Optimizer) and str(offload.get("device", "none")).lower() in ("cpu", "nvme")
            and get_scalar_param(d, ZERO_FORCE_DS_CPU_OPTIMIZER, True)):  # fmt: skip
        from ..ops.adam import DeepSpeedCPUAdam
        from ..ops.lion import DeepSpeedCPULion
        from .zero.utils import ZeRORuntimeException

        if not isinstance(optimizer, (DeepSpeedCPUAdam, DeepSpeedCPULion)):
            raise ZeRORuntimeException(
                f"You are using ZeRO-Offload with a client provided optimizer ({type(optimizer)}) which in most cases "
                "will yield poor performance. Please either use deepspeed.ops.adam.DeepSpeedCPUAdam or set an "
                "optimizer in your ds-config (https://www.deepspeed.ai/docs/config-json/#optimizer-parameters). If "
                "you really want to use a custom optimizer w. ZeRO-Offload and understand the performance impacts "
                "you can also set <\"zero_force_ds_cpu_optimizer\": false> in your configuration file.")
    stage = str(zero.get("stage", 0))
    size = zero.get("allgather_bucket_size")
    has_optimizer = optimizer is not None or isinstance(d.get("optimizer"), dict)
    if stage in ("1", "2") and has_optimizer and isinstance(size, (int, float)) and not isinstance(size, bool):
        assert int(size) % 2 == 0, "allgather_bucket_size must be a multiple of nccl_start_alignment_factor, 2 "


def check_hpz_partition_size(config, world_size: int) -> None:
    """What DeepSpeed refuses about ZeRO++ ``zero_hpz_partition_size`` when ZeRO-3 starts: a partition size
    (capped at ``world_size``) that does not divide the number of ranks (its ``_ensure_divisibility``). The engine
    runs hpZ as plain ZeRO-3 over all ranks (the DeepSpeed reader's finding), so this is the only check left."""
    d = _as_dict(config)
    zero = d.get("zero_optimization") if isinstance(d, dict) else None
    if not isinstance(zero, dict) or str(zero.get("stage")) != "3":
        return
    size = zero.get("zero_hpz_partition_size")
    if isinstance(size, int) and not isinstance(size, bool) and size > 1 and world_size % min(size, world_size):
        from torsh.errors import Problem

        raise InvalidConfig([Problem("zero_optimization.zero_hpz_partition_size", size,
                                     f"{world_size} is not divisible by {size}, as DeepSpeed refuses it: use a "
                                     "divisor of the number of ranks, or 1 (off)")])


def get_prescale_gradients(param_dict):
    return get_scalar_param(param_dict, "prescale_gradients", False)


def get_gradient_predivide_factor(param_dict):
    return get_scalar_param(param_dict, "gradient_predivide_factor", 1.0)


def get_communication_data_type(param_dict, comm_type="communication_data_type", comm_data_type_default=None):
    """``communication_data_type`` as a torch dtype (``fp32``, ``fp16``, ``bf16``), None when absent."""
    value = param_dict.get(comm_type, comm_data_type_default)
    if value is None:
        return None
    import torch

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    value = str(value).lower()
    if value not in dtypes:
        raise ValueError(f"Invalid {comm_type}. Supported data types: ['fp16', 'bf16', 'fp32']. Got: {value}")
    return dtypes[value]


def get_optimizer_name(param_dict):
    section = param_dict.get("optimizer")
    return section.get("type") if isinstance(section, dict) else None


def get_optimizer_params(param_dict):
    name = get_optimizer_name(param_dict)
    return param_dict["optimizer"].get("params") if name is not None else None


def get_optimizer_gradient_clipping(param_dict):
    params = get_optimizer_params(param_dict)
    return params.get("max_grad_norm") if params else None


def get_scheduler_name(param_dict):
    section = param_dict.get("scheduler")
    return section.get("type") if isinstance(section, dict) else None


def get_scheduler_params(param_dict):
    name = get_scheduler_name(param_dict)
    return param_dict["scheduler"].get("params") if name is not None else None


def get_zero_allow_untested_optimizer(param_dict):
    return get_scalar_param(param_dict, "zero_allow_untested_optimizer", False)


def get_wall_clock_breakdown(param_dict):
    return get_scalar_param(param_dict, "wall_clock_breakdown", False)


def get_memory_breakdown(param_dict):
    return get_scalar_param(param_dict, "memory_breakdown", False)


def get_dataloader_drop_last(param_dict):
    return get_scalar_param(param_dict, "dataloader_drop_last", False)


def get_dump_state(param_dict):
    return get_scalar_param(param_dict, "dump_state", False)


def get_disable_allgather(param_dict):
    return get_scalar_param(param_dict, "disable_allgather", False)


def get_checkpoint_params(param_dict):
    return param_dict.get(CHECKPOINT, {})


def get_checkpoint_tag_validation_mode(checkpoint_params):
    """``checkpoint.tag_validation`` upper-cased (``WARN`` default, ``IGNORE``, ``FAIL``); anything else is a
    :class:`DeepSpeedConfigError`."""
    mode = checkpoint_params.get(CHECKPOINT_TAG_VALIDATION, CHECKPOINT_TAG_VALIDATION_DEFAULT)
    mode = mode.upper() if isinstance(mode, str) else mode
    if mode not in CHECKPOINT_TAG_VALIDATION_MODES:
        raise DeepSpeedConfigError(f"Checkpoint config contains invalid tag_validation value of {mode}, expecting "
                                   f"one of {CHECKPOINT_TAG_VALIDATION_MODES}")  # fmt: skip
    return mode


def _read(config: str) -> dict:
    if os.path.exists(config):
        try:
            import hjson
        except ModuleNotFoundError:  # plain JSON without hjson
            hjson = json
        try:
            with open(config, encoding="utf-8") as f:
                return hjson.load(f, object_pairs_hook=dict_raise_error_on_duplicate_keys)
        except OSError as exc:
            raise DeepSpeedConfigError(f"cannot read the DeepSpeed config {config!r}: {exc}") from exc
        except ValueError as exc:
            raise _UnreadableConfig(f"cannot read the DeepSpeed config {config!r}: {exc}") from exc
    try:
        return json.loads(base64.urlsafe_b64decode(config).decode("utf-8"))
    except (UnicodeDecodeError, AttributeError, ValueError, TypeError):
        raise _UnreadableConfig(f"Expected a string path to an existing deepspeed config, or a dictionary or a valid "
                                f"base64. Received: {config}") from None  # fmt: skip


def _world_size(mpu=None, mesh_device=None) -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        if mpu is not None and hasattr(mpu, "get_data_parallel_world_size"):
            return dist.get_rank(), mpu.get_data_parallel_world_size()
        return dist.get_rank(), dist.get_world_size()
    except (RuntimeError, AssertionError, AttributeError):
        return 0, 1


class DeepSpeedConfig:
    """A DeepSpeed config read as DeepSpeed reads it (see the module docstring); ``_param_dict`` is the dict as
    given. ``torsh_config`` (read on first use) is the same config read the torsh way."""

    def __init__(self, config: str | dict, mpu=None, mesh_device=None):
        self._param_dict = config if isinstance(config, dict) else _read(config)
        self.global_rank, self.world_size = _world_size(mpu, mesh_device)
        self._initialize_params(dict(self._param_dict))
        self._configure_train_batch_size()
        self._do_error_check()

    @classmethod
    def _of_engine(cls, engine) -> "DeepSpeedConfig":
        """The config of a running torsh engine (``engine._config``): its dict read as DeepSpeed reads it, the batch
        sizes and world size those the engine runs with. A config DeepSpeed's reader would refuse but the torsh
        engine runs (another dialect, torsh's own keys) keeps the values the engine resolved."""
        self = cls.__new__(cls)
        self._param_dict = engine.config if isinstance(engine.config, dict) else {}
        self.global_rank, self.world_size = engine.global_rank, engine.world_size
        try:
            self._initialize_params(dict(self._param_dict))
        except Exception:  # noqa: BLE001 (not a DeepSpeed dict: the engine's own reading stands)
            pass
        self.train_batch_size = engine.train_batch_size()
        self.train_micro_batch_size_per_gpu = engine.train_micro_batch_size_per_gpu()
        self.gradient_accumulation_steps = engine.gradient_accumulation_steps()
        self.zero_optimization_stage = engine.zero_optimization_stage()
        self.zero_enabled = self.zero_optimization_stage > 0
        self.fp16_enabled, self.bfloat16_enabled = engine.fp16_enabled(), engine.bfloat16_enabled()
        self.gradient_clipping = engine._clip  # what the engine clips at
        return self

    @property
    def torsh_config(self) -> Any:
        if "_torsh_config" not in self.__dict__:
            from torsh import adapters

            self.__dict__["_torsh_config"] = adapters.load(self._param_dict).result
        return self.__dict__["_torsh_config"]

    def _initialize_params(self, d: dict) -> None:
        from ..monitor.config import get_monitor_config
        from .zero.config import get_zero_config

        self.train_batch_size = _batch_number(get_train_batch_size(d))
        self.train_micro_batch_size_per_gpu = _batch_number(get_train_micro_batch_size_per_gpu(d))
        self.gradient_accumulation_steps = _batch_number(get_gradient_accumulation_steps(d))
        self.steps_per_print = get_steps_per_print(d)
        self.dump_state = get_dump_state(d)
        self.disable_allgather = get_disable_allgather(d)
        self.communication_data_type = get_communication_data_type(d)
        self.prescale_gradients = get_prescale_gradients(d)
        self.gradient_predivide_factor = get_gradient_predivide_factor(d)
        self.gradient_allreduce_op = get_gradient_allreduce_op(d)
        self.zero_config = get_zero_config(d)
        self.zero_optimization_stage = int(self.zero_config.stage)
        self.zero_enabled = self.zero_optimization_stage > 0
        self.gradient_clipping = get_gradient_clipping(d)
        self.monitor_config = get_monitor_config(d)
        self.float16_config = get_float16_config(d)
        self.bfloat16_config = get_bfloat16_config(d)
        assert not (self.float16_config.enabled and self.bfloat16_config.enabled), (
            "bfloat16 and fp16 modes cannot be simultaneously enabled")
        self.fp16_enabled = self.float16_config.enabled
        self.bfloat16_enabled = self.bfloat16_config.enabled
        self.fp16_auto_cast = self.float16_config.auto_cast
        self.loss_scale = self.float16_config.loss_scale
        self.initial_dynamic_scale = self.float16_config.initial_dynamic_scale()
        self.dynamic_loss_scale_args = self.float16_config.dynamic_loss_scale_args()
        self.optimizer_name = get_optimizer_name(d)
        if isinstance(self.optimizer_name, str) and self.optimizer_name.lower() in DEEPSPEED_OPTIMIZERS:
            self.optimizer_name = self.optimizer_name.lower()
        self.optimizer_params = get_optimizer_params(d)
        self.zero_allow_untested_optimizer = get_zero_allow_untested_optimizer(d)
        self.scheduler_name = get_scheduler_name(d)
        self.scheduler_params = get_scheduler_params(d)
        self.wall_clock_breakdown = get_wall_clock_breakdown(d) or bool(
            d.get("flops_profiler", {}).get("enabled", False))
        self.memory_breakdown = get_memory_breakdown(d)
        mode = get_checkpoint_tag_validation_mode(get_checkpoint_params(d))
        self.checkpoint_tag_validation_enabled = mode != ValidationMode.IGNORE
        self.checkpoint_tag_validation_fail = mode == ValidationMode.FAIL
        checkpoint = get_checkpoint_params(d)
        self.load_universal_checkpoint = checkpoint.get("load_universal", False)
        self.use_node_local_storage = checkpoint.get("use_node_local_storage", False)
        self.dataloader_drop_last = get_dataloader_drop_last(d)
        self.log_level = get_log_level(d)
        data_types = d.get("data_types") if isinstance(d.get("data_types"), dict) else {}
        # as given ("bf16"/"fp16"/"fp32" or None), as DeepSpeed keeps them
        self.grad_accum_dtype = data_types.get("grad_accum_dtype")
        self.param_dtype = data_types.get("param_dtype")
        self.buffer_dtype = data_types.get("buffer_dtype")
        self.compile_deepcompile = bool(d.get("compile", {}).get("deepcompile", False))
        self.eigenvalue_enabled = bool(d.get("eigenvalue", {}).get("enabled", False))
        self.eigenvalue_verbose = bool(d.get("eigenvalue", {}).get("verbose", False))
        self.pld_enabled = bool(d.get("progressive_layer_drop", {}).get("enabled", False))

    def _set_batch_related_parameters(self) -> None:
        """Fill the one (or two) batch numbers not given, as DeepSpeed does."""
        train, micro, gas, world = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                    self.gradient_accumulation_steps, self.world_size)  # fmt: skip
        if train is not None and micro is not None and gas is not None:
            return
        if train is not None and micro is not None:
            self.gradient_accumulation_steps = train // micro // world
        elif train is not None and gas is not None:
            self.train_micro_batch_size_per_gpu = train // world // gas
        elif micro is not None and gas is not None:
            self.train_batch_size = micro * gas * world
        elif train is not None:
            self.gradient_accumulation_steps = 1
            self.train_micro_batch_size_per_gpu = train // world
        elif micro is not None:
            self.train_batch_size = micro * world
            self.gradient_accumulation_steps = 1
        else:
            raise AssertionError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")

    def _batch_assertion(self) -> None:
        train, micro, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        assert train > 0, f"Train batch size: {train} has to be greater than 0"
        assert micro > 0, f"Micro batch size per gpu: {micro} has to be greater than 0"
        assert gas > 0, f"Gradient accumulation steps: {gas} has to be greater than 0"
        assert train == micro * gas * self.world_size, (
            "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            f"gradient_acc_step * world_size {train} != {micro} * {gas} * {self.world_size}")

    def _configure_train_batch_size(self) -> None:
        self._set_batch_related_parameters()
        self._batch_assertion()

    def _do_error_check(self) -> None:
        _check_allreduce_op(self.gradient_allreduce_op, self.zero_optimization_stage,
                            self.zero_config.zenflow is not None, self.compile_deepcompile)  # fmt: skip

    def print(self, name) -> None:
        from ..utils import logger

        logger.info(f"{name}:")
        for key in sorted(vars(self)):
            if not key.startswith("_"):
                logger.info(f"  {key} {'.' * (29 - len(key))} {getattr(self, key)}")
        logger.info(f"  json = {json.dumps(self._param_dict, sort_keys=True, indent=4, default=str)}")


def _batch_number(value):
    """A batch number as DeepSpeed would use it; ``"auto"`` (left by a library that fills it later) is None."""
    return None if isinstance(value, str) else value


# engine._config of every torsh engine is this reading of its config (the engine does not import this package)
register_config_view(DeepSpeedConfig._of_engine)
