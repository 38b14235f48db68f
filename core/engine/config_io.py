"""The start-up steps ``torsh.initialize`` and the pipeline engine's ``initialize`` share: which config was given
(DeepSpeed's precedence), its core model and translation report, ``engine.config``, logging, the scheduler and the
loss scaler."""

from __future__ import annotations

import base64
import json
import logging
import os
from typing import Any

import torch

from torsh.config import LossScalingConfig, SchedulerConfig, TorshConfig
from torsh.errors import ConfigError, Problem
from torsh.translate import Translation

from .distributed import DistInfo
from .optim import rebind_scheduler

log = logging.getLogger("torsh.engine")


def load_config(args: Any, config: Any, config_params: Any) -> tuple[TorshConfig, Translation | None]:
    """The config from ``config``, ``config_params`` or ``args.deepspeed_config`` (DeepSpeed's precedence),
    and the translation that produced it (None for a TorshConfig)."""
    return read_config(choose_config(args, config, config_params))


def choose_config(args: Any, config: Any, config_params: Any) -> Any:
    """What ``deepspeed.initialize`` would take as the config: ``config``, else ``config_params``, else
    ``args.deepspeed_config`` (a dict, a path or a TorshConfig)."""
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise ConfigError([Problem("config", "args.deepspeed_config and config", "give the config once: either "
                                   "--deepspeed_config or the config argument")])  # fmt: skip
    config = config if config is not None else from_args
    if config is None:
        raise ConfigError([Problem("config", None, "initialize needs a config: pass config=<dict, path or "
                                   "TorshConfig> or --deepspeed_config PATH")])  # fmt: skip
    return _decoded(config)


def _decoded(config: Any) -> Any:
    """DeepSpeed also takes the JSON as URL-safe base64 text (a string that is not a file): that is the dict; any
    other string stays a path, whose absence the loader reports."""
    if not isinstance(config, str) or os.path.exists(config):
        return config
    try:
        decoded = json.loads(base64.urlsafe_b64decode(config.encode("ascii")).decode("utf-8"))
    except (ValueError, UnicodeError):
        return config
    return decoded if isinstance(decoded, dict) else config


def read_config(config: Any) -> tuple[TorshConfig, Translation | None]:
    """The core model of a chosen config, and its translation (None for a TorshConfig)."""
    if isinstance(config, TorshConfig):
        return config, None
    from torsh import adapters

    translation = adapters.load(config)
    return translation.result, translation


def config_as_dict(config: Any) -> dict:
    """``engine.config``: the config as a dict, as DeepSpeed's engine holds it (a path is the file's content; a
    TorshConfig its JSON form)."""
    if isinstance(config, TorshConfig):
        return config.model_dump(mode="json")
    if isinstance(config, dict):
        return config
    from torsh.formats import load_file

    return load_file(config)[0]


def log_translation(translation: Translation | None, rank: int) -> None:
    """The translation report, once on rank 0: the counts, and every key that is not carried exactly."""
    if translation is None or rank != 0:
        return
    counts = ", ".join(f"{n} {k}" for k, n in translation.counts().items() if n)
    log.info("config (%s): %s", translation.source, counts or "empty")
    for note in translation.lossy:
        log.warning("config: %s", note)


def build_scheduler(section: SchedulerConfig | None, client: Any, optimizer: Any) -> Any:
    """The scheduler the engine steps: the script's (re-pointed at ``optimizer``, or its callable's), else the one
    the ``scheduler`` section describes; None without an optimizer (DeepSpeed's rule) or any scheduler."""
    if optimizer is None:
        return None  # DeepSpeed configures a scheduler only when there is an optimizer
    if client is not None:
        if hasattr(client, "step") and hasattr(client, "optimizer"):
            return rebind_scheduler(client, optimizer)
        return client(optimizer)
    if section is None:
        return None
    from .schedulers import build_scheduler

    return build_scheduler(section, optimizer)


def build_loss_scaler(loss_scaling: LossScalingConfig) -> Any:
    """The loss scaler of the ``precision.loss_scaling`` section."""
    from .loss_scaler import build_loss_scaler

    return build_loss_scaler(loss_scaling)


_OWN_EVENTS = ("the engine writes none of DeepSpeed's own Train/Samples events; engine.monitor.write_events writes "
               "the script's")


#: Settings the engine carries but does not act on (fully); each is named once at start-up (never silently dropped).
NOT_EXECUTED = {
    "monitoring.tensorboard.enabled": _OWN_EVENTS + " (with the tensorboard package installed)",
    "monitoring.csv.enabled": _OWN_EVENTS,
    "monitoring.wandb.enabled": "wandb logging is not provided by the torsh engine; the setting has no effect",
    "monitoring.profiler.enabled": "the FLOPs profiler is not provided by the torsh engine; the setting has no effect",
    "monitoring.wall_clock_breakdown": "the wall-clock breakdown is not provided by the torsh engine; the setting has "
                                       "no effect",
    "checkpoint.interval_steps": "periodic checkpoints are not provided by the torsh engine (call "
                                 "engine.save_checkpoint); the setting has no effect",
    "checkpoint.keep_last": "checkpoint rotation is not provided by the torsh engine; the setting has no effect",
}  # fmt: skip


def warn_not_executed(cfg: TorshConfig, rank: int) -> None:
    if rank != 0:
        return
    from torsh.config import get_path

    for path, what in NOT_EXECUTED.items():
        if get_path(cfg, path):
            log.warning("%s is set: %s", path, what)


def is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer)


def check_local_rank(args: Any, info: DistInfo) -> None:
    # DeepSpeed overwrites args.local_rank with the launcher's LOCAL_RANK.
    if args is not None and hasattr(args, "local_rank"):
        try:
            args.local_rank = info.local_rank
        except AttributeError:
            pass


def setup_logging(rank: int) -> None:
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[torsh] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
