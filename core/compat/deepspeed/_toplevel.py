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
