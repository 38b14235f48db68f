"""Optimizer and learning-rate scheduler names: which the torsh engine builds, which only DeepSpeed has, which are gone.

The engine builds ``torch.optim`` classes by name and DeepSpeed's five schedulers (core models in
``torsh.config``); any other scheduler name is a ``torch.optim.lr_scheduler`` class.
"""

from __future__ import annotations

#: ``torch.optim`` classes a config may name (torch 2.13).
TORCH_OPTIMIZERS = ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "Muon", "NAdam",
                    "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam")  # fmt: skip

#: DeepSpeed's own optimizers (lower-case type -> name), which the engine builds with DeepSpeed's update rules
#: (``torsh.engine.optimizers``; the mup ones from the mup package, as DeepSpeed does).
DEEPSPEED_ONLY_OPTIMIZERS = {"lamb": "Lamb", "lion": "Lion", "muadam": "MuAdam", "muadamw": "MuAdamW",
                             "musgd": "MuSGD", "muon": "Muon"}  # fmt: skip

#: DeepSpeed's 1-bit optimizers, removed in 0.19.8 (lower-case type -> the uncompressed optimizer they ran).
REMOVED_ONE_BIT = {"onebitadam": "AdamW", "zerooneadam": "AdamW", "onebitlamb": "Lamb"}
#: Settings only the removed 1-bit optimizers read.
REMOVED_ONE_BIT_PARAMS = frozenset({"freeze_step", "cuda_aware", "comm_backend_name", "coeff_beta", "factor_max",
                                    "factor_min", "factor_threshold", "var_freeze_step", "var_update_scaler",
                                    "local_step_scaler", "local_step_clipper"})  # fmt: skip

#: Hyper-parameters the core model has fields for (``optimizer.<name>``); others go to ``optimizer.kwargs``.
TYPED_PARAMS = ("lr", "weight_decay", "betas", "eps", "momentum")

#: DeepSpeed's FusedAdam defaults (its weight decay is 0, torch's AdamW's is 0.01).
DEEPSPEED_ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}

#: DeepSpeed's schedulers, each a core model of the same name in ``torsh.config``.
DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
