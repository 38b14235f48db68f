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
