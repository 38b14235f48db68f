"""fp16 loss scaling with a choice of whose rules to follow.

The three dynamic rules differ in ways that show up in a loss curve, so the core model names them
(``precision.loss_scaling.semantics``) and this module follows each one exactly:

``deepspeed_zero``
    DeepSpeed's ``DynamicLossScaler`` (ZeRO 1/2/3). An overflow first spends hysteresis (the scale is kept,
    the step is still skipped); once hysteresis is down to 1 every overflow multiplies the scale by
    ``backoff_factor`` (floored at ``min_scale``), and an overflow *at* ``min_scale`` is fatal
    (:class:`LossScaleAtMinimumError`). Growth happens when ``stable = it - last_overflow_it - 1`` is positive
    and a multiple of the window, i.e. after window + 1 clean steps, then every window; growth refills
    hysteresis (every clean step refills it with ``consecutive_hysteresis``).
``deepspeed_stage0``
    DeepSpeed's stage-0 ``FP16_Optimizer``/``FP16_UnfusedOptimizer``: no hysteresis, every overflow backs
    off (floored at ``min_scale``, never fatal); growth as above.
``torch_grad_scaler``
    ``torch.amp.GradScaler``: every overflow backs off (no floor) and resets the clean-step count; the scale
    grows after exactly ``growth_interval`` consecutive clean steps (only if the grown scale is finite).

``mode="static"`` keeps a fixed scale (an overflowing step is skipped by the engine, the scale stays);
``mode="none"`` is a scale of 1.0.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torsh.config import LossScalingConfig

__all__ = ["LossScaleAtMinimumError", "LossScaler", "build_loss_scaler"]


class LossScaleAtMinimumError(RuntimeError):
    """Gradients overflowed while the loss scale was already at its minimum (DeepSpeed ZeRO stops the run here):
    training in fp16 is diverging. Lower the learning rate, use bf16, or lower ``min_scale``."""


class LossScaler:
    """One loss scaler; build it with :func:`build_loss_scaler`.

    The engine multiplies the loss by ``cur_scale`` (``scale(loss)``), divides the gradients by it, and calls
    ``update(overflow)`` once per optimizer-step boundary with whether the gradients held inf/NaN.
    """

    def __init__(self, *, mode: str, semantics: str, cur_scale: float, growth_interval: int = 1000,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0):  # fmt: skip
        self.mode = mode
        self.semantics = semantics
        self.cur_scale = float(cur_scale)
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        # DeepSpeed's counters (also used by the stage-0 rule).
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = hysteresis
        # GradScaler's counter: consecutive clean steps since the last growth or overflow.
        self.growth_tracker = 0

    @property
    def dynamic(self) -> bool:
        """Whether the scale changes with overflows."""
        return self.mode == "dynamic"

    @property
    def loss_scale(self) -> float:
        """The current scale (DeepSpeed's spelling)."""
        return self.cur_scale

    def scale(self, loss: Any) -> Any:
        """``loss * cur_scale`` (the loss itself when the scale is 1, so no extra graph node is added)."""
        return loss if self.cur_scale == 1.0 else loss * self.cur_scale

    def update(self, overflow: bool) -> None:
        """Account for one optimizer-step boundary; ``overflow``: the gradients held inf/NaN."""
        if not self.dynamic:
            return
        if self.semantics == "torch_grad_scaler":
            self._update_grad_scaler(overflow)
        else:
            self._update_deepspeed(overflow, use_hysteresis=self.semantics == "deepspeed_zero")

    def _update_deepspeed(self, overflow: bool, *, use_hysteresis: bool) -> None:
        if overflow:
            self._deepspeed_overflow(use_hysteresis)
        else:
            self._deepspeed_no_overflow(use_hysteresis)
        self.cur_iter += 1

    def _deepspeed_overflow(self, use_hysteresis: bool) -> None:
        """An overflowed step: the scale backs off (to no less than the minimum), unless hysteresis still
        tolerates an overflow; at stage 1-3 semantics an overflow at the minimum scale is an error."""
        if not use_hysteresis or self.hysteresis == 1 or self.cur_hysteresis == 1:
            if use_hysteresis and self.cur_scale == self.min_scale:
                raise LossScaleAtMinimumError(
                    f"gradients overflowed with the loss scale already at its minimum ({self.min_scale}); "
                    "lower the learning rate, train in bf16, or lower precision.loss_scaling.min_scale")
            self.cur_scale = max(self.cur_scale * self.backoff_factor, self.min_scale)
        else:
            self.cur_hysteresis -= 1
        self.last_overflow_iter = self.cur_iter

    def _deepspeed_no_overflow(self, use_hysteresis: bool) -> None:
        """A clean step: the scale grows after ``growth_interval`` steps without overflow; hysteresis is
        restored after every clean step (``consecutive_hysteresis``) or at growth."""
        if use_hysteresis and self.consecutive_hysteresis:
            self.cur_hysteresis = self.hysteresis
        stable = self.cur_iter - self.last_overflow_iter - 1
        if stable > 0 and stable % self.growth_interval == 0:
            if use_hysteresis and not self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            self.cur_scale *= self.growth_factor

    def _update_grad_scaler(self, overflow: bool) -> None:
        # GradScaler keeps its scale in a float32 tensor; rounding the same way keeps the sequences identical.
        if overflow:
            self.cur_scale = _float32(self.cur_scale * self.backoff_factor)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = _float32(self.cur_scale * self.growth_factor)
            if math.isfinite(grown):  # GradScaler never grows into inf
                self.cur_scale = grown
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the scale sequence after a restart (plain numbers only)."""
        return {
            "mode": self.mode,
            "semantics": self.semantics,
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "growth_tracker": self.growth_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scale and counters saved by :meth:`state_dict` (the rules come from the config)."""
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.growth_tracker = int(state["growth_tracker"])

    def __repr__(self) -> str:
        return f"LossScaler(mode={self.mode!r}, semantics={self.semantics!r}, cur_scale={self.cur_scale})"


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (inf when out of range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def build_loss_scaler(cfg: LossScalingConfig) -> LossScaler:
    """The loss scaler for a ``precision.loss_scaling`` section (:class:`torsh.config.LossScalingConfig`)."""
    common = {"growth_interval": cfg.growth_interval, "growth_factor": cfg.growth_factor,
              "backoff_factor": cfg.backoff_factor, "hysteresis": cfg.hysteresis,
              "consecutive_hysteresis": cfg.consecutive_hysteresis, "min_scale": cfg.min_scale}  # fmt: skip
    if cfg.mode == "none":
        return LossScaler(mode="none", semantics=cfg.semantics, cur_scale=1.0, **common)
    if cfg.mode == "static":
        return LossScaler(mode="static", semantics=cfg.semantics, cur_scale=cfg.static_scale, **common)
    return LossScaler(mode="dynamic", semantics=cfg.semantics, cur_scale=cfg.initial_scale, **common)
