"""The precision contract and loss scaling: whose scaler follows which rules, and each one's defaults.

Three scalers exist among the dialects, and the core model names them in ``precision.loss_scaling.semantics``:

* ``torch_grad_scaler``: ``torch.amp.GradScaler`` (FSDP, FairScale, Accelerate, DeepSpeed's ``torch_autocast`` at
  stage 0): halve on every overflow, grow after exactly ``growth_interval`` clean steps;
* ``deepspeed_zero``: DeepSpeed's dynamic scaler under ZeRO (stage >= 1), with hysteresis;
* ``deepspeed_stage0``: DeepSpeed stage 0's ``FP16_Optimizer`` scaler, without hysteresis.

DeepSpeed's ``fp16`` / ``bf16`` sections are data here too: their keys and DeepSpeed 0.19.8's defaults.
"""

from __future__ import annotations

#: ``torch.amp.GradScaler()``'s defaults, in the core model's names (``init_scale`` is ``initial_scale``).
GRAD_SCALER = {"mode": "dynamic", "semantics": "torch_grad_scaler", "initial_scale": 65536.0,
               "growth_interval": 2000, "growth_factor": 2.0, "backoff_factor": 0.5}  # fmt: skip
#: ``GradScaler``'s keyword arguments (also FairScale's ``ShardedGradScaler``'s) -> the core field.
GRAD_SCALER_KWARGS = {"init_scale": "initial_scale", "growth_factor": "growth_factor",
                      "backoff_factor": "backoff_factor", "growth_interval": "growth_interval"}  # fmt: skip
#: The core fields a framework that hands fp16 to ``GradScaler()`` sets: its rules, and its defaults.
GRAD_SCALER_RULES = ("mode", "semantics", "growth_interval")

#: DeepSpeed 0.19.8's ``fp16`` section: key -> default (``precision_config.py``).
DEEPSPEED_FP16 = {"enabled": False, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
                  "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False,
                  "min_loss_scale": 1, "fp16_master_weights_and_grads": False}  # fmt: skip
#: DeepSpeed 0.19.8's ``bf16`` section: key -> default.
DEEPSPEED_BF16 = {"enabled": False, "check_grad_overflow": True, "bf16_master_weights_and_grads": False,
                  "bf16_optimizer_states": False}  # fmt: skip

#: Largest |fp16.initial_scale_power|: the core model caps loss scales at 2**64.
MAX_SCALE_POWER = 64

#: What each scaler does, in words for the report.
SEMANTICS = {
    "deepspeed_zero": "ZeRO's dynamic scaler (hysteresis, growth after window+1 clean steps)",
    "deepspeed_stage0": "stage 0's FP16_Optimizer scaler (no hysteresis)",
}


def deepspeed_semantics(stage: object) -> str:
    """Whose rules DeepSpeed's fp16 scaler follows at a ZeRO stage (an "auto" stage is a ZeRO one)."""
    return "deepspeed_stage0" if stage == 0 else "deepspeed_zero"


#: DeepSpeed's fp16 scaler keys with the same meaning and value as a core ``precision.loss_scaling`` field.
DEEPSPEED_SCALER_FIELDS = {"loss_scale_window": "growth_interval", "hysteresis": "hysteresis",
                           "consecutive_hysteresis": "consecutive_hysteresis"}  # fmt: skip


def deepspeed_follows(param: object, autocast: bool) -> str:
    """The dtype DeepSpeed reduces and accumulates gradients in when nothing says otherwise: the parameter dtype
    under its fp16/bf16 modes (parameters cast), fp32 otherwise (fp32, or torch_autocast)."""
    return param if param in ("fp16", "bf16") and not autocast else "fp32"  # type: ignore[return-value]


def deepspeed_keeps_low_precision(param: object, autocast: bool, master: str, states: str,
                                  stage: int) -> tuple[bool, bool]:  # fmt: skip
    """Whether DeepSpeed can keep (master weights, optimizer state) in low precision: master weights of the
    fp16/bf16 mode's own dtype under ZeRO 1-3; bf16 optimizer state only with bf16 master weights as well."""
    master_ok = param in ("fp16", "bf16") and not autocast and master == param and stage >= 1
    return master_ok, param == states == master == "bf16" and stage >= 1
