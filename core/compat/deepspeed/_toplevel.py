"""Top-level DeepSpeed names that are not a submodule: what torsh does not run, and small helpers."""

from __future__ import annotations

from ._unsupported import unsupported_function

init_inference = unsupported_function("init_inference", "torsh runs training; for inference call the model "
                                      "(model.eval(), torch.no_grad()), or torch.compile it")
tp_model_init = unsupported_function("tp_model_init", "tensor parallelism is not run by the torsh engine; "
                                     "use data parallelism with ZeRO stages 2/3 (FSDP2)")


def add_tuning_arguments(parser):
    """DeepSpeed's autotuning options (``--autotuning``): accepted and not acted on (no autotuner in torsh)."""
    group = parser.add_argument_group("Autotuning", "DeepSpeed autotuning (not run by torsh)")
    group.add_argument("--autotuning", type=str, default="", choices=["", "tune", "run"],
                       help="accepted; torsh has no autotuner")  # fmt: skip
    return parser


class DeepSpeedOptimizer:
    """DeepSpeed's marker base class of its optimizer wrappers (``isinstance`` checks see no torsh optimizer)."""


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=29500, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):  # fmt: skip
    """:func:`torsh.initialize` (``deepspeed.initialize``'s signature), taking the configs DeepSpeed takes from
    the libraries that drive it (the DeepSpeed reader reads Accelerate's ``steps_per_print: inf`` as "never
    print")."""
    from torsh.engine.initialize import initialize as torsh_initialize
    from torsh.errors import ConfigError

    assert model is not None, "deepspeed.initialize requires a model (pass model=your nn.Module)"

    from .runtime.config import InvalidConfig, check_gradient_allreduce_op
    from .runtime.zero.partition_parameters import check_before_initialize

    source = config if config is not None else config_params
    if source is None:
        source = getattr(args, "deepspeed_config", None)
    if source is not None:
        check_gradient_allreduce_op(source)  # DeepSpeed's engine refuses these when it reads the config
    check_before_initialize(model)
    try:
        result = torsh_initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                  training_data=training_data, lr_scheduler=lr_scheduler,
                                  distributed_port=distributed_port, mpu=mpu, dist_init_required=dist_init_required,
                                  collate_fn=collate_fn, config=config, mesh_param=mesh_param,
                                  config_params=config_params)  # fmt: skip
    except ConfigError as exc:
        if isinstance(exc, InvalidConfig):
            raise
        # the same problems, as an error `except deepspeed.DeepSpeedConfigError` catches too (and ValueError)
        raise InvalidConfig(exc.problems, source=exc.source) from None
    level = result[0].log_level()
    if level is not None:  # DeepSpeed sets its logger's level from the config's log_level
        from .utils import set_log_level_from_string

        set_log_level_from_string(level)
    return result
