"""DeepSpeed's five learning-rate schedules, reimplemented with DeepSpeed 0.19.8's exact arithmetic.

A training script moving from DeepSpeed must see the same learning rate at every optimizer step, so these
classes keep DeepSpeed's behaviour, quirks included:

* each schedule is a plain object (not a ``torch.optim.lr_scheduler.LRScheduler``) whose iteration counter
  ``last_batch_iteration`` starts at -1;
* the constructor already writes a learning rate into the optimizer (WarmupLR/WarmupDecayLR: the minimum;
  WarmupCosineLR: 0.0; OneCycle and LRRangeTest: their minimum), so the first optimizer update runs with
  that value and the first ``step()`` (iteration 0) usually repeats it;
* warm-up lengths are ``max(2, n)`` and the warm-up curve is logarithmic unless ``warmup_type`` is "linear";
* WarmupCosineLR scales the learning rate each parameter group had at construction, and its cosine phase
  starts one step in (``p = (it - W + 1) / max(1, T - W)``);
* OneCycle cycles Adam's beta1 inversely to the learning rate and writes ``betas = (mom, 0.99)``, i.e. it
  forces beta2 to 0.99; optimizers without ``betas`` in their defaults get no momentum cycling;
* ``state_dict()`` is ``{'last_batch_iteration': it}`` and ``load_state_dict`` restores only the counter
  (the learning rate itself comes back with the optimizer's state).

``build_scheduler`` turns the core model's ``scheduler`` section into one of these, or into any
``torch.optim.lr_scheduler`` class named there.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from .. import config as C
from ..deferred import is_deferred
from ..errors import ConfigError, Problem, did_you_mean

log = logging.getLogger(__name__)

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]


# --------------------------------------------------------------------------------------------------
# helpers shared by the schedules


def _torch_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` behind ``optimizer`` (a wrapper exposing ``.optimizer`` is unwrapped,
    as DeepSpeed does for its ZeRO/fp16 wrappers)."""
    from torch.optim import Optimizer

    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer")


def _per_group(optimizer: Any, value: Any, name: str) -> list[Any]:
    """A scalar broadcast to every parameter group, or a per-group list checked for length."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} values for {name}, got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _write_lrs(param_groups: list[dict], lrs: list[float]) -> list[Any]:
    """Set each group's lr (in place for a tensor lr, so a compiled/capturable optimizer sees it)."""
    import torch

    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def _check_warmup_steps(warmup_num_steps: Any) -> None:
    # bool is an int subclass; DeepSpeed rejects everything that is not a positive int.
    if not isinstance(warmup_num_steps, int) or isinstance(warmup_num_steps, bool) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")


def _warmup_type(warmup_type: str) -> str:
    if warmup_type not in ("log", "linear"):
        log.warning("unknown warmup_type %r: using the logarithmic warm-up (DeepSpeed's default)", warmup_type)
        return "log"
    return warmup_type


class _Schedule:
    """Counter handling and the state-dict contract common to all five schedules."""

    optimizer: Any
    last_batch_iteration: int
    _last_lr: list[Any] | None = None

    def get_lr(self) -> list[float]:  # pragma: no cover - every schedule overrides it
        raise NotImplementedError

    def get_last_lr(self) -> list[Any]:
        """The learning rates written by the last ``step()`` (or by the constructor)."""
        if self._last_lr is None:
            raise RuntimeError("get_last_lr() needs a step() first")
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next iteration) and write its learning rate."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _write_lrs(self.optimizer.param_groups, self.get_lr())

    def state_dict(self) -> dict[str, int]:
        """``{'last_batch_iteration': it}``, DeepSpeed's format."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the iteration counter (the optimizer's state carries the learning rate)."""
        self.last_batch_iteration = state["last_batch_iteration"]


# --------------------------------------------------------------------------------------------------
# the five schedules


class LRRangeTest(_Schedule):
    """``lr = min_lr * (1 + step_rate * I)`` with ``I = (it + 1) / step_size`` (floored when staircase)."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float | list[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):  # fmt: skip
        self.optimizer = _torch_optimizer(optimizer)
        self.min_lr = _per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        if not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size}")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer.param_groups, self.min_lr)

    def _interval(self) -> float:
        interval = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(interval) if self.staircase else interval

    def get_lr(self) -> list[float]:
        """The learning rates for the current iteration."""
        increase = 1 + self.step_rate * self._interval()
        return [min_lr * increase for min_lr in self.min_lr]


class OneCycle(_Schedule):
    """A triangular learning-rate cycle (optionally in stairs) with inverse momentum cycling, then decay."""

    def __init__(self, optimizer: Any, cycle_min_lr: float | list[float], cycle_max_lr: float | list[float],
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float | list[float] = 0.8,
                 cycle_max_mom: float | list[float] = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1):  # fmt: skip
        self.optimizer = _torch_optimizer(optimizer)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second}")
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size = first
        self.second_step_size = second
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)  # fmt: skip
        self.decay_step_size = decay_step_size
        no_decay_steps = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay_steps or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay_steps

        self.min_lrs = _per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        if last_batch_iteration == -1:
            _write_lrs(self.optimizer.param_groups, self.min_lrs)
        self.decay_lr_rate = decay_lr_rate

        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self._init_momentum(cycle_min_mom, cycle_max_mom, decay_mom_rate, last_batch_iteration)
        self.last_batch_iteration = last_batch_iteration

    def _init_momentum(self, min_mom: Any, max_mom: Any, decay_mom_rate: float, last_batch_iteration: int) -> None:
        # DeepSpeed cycles only Adam-style ``betas``; SGD's ``momentum`` is left alone (with a warning).
        if "betas" not in self.optimizer.defaults:
            log.warning("OneCycle: momentum cycling is disabled because %s has no 'betas' in its defaults",
                        type(self.optimizer).__name__)  # fmt: skip
            self.cycle_momentum = False
            return
        self.decay_mom_rate = decay_mom_rate
        # beta2 is fixed at 0.99, whatever the optimizer had: DeepSpeed does this.
        self.min_moms = [(mom, 0.99) for mom in _per_group(self.optimizer, min_mom, "cycle_min_mom")]
        self.max_moms = [(mom, 0.99) for mom in _per_group(self.optimizer, max_mom, "cycle_max_mom")]
        if last_batch_iteration == -1:
            for betas, group in zip(self.min_moms, self.optimizer.param_groups):
                group["betas"] = betas
        if math.isclose(decay_mom_rate, 0):
            self.skip_mom_decay = True

    def _scale_factor(self) -> float:
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            in_cycle = batch_iteration % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stairs / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list[float]:
        """The learning rates for the current iteration."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        factor = 1 + self.decay_lr_rate * interval
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The ``betas`` for the current iteration (None without momentum cycling)."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        factor = 1 + self.decay_mom_rate * interval
        return [(beta1 * factor, beta2) for beta1, beta2 in self.max_moms]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration (or to the given one); writes the lr and, when cycling, ``betas``."""
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas


class WarmupLR(_Schedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` (default: each group's lr), then hold."""

    def __init__(self, optimizer: Any, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):  # fmt: skip
        _check_warmup_steps(warmup_num_steps)
        self.optimizer = _torch_optimizer(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer.param_groups, self.get_lr())

    def get_lr(self) -> list[float]:
        """The learning rates for the current iteration (the minimum before the first step)."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]

    def _warmup_gamma(self) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at ``total_num_steps``. ``warmup_max_lr`` defaults to 0.001."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):  # fmt: skip
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)  # fmt: skip
        if self.total_num_steps < self.warmup_num_steps:
            log.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """Scale each group's construction-time lr by a warm-up ratio, then by a cosine down to ``cos_min_ratio``."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1):  # fmt: skip
        import torch

        _check_warmup_steps(warmup_num_steps)
        self.optimizer = _torch_optimizer(optimizer)
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            log.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self) -> float:
        """The factor applied to the construction-time learning rates at the current iteration."""
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            if self.warmup_type == "log":
                ratio = self.inverse_log_warm_up * math.log(it + 1)
            else:
                ratio = it / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        """The learning rates for the current iteration (0.0 before the first step)."""
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


# --------------------------------------------------------------------------------------------------
# building from the core model

_DEEPSPEED_CLASSES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}


def _torch_scheduler_names() -> list[str]:
    import torch.optim.lr_scheduler as torch_schedulers

    return [name for name in dir(torch_schedulers)
            if not name.startswith("_") and isinstance(getattr(torch_schedulers, name), type)
            and issubclass(getattr(torch_schedulers, name), torch_schedulers.LRScheduler)]  # fmt: skip


def _reject_deferred(values: dict[str, Any], prefix: str) -> None:
    problems = [
        Problem(f"{prefix}.{key}", value, "still 'auto': resolve it (torsh.initialize fills it from the optimizer "
                "and training length) or set a number before the scheduler is built")
        for key, value in values.items() if is_deferred(value)
    ]  # fmt: skip
    if problems:
        raise ConfigError(problems)


def build_scheduler(cfg: C.SchedulerConfig, optimizer: Any) -> Any:
    """The learning-rate scheduler the core model's ``scheduler`` section describes, bound to ``optimizer``.

    DeepSpeed's five names build the DeepSpeed-exact schedules of this module; any other name must be a
    ``torch.optim.lr_scheduler`` class, built as ``cls(optimizer, **cfg.kwargs)``. Every "auto" must have
    been resolved before; an unresolved one or an unknown name raises :class:`~torsh.errors.ConfigError`.
    """
    name = cfg.name
    if isinstance(cfg, C.TorchScheduler):
        _reject_deferred(cfg.kwargs, "scheduler.kwargs")
        import torch.optim.lr_scheduler as torch_schedulers

        names = _torch_scheduler_names()
        if name not in names:
            raise ConfigError([Problem(
                "scheduler.name", name,
                "unknown scheduler: use one of DeepSpeed's (" + ", ".join(_DEEPSPEED_CLASSES)
                + ") or a torch.optim.lr_scheduler class name",
                did_you_mean(name, [*_DEEPSPEED_CLASSES, *names]),
            )])  # fmt: skip
        try:
            return getattr(torch_schedulers, name)(_torch_optimizer(optimizer), **cfg.kwargs)
        except TypeError as exc:
            raise ConfigError([Problem("scheduler.kwargs", cfg.kwargs, f"{name} rejects these arguments: {exc}")])
    params = cfg.model_dump(exclude={"name"})
    _reject_deferred(params, "scheduler")
    if name not in _DEEPSPEED_CLASSES:  # a hand-built section object of a type this module does not know
        raise ConfigError([Problem("scheduler.name", name, "unknown scheduler",
                                   did_you_mean(name, _DEEPSPEED_CLASSES))])  # fmt: skip
    return _DEEPSPEED_CLASSES[name](optimizer, **params)
