"""Offload: which state leaves the accelerator, where to, and under which sharding it can.

DeepSpeed 0.19.8 offloads the optimizer state under ZeRO (stage >= 1) and the parameters only at ZeRO-3; the
torsh engine offloads with FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and optimizer state together).
"""

from __future__ import annotations

#: Core offload devices.
DEVICES = ("none", "cpu", "nvme")


def deepspeed_offloads(part: str, stage: int) -> bool:
    """Whether DeepSpeed offloads ``part`` ("optimizer" or "param") at a ZeRO stage."""
    return stage == 3 if part == "param" else stage >= 1


def fsdp_cpu_offload(params: str, optimizer: str, framework: str) -> tuple[bool | None, str]:
    """What a framework with FSDP2's one CPU-offload switch can say for the core offload: (the switch, why it is
    approximate or "") or (None, why it cannot say it at all). FSDP2 moves parameters, gradients and optimizer
    state to CPU memory together."""
    if params == "cpu":
        return True, "" if optimizer == "cpu" else "also moves the optimizer step to the CPU"
    if params != "none" or optimizer != "none":
        return None, (f"{framework} offloads parameters, gradients and optimizer state to CPU memory together; NVMe "
                      "or optimizer-only offload needs DeepSpeed")
    return False, ""
