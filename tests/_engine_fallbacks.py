"""Stand-ins for ``torsh.engine.schedulers`` / ``loss_scaler`` / ``optim`` while they are not in this checkout.

Installed only when the real module cannot be imported, so engine tests run in either state; the engine
itself only ever calls the real names.
"""

from __future__ import annotations

import importlib
import math
import sys
import types


def install() -> None:
    for name, build in (("schedulers", _schedulers), ("loss_scaler", _loss_scaler), ("optim", _optim)):
        full = f"torsh.engine.{name}"
        try:
            importlib.import_module(full)
        except ImportError:
            module = build()
            sys.modules[full] = module
            setattr(importlib.import_module("torsh.engine"), name, module)


def _schedulers() -> types.ModuleType:
    import torch

    class WarmupLR:
        def __init__(self, optimizer, cfg):
            self.optimizer, self.it = optimizer, -1
            self.min, self.n, self.kind = cfg.warmup_min_lr, max(2, cfg.warmup_num_steps), cfg.warmup_type
            self.max = [cfg.warmup_max_lr if cfg.warmup_max_lr is not None else g["lr"] for g in optimizer.param_groups]
            self.step(self.it)

        def get_lr(self):
            if self.it < 0:
                return [self.min for _ in self.max]
            if self.it < self.n:
                g = math.log(self.it + 1) / math.log(self.n) if self.kind == "log" else self.it / self.n
            else:
                g = 1.0
            return [self.min + (m - self.min) * g for m in self.max]

        def step(self, last_batch_iteration=None):
            self.it = self.it + 1 if last_batch_iteration is None else last_batch_iteration
            for g, lr in zip(self.optimizer.param_groups, self.get_lr()):
                g["lr"] = lr

        def get_last_lr(self):
            return [g["lr"] for g in self.optimizer.param_groups]

        def state_dict(self):
            return {"last_batch_iteration": self.it}

        def load_state_dict(self, sd):
            self.it = sd["last_batch_iteration"]

    def build_scheduler(cfg, optimizer):
        if cfg.name == "WarmupLR":
            return WarmupLR(optimizer, cfg)
        return getattr(torch.optim.lr_scheduler, cfg.name)(optimizer, **cfg.kwargs)

    module = types.ModuleType("torsh.engine.schedulers")
    module.build_scheduler = build_scheduler
    return module


def _loss_scaler() -> types.ModuleType:
    class LossScaler:
        def __init__(self, cfg):
            self.dynamic = cfg.mode == "dynamic"
            self.cur_scale = {"none": 1.0, "static": cfg.static_scale, "dynamic": cfg.initial_scale}[cfg.mode]
            self.cfg, self.clean = cfg, 0

        def scale(self, loss):
            return loss * self.cur_scale

        def update(self, overflow):
            if not self.dynamic:
                return
            if overflow:
                self.cur_scale = max(self.cur_scale * self.cfg.backoff_factor, self.cfg.min_scale)
                self.clean = 0
            else:
                self.clean += 1
                if self.clean % self.cfg.growth_interval == 0:
                    self.cur_scale *= self.cfg.growth_factor

        def state_dict(self):
            return {"cur_scale": self.cur_scale, "clean": self.clean}

        def load_state_dict(self, sd):
            self.cur_scale, self.clean = sd["cur_scale"], sd["clean"]

    module = types.ModuleType("torsh.engine.loss_scaler")
    module.build_loss_scaler = LossScaler
    module.LossScaler = LossScaler
    return module


def _optim() -> types.ModuleType:
    import torch

    def build_optimizer(cfg, params, *, offload):
        kwargs = {k: getattr(cfg, k) for k in ("lr", "weight_decay", "betas", "eps", "momentum")
                  if getattr(cfg, k) is not None}
        return getattr(torch.optim, cfg.name)(params, **kwargs, **cfg.kwargs)

    module = types.ModuleType("torsh.engine.optim")
    module.build_optimizer = build_optimizer
    return module
