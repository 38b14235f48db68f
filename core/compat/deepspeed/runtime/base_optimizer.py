"""``deepspeed.runtime.base_optimizer``: the base classes of DeepSpeed's optimizer wrappers, for ``isinstance``
checks (Lightning's ``DeepSpeedStrategy.load_checkpoint`` tests ``DeepSpeedOptimizer``; DeepSpeed's tests and scripts
test ``ZeROOptimizer`` before calling ``needs_scaler()``). The torsh engine steps a torch optimizer
(``engine.optimizer``): at ZeRO stages 1-3 it is an instance of ``ZeROOptimizer`` and of its base
``DeepSpeedOptimizer`` (marked by the engine, as DeepSpeed's ZeRO optimizers are ones), elsewhere of neither."""

from __future__ import annotations

from torsh.engine.direct_backward import ZERO_MARK


class _ZeroOptimizerType(type):
    """``isinstance(x, cls)`` is true for the torsh engine's optimizer at ZeRO 1-3 (marked by the engine) as well
    as for instances of subclasses."""

    def __instancecheck__(cls, obj) -> bool:
        return bool(getattr(obj, ZERO_MARK, False)) or super().__instancecheck__(obj)


class DeepSpeedOptimizer(metaclass=_ZeroOptimizerType):
    """DeepSpeed's base of its optimizer wrappers: the torsh engine's optimizer at ZeRO 1-3 is one (at stage 0
    DeepSpeed's fp16/bf16 wrapper is one too; torsh's is not)."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """DeepSpeed's base of its ZeRO optimizers: the torsh engine's optimizer at ZeRO 1-3 is one."""
