"""``deepspeed.utils``: logging helpers, ``RepeatingLoader``, and the ZeRO parameter accessors scripts call."""

from __future__ import annotations

import logging as _logging  # not ``logging``: that name is DeepSpeed's submodule deepspeed.utils.logging

import torch as _torch  # not ``torch``: that name is the submodule deepspeed.utils.torch once imported

from ..runtime.dataloader import RepeatingLoader  # noqa: F401
from .tensor_fragment import *  # noqa: F401,F403 (DeepSpeed's safe_get/set_full/local_* accessors)
from .z3_leaf_module import *  # noqa: F401,F403 (as in DeepSpeed, the function shadows its module's name)

logger = _logging.getLogger("DeepSpeed")
if not logger.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(_logging.INFO)
    logger.propagate = False


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else -1


def log_dist(message, ranks=None, level=_logging.INFO) -> None:
    """Log ``message`` on the listed ranks (all ranks when ``ranks`` holds -1; every process before the process
    group exists)."""
    rank = _rank()
    if rank == -1 or ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


_logged_once: set = set()


def log_dist_once(message, ranks=None, level=_logging.INFO) -> None:
    if message not in _logged_once:
        _logged_once.add(message)
        log_dist(message, ranks=ranks, level=level)


def set_log_level_from_string(log_level_str, custom_logger=None) -> None:
    (custom_logger or logger).setLevel(getattr(_logging, str(log_level_str).upper()))


class OnDevice:
    """Build a model on ``device`` with ``dtype`` as the default (``device="meta"``: without memory)."""

    def __init__(self, dtype, device="meta", enabled=True):
        self.dtype, self.device, self.enabled = dtype, device, enabled
        self._ctx = None
        self._dtype = None

    def __enter__(self):
        if self.enabled:
            self._dtype = _torch.get_default_dtype()
            if self.dtype is not None and self.dtype.is_floating_point:
                _torch.set_default_dtype(self.dtype)
            self._ctx = _torch.device(self.device)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._ctx.__exit__(*exc)
            _torch.set_default_dtype(self._dtype)
        return False


def __getattr__(name: str):
    if name in ("zero_to_fp32", "logging", "groups", "torch", "module_utils", "z3_leaf_module", "numa"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'deepspeed.utils' (torsh's DeepSpeed compatibility package) has no attribute "
                         f"{name!r}")  # fmt: skip
