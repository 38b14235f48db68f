"""Helpers that hand a file torsh wrote to its real consumer (Accelerate, DeepSpeed, torch FSDP, launchers)."""
