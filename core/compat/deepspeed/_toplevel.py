"""Top-level DeepSpeed names that are not a submodule: what torsh does not run, and small helpers."""

from __future__ import annotations

from ._unsupported import unsupported_function

init_inference = unsupported_function("init_inference", "torsh runs training; for inference call the model "
                                      "(model.eval(), torch.no_grad()), or torch.compile it")


def tp_model_init(model, tp_size: int, dtype=None, config=None, **kwargs):
    """DeepSpeed's AutoTP training entry: records ``tp_size`` on the model and returns it unchanged, as DeepSpeed
    (>= 0.18) only records it; ``initialize`` splits the model, the config's ``tensor_parallel.autotp_size`` being
    the canonical source (a missing one is filled from here, a different one is an error). A ``tp_group`` is not
    taken: the engine builds the mesh from the degrees."""
    from torsh.errors import ConfigError, Problem

    if kwargs.get("tp_group") is not None:
        raise ConfigError([Problem("tp_model_init.tp_group", type(kwargs["tp_group"]).__name__, "the torsh engine "
                                   "builds the tensor-parallel group from the degrees: leave tp_group out")])
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ConfigError([Problem("tp_model_init.tp_size", tp_size, "a positive number of ranks")])
    model._torsh_tp_model_init = tp_size
    return model


def add_tuning_arguments(parser):
    """DeepSpeed's autotuning options (``--autotuning``): accepted and not acted on (no autotuner in torsh)."""
    group = parser.add_argument_group("Autotuning", "DeepSpeed autotuning (not run by torsh)")
    group.add_argument("--autotuning", type=str, default="", choices=["", "tune", "run"],
                       help="accepted; torsh has no autotuner")  # fmt: skip
    return parser


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=29500, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):  # fmt: skip
    """:func:`torsh.initialize` (``deepspeed.initialize``'s signature), taking the configs DeepSpeed takes from
    the libraries that drive it (the DeepSpeed reader reads Accelerate's ``steps_per_print: inf`` as "never
    print")."""
    from torsh.engine.initialize import initialize as torsh_initialize
    from torsh.errors import ConfigError

    assert model is not None, "deepspeed.initialize requires a model (pass model=your nn.Module)"

    from .runtime.config import (
        InvalidConfig,
        check_gradient_allreduce_op,
        check_hpz_partition_size,
        check_optimizer_construction,
    )

    source = config if config is not None else config_params
    if source is None:
        source = getattr(args, "deepspeed_config", None)
    if source is not None:
        check_gradient_allreduce_op(source)  # DeepSpeed's engine refuses these when it reads the config
        check_optimizer_construction(source, optimizer)  # and these when it sets up the optimizer
        check_hpz_partition_size(source, _world_size())  # and this when ZeRO-3 partitions the model
    from .runtime.zero.partition_parameters import tensor_overrides_suspended

    try:
        with tensor_overrides_suspended():  # called inside zero.Init: the engine is built with torch's constructors
            result = torsh_initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                      training_data=training_data, lr_scheduler=lr_scheduler,
                                      distributed_port=distributed_port, mpu=mpu,
                                      dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                                      mesh_param=mesh_param, config_params=config_params)  # fmt: skip
    except ConfigError as exc:
        if isinstance(exc, InvalidConfig):
            raise
        # the same problems, as an error `except deepspeed.DeepSpeedConfigError` catches too (and ValueError)
        raise InvalidConfig(exc.problems, source=exc.source) from None
    if mpu is not None:  # DeepSpeed's engine records the unit, and deepspeed.utils.groups answers from it
        from .utils import groups

        groups.mpu = mpu
    if optimizer is None:
        _as_deepspeed_adam(result[0])
    _zero_optimizer_surface(result[0])
    if isinstance(result[0].config, dict) and "comms_logger" in result[0].config:
        from . import comm  # DeepSpeed's engine sets the communication logger from the config it reads

        comm.configure(deepspeed_config=result[0].config)
    level = result[0].log_level()
    if level is not None:  # DeepSpeed sets its logger's level from the config's log_level
        from .utils import set_log_level_from_string

        set_log_level_from_string(level)
    return result


def _world_size() -> int:
    """The number of ranks: the started process group's, else the launcher's ``WORLD_SIZE`` (initialize starts
    the group from it)."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _as_deepspeed_adam(engine) -> None:
    """DeepSpeed builds its own class for a config ``"Adam"`` / ``"AdamW"`` optimizer (``FusedAdam``, or
    ``DeepSpeedCPUAdam`` when ``zero_optimization.offload_optimizer.device`` is cpu or nvme) unless
    ``torch_adam: true``, and scripts check it (``isinstance(optimizer, deepspeed.ops.adam.FusedAdam)``). The torsh
    engine builds ``torch.optim.AdamW`` (or ``Adam`` for ``adam_w_mode: false``), the same update. That object
    becomes an instance of the drop-in's class of the same name, a subclass of ``torch.optim.Adam`` whose step is
    the one it had (the weight-decay mode is each group's ``decoupled_weight_decay``); its parameters, groups,
    state and identity are unchanged, and ``defaults`` gain the keys the class's own constructor sets."""
    import torch

    config = engine.config if isinstance(engine.config, dict) else {}
    section = config.get("optimizer")
    if not isinstance(section, dict) or str(section.get("type", "")).lower() not in ("adam", "adamw"):
        return
    params = section.get("params") if isinstance(section.get("params"), dict) else {}
    if params.get("torch_adam", False):
        return
    from torsh.engine.zero.ds_layout import base_class, retype

    target = engine.optimizer
    if base_class(target) not in (torch.optim.Adam, torch.optim.AdamW):
        return
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    offload = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
    decoupled = all(g.get("decoupled_weight_decay", False) for g in target.param_groups)
    from .ops.adam import DeepSpeedCPUAdam, FusedAdam

    if str(offload.get("device", "none")).lower() in ("cpu", "nvme"):
        retype(target, DeepSpeedCPUAdam)
        target.defaults.update(adamw_mode=decoupled, bias_correction=True, fp32_optimizer_states=True)
    else:
        retype(target, FusedAdam)
        target.defaults.update(adam_w_mode=decoupled, bias_correction=True, set_grad_none=True)


def _zero_optimizer_surface(engine) -> None:
    """At every ZeRO stage DeepSpeed's ``engine.optimizer`` is its ZeRO optimizer, whose ``.optimizer`` is the torch
    optimizer it steps (``engine.optimizer.optimizer.param_groups``). The torsh engine gives stages 1 and 2 that
    member; at stage 3 its optimizer is the torch optimizer itself, which then names itself."""
    optimizer = engine.optimizer
    if optimizer is not None and engine.zero_optimization_stage() == 3 and not hasattr(optimizer, "optimizer"):
        optimizer.optimizer = optimizer
