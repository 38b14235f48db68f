"""``deepspeed.runtime.zero.stage_1_and_2``: DeepSpeed's ZeRO-2 memory estimators (scripts print them at start-up)
and the name of its ZeRO-1/2 optimizer class, for ``isinstance`` checks: the torsh engine steps a torch optimizer,
so nothing is an instance of it."""

from __future__ import annotations

from ..._unsupported import unsupported_class
from ..utils import count_used_parameters_in_backward  # noqa: F401 (DeepSpeed's module imports it here)
from . import _estimate

DeepSpeedZeroOptimizer = unsupported_class(
    "runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "the torsh engine builds its optimizer at initialize "
    "(engine.optimizer is a torch optimizer over the sharded parameters)")


def estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                                          additional_buffer_factor=1.5) -> tuple[int, int]:  # fmt: skip
    """(bytes per CPU, bytes per GPU) for ZeRO-2: 16-bit parameters on each GPU; gradients, fp32 master weights
    and Adam's two moments (18 bytes a parameter) split over the GPUs, or on the CPU with optimizer offload."""
    gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        return int(total_params * max(4 * gpus, 16) * additional_buffer_factor), int(2 * total_params)
    return (int(total_params * 4 * num_gpus_per_node * additional_buffer_factor),
            int(2 * total_params + int(18 * total_params / gpus)))  # fmt: skip


def estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5) -> None:  # fmt: skip
    """Print the ZeRO-2 estimate with and without optimizer offload for ``total_params`` parameters."""
    rows = [(*estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, offload,
                                                    additional_buffer_factor),
             f"offload_optimizer={'cpu' if offload else 'none'}") for offload in (True, False)]  # fmt: skip
    _estimate.report(2, rows, num_nodes, num_gpus_per_node, total_params)


def estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5) -> None:  # fmt: skip
    """:func:`estimate_zero2_model_states_mem_needs_all_cold` for the parameters of ``model``."""
    estimate_zero2_model_states_mem_needs_all_cold(_estimate.total_params(model), num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)  # fmt: skip
