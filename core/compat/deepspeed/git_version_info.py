"""``deepspeed.git_version_info``: the version this package mirrors, and what was built (nothing: torsh compiles
no op; see :mod:`deepspeed.ops.op_builder`)."""

from . import __version__ as version  # noqa: F401
from . import git_branch, git_hash  # noqa: F401 (None: this is not a DeepSpeed build)
from .ops.op_builder import compatible_ops, installed_ops  # noqa: F401

accelerator_name = ""


def _torch_info() -> dict:
    import torch

    return {"version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
            "bf16_support": False,
            "cuda_version": ".".join((torch.version.cuda or "0.0").split(".")[:2]),
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version()[:2])) if torch.cuda.is_available() else "0.0",
            "hip_version": ".".join((getattr(torch.version, "hip", None) or "0.0").split(".")[:2])}  # fmt: skip


torch_info = _torch_info()
