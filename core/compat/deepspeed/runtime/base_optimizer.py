"""``deepspeed.runtime.base_optimizer``: the base classes of DeepSpeed's optimizer wrappers, for ``isinstance``
checks (Lightning's ``DeepSpeedStrategy.load_checkpoint`` tests ``DeepSpeedOptimizer``; DeepSpeed's tests and scripts
test ``ZeROOptimizer`` before calling ``needs_scaler()``). The torsh engine steps a torch optimizer
(``engine.optimizer``): at ZeRO stages 1-3 it is an instance of ``ZeROOptimizer`` and of its base
``DeepSpeedOptimizer`` (marked by the engine, as DeepSpeed's ZeRO optimizers are ones), elsewhere of neither."""

from __future__ import annotations

from torsh.engine.direct_backward import ZERO_MARK


class _ZeroOptimizerType(type):
    """``isinstance(x, cls)`` for the two bases below is also true for the torsh engine's optimizer at ZeRO 1-3
    (marked by the engine); a subclass (a script's own optimizer wrapper) keeps the usual check."""

    def __instancecheck__(cls, obj) -> bool:
        marked = cls.__dict__.get("_takes_engine_mark", False) and bool(getattr(obj, ZERO_MARK, False))
        return marked or super().__instancecheck__(obj)


class DeepSpeedOptimizer(metaclass=_ZeroOptimizerType):
    """DeepSpeed's base of its optimizer wrappers: the torsh engine's optimizer at ZeRO 1-3 is one (at stage 0
    DeepSpeed's fp16/bf16 wrapper is one too; torsh's is not)."""

    _takes_engine_mark = True


class ZeROOptimizer(DeepSpeedOptimizer):
    """DeepSpeed's base of its ZeRO optimizers: the torsh engine's optimizer at ZeRO 1-3 is one."""

    _takes_engine_mark = True
