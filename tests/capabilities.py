"""What this machine can do, asked where a test needs it: a test that needs a capability the machine lacks skips
with the reason, or compares against what can still be run.

CPUs differ: DeepSpeed's CPU accelerator offers fp16 only where oneDNN has fp16 kernels (Intel CPUs with AVX512-FP16
or AMX do, most AMD EPYCs do not), and then ``deepspeed.initialize`` refuses an fp16 config with ``Type fp16 is not
supported on your device``. torsh's own fp16 path runs everywhere.

``TORSH_TEST_WITHOUT`` (a comma-separated list of capability names) forces capabilities off, so the suite's
behaviour on a machine without them can be checked on one that has them:
``TORSH_TEST_WITHOUT=deepspeed-fp16 make test``.
"""

from __future__ import annotations

import functools
import os

DEEPSPEED_FP16 = "deepspeed-fp16"


def _forced_off(name: str) -> bool:
    return name in {part.strip() for part in os.environ.get("TORSH_TEST_WITHOUT", "").split(",")}


@functools.cache
def deepspeed_fp16() -> bool:
    """Whether real DeepSpeed on this CPU (``DS_ACCELERATOR=cpu``) trains in fp16; asked of its own accelerator."""
    if _forced_off(DEEPSPEED_FP16):
        return False
    try:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    except ImportError:
        return False
    return bool(CPU_Accelerator().is_fp16_supported())


WHY_NO_DEEPSPEED_FP16 = ("real DeepSpeed has no fp16 on this CPU (its CPU accelerator needs oneDNN fp16 kernels: "
                         "torch.ops.mkldnn._is_mkldnn_fp16_supported() is False)")  # fmt: skip


def need_deepspeed_fp16() -> None:
    """Skip the calling test, with the reason, where real DeepSpeed cannot train in fp16 here."""
    import pytest

    if not deepspeed_fp16():
        reason = WHY_NO_DEEPSPEED_FP16
        if _forced_off(DEEPSPEED_FP16):
            reason = "real DeepSpeed fp16 is switched off by TORSH_TEST_WITHOUT"
        pytest.skip(reason)


def fp16_as_deepspeed_runs_it(config: dict) -> dict:
    """``config`` as real DeepSpeed can run it here: unchanged where it has fp16, else with the fp16 section
    replaced by bf16 (the nearest precision DeepSpeed's CPU accelerator has), so that a test of the rest of the
    config still runs."""
    fp16 = config.get("fp16")
    if deepspeed_fp16() or not (isinstance(fp16, dict) and fp16.get("enabled") not in (False, "false")):
        return config
    out = {k: v for k, v in config.items() if k != "fp16"}
    out["bf16"] = {"enabled": True}
    return out
