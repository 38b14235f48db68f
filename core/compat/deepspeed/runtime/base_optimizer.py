"""``deepspeed.runtime.base_optimizer``: the base classes of DeepSpeed's optimizer wrappers. Lightning's
``DeepSpeedStrategy.load_checkpoint`` imports ``DeepSpeedOptimizer`` for an ``isinstance`` check. The torsh engine
steps a torch optimizer (``engine.optimizer``), so nothing is an instance of these."""


class DeepSpeedOptimizer:
    """DeepSpeed's base of its optimizer wrappers (no torsh optimizer is one)."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """DeepSpeed's base of its ZeRO optimizers (no torsh optimizer is one)."""
