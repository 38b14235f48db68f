"""``deepspeed.runtime.zero.stage3``: DeepSpeed's ZeRO-3 memory estimators (scripts print them at start-up) and
its ZeRO-3 optimizer class, for ``isinstance`` checks: the torsh engine's optimizer at ZeRO-3 (a torch optimizer
over the FSDP2 shards, with the members of DeepSpeed's that :mod:`torsh.engine.zero3_members` gives it) is an
instance of it; constructing one is refused (the engine builds its optimizer at initialize)."""

from __future__ import annotations

from torsh.engine.zero3_members import MARK

from ..._unsupported import unsupported_class
from ..utils import count_used_parameters_in_backward  # noqa: F401 (DeepSpeed's module imports it here)
from . import _estimate

_Refused = unsupported_class(
    "runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "the torsh engine builds its optimizer at initialize "
    "(engine.optimizer is a torch optimizer over the FSDP2-sharded parameters)")


class _Stage3OptimizerType(type):
    """``isinstance(x, DeepSpeedZeroOptimizer_Stage3)`` is true for the torsh engine's ZeRO-3 optimizer (marked by
    the engine) as well as for instances of subclasses."""

    def __instancecheck__(cls, obj) -> bool:
        return bool(getattr(obj, MARK, False)) or super().__instancecheck__(obj)


class DeepSpeedZeroOptimizer_Stage3(_Refused, metaclass=_Stage3OptimizerType):  # noqa: N801 (DeepSpeed's name)
    __doc__ = _Refused.__doc__


def estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1,
                                          cpu_offload=True, cpu_offload_params=True, zero_init=True,
                                          additional_buffer_factor=1.5) -> tuple[int, int, int]:  # fmt: skip
    """(bytes per CPU, bytes per GPU, bytes of the largest layer) for ZeRO-3: every model state split over the
    GPUs (18 bytes a parameter, 2 of them the 16-bit parameter), or parts of it on the CPU with offload; the
    largest layer is gathered whole (4 bytes a parameter)."""
    gpus, per_node = num_nodes * num_gpus_per_node, 1 / num_nodes
    layer = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        gpu = layer
        cpu = total_params * (18 * per_node if zero_init else max(4 * num_gpus_per_node, 18 * per_node))
    elif cpu_offload:
        gpu = layer + int(2 * total_params / gpus)
        cpu = total_params * (16 * per_node if zero_init else max(4 * num_gpus_per_node, 16 * per_node))
    else:
        gpu = layer + int(18 * total_params / gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node
    return int(cpu * additional_buffer_factor), int(gpu), layer


def estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, num_gpus_per_node=1,
                                                   num_nodes=1, additional_buffer_factor=1.5) -> None:  # fmt: skip
    """Print the ZeRO-3 estimate for each offload choice (parameters and optimizer, optimizer only, none), with
    and without ``zero.Init``."""
    rows = []
    for offload, offload_params in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node,
                                                                num_nodes, offload, offload_params, zero_init,
                                                                additional_buffer_factor)  # fmt: skip
            rows.append((cpu, gpu, f"offload_param={'cpu' if offload_params else 'none'}, "
                                   f"offload_optimizer={'cpu' if offload else 'none'}, zero_init={int(zero_init)}"))
    _estimate.report(3, rows, num_nodes, num_gpus_per_node, total_params, largest_layer_params)


def estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=1, num_nodes=1,
                                                   additional_buffer_factor=1.5) -> None:  # fmt: skip
    """:func:`estimate_zero3_model_states_mem_needs_all_cold` for the parameters of ``model``."""
    estimate_zero3_model_states_mem_needs_all_cold(_estimate.total_params(model), _estimate.largest_layer_params(model),
                                                   num_gpus_per_node, num_nodes, additional_buffer_factor)  # fmt: skip
