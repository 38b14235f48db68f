"""What the engine refuses to run, decided from the config and the world size alone, before a tensor is touched.

``torsh.initialize`` calls :func:`check` once the process group exists and before it casts, wraps or shards the
model, so a refused config leaves the user's model as it was and every reason is reported at once. ``explain``
can call it without torch: this module imports none.
"""

from __future__ import annotations

from .compression_rules import fsdp_compression_problems
from .config import TorshConfig
from .deferred import is_deferred
from .errors import ConfigError, Problem


def refusals(cfg: TorshConfig, *, world_size: int, optimizer_given: bool = True) -> list[Problem]:
    """Every reason the engine cannot run ``cfg`` on ``world_size`` ranks (empty: it can).

    ``optimizer_given`` says whether the caller passed an optimizer to ``initialize`` (ZeRO-1/2 need one).
    """
    problems: list[Problem] = []
    stage = cfg.sharding.stage
    if cfg.pipeline.stages not in (None, 1) and not is_deferred(cfg.pipeline.stages):
        problems.append(Problem("pipeline.stages", cfg.pipeline.stages, "pipeline parallelism is not executed by "
                                "the torsh engine; remove it or use torch.distributed.pipelining"))  # fmt: skip
    if cfg.gradients.reduce_op == "adasum":
        problems.append(Problem("gradients.reduce_op", "adasum", "Adasum is Horovod-only and has no native "
                                "PyTorch equivalent; use 'mean' or 'sum'"))  # fmt: skip
    if stage >= 2:
        problems += _fsdp_refusals(cfg, world_size)
    if stage in (1, 2) and not optimizer_given and not (cfg.optimizer is not None and cfg.optimizer.name):
        problems.append(Problem("sharding.stage", stage, f"zero stage {stage} requires an optimizer: pass one to "
                                "initialize or configure one"))  # fmt: skip
    return problems


def _fsdp_refusals(cfg: TorshConfig, world_size: int) -> list[Problem]:
    problems = []
    if "nvme" in (cfg.offload.params, cfg.offload.optimizer):
        problems.append(Problem("offload", "nvme", "NVMe offload has no native PyTorch equivalent; use 'cpu' or "
                                "'none'"))  # fmt: skip
    shard = cfg.sharding.hybrid_shard_size
    if isinstance(shard, int) and shard != world_size and world_size % shard:
        problems.append(Problem("sharding.hybrid_shard_size", shard, f"must divide the world size {world_size}"))
    if cfg.compression.method != "none":
        problems += fsdp_compression_problems(cfg.compression, cfg.precision.reduce_dtype)
    return problems


def check(cfg: TorshConfig, *, world_size: int, optimizer_given: bool = True) -> None:
    """Raise one ConfigError listing every refusal of :func:`refusals`; return when the engine can run ``cfg``."""
    problems = refusals(cfg, world_size=world_size, optimizer_given=optimizer_given)
    if problems:
        raise ConfigError(problems)
