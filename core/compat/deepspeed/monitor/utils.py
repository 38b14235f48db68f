"""``deepspeed.monitor.utils``: each writer's package, checked when its monitor is built (an ``ImportError`` that
says what to install, as DeepSpeed raises)."""

from __future__ import annotations

import importlib


def _require(module: str, install: str) -> object:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"this monitor needs the {module} package: {install}") from exc


def check_tb_availability() -> None:
    _require("tensorboard", "pip install tensorboard")


def check_wandb_availability() -> None:
    _require("wandb", "pip install wandb (then see https://docs.wandb.ai/quickstart)")


def check_comet_availability() -> None:
    comet_ml = _require("comet_ml", 'pip install "comet_ml>=3.41.0"')
    from packaging.version import Version

    if Version(comet_ml.__version__) < Version("3.41.0"):
        raise ImportError(f"the comet monitor needs comet_ml >= 3.41.0 (installed: {comet_ml.__version__}): "
                          'pip install -U "comet_ml>=3.41.0"')  # fmt: skip


def rank() -> int:
    """This process's rank (0 before the process group exists: a lone process writes)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
