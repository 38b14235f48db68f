"""What gradient compression means for each sharding stage, and the defaults it resolves to (no torch).

The engine implements compression as DDP communication hooks (``torsh.engine.compression``), so it exists
only where DDP reduces dense gradient buckets: sharding stages 0 and 1. FSDP2 (stages 2 and 3) reduce-scatters
per-parameter shards with no hook point; there the two cast methods (fp16, bf16) are honoured as FSDP2's
``reduce_dtype`` and the methods that need a dense bucket are unsupported. Adapters call
:func:`compression_notes_for_stage` at translation time; the engine calls :func:`fsdp_compression_problems`
(through ``torsh.plan.check``, before the model is touched) at initialize. Both read these same rules, so
a config that translates with an "unsupported" note fails at initialize with the same reason.
"""

from __future__ import annotations

from .config import CompressionConfig
from .errors import Problem
from .translate import Fidelity, Note

#: Methods that cast the gradient bucket to a smaller dtype and need no per-bucket state.
CAST_METHODS = ("fp16", "bf16")
#: Methods that need DDP's dense, flat gradient bucket (a matrix view, a top-k over it, a per-bucket scale).
BUCKET_METHODS = ("powersgd", "topk", "quantize")
#: torch's PowerSGD keys its error-feedback and warm-start memory by bucket index, and DDP rebuilds its buckets
#: after the first iteration, so torch refuses to start PowerSGD with that memory before this step.
POWERSGD_MIN_STATEFUL_START = 2

_USE_DDP = "use sharding.stage 0 or 1 (DDP) to compress gradients, or set compression.method to 'none'"


def effective_error_feedback(cfg: CompressionConfig) -> bool:
    """Whether residuals are kept and added back next step: the config's value, else on for powersgd/topk."""
    if cfg.error_feedback is not None:
        return cfg.error_feedback
    return cfg.method in ("powersgd", "topk")


def effective_powersgd_rank(cfg: CompressionConfig) -> int:
    """PowerSGD's matrix approximation rank (torch's default 1 when unset)."""
    return cfg.rank if cfg.rank is not None else 1


def effective_warm_start(cfg: CompressionConfig) -> bool:
    """PowerSGD warm start (torch's default True when unset)."""
    return cfg.warm_start if cfg.warm_start is not None else True


def effective_start_step(cfg: CompressionConfig) -> int:
    """The first step that may be compressed.

    ``compression.start_step``, except for PowerSGD with error feedback or warm start, which starts no earlier
    than :data:`POWERSGD_MIN_STATEFUL_START` (see there).
    """
    if cfg.method == "powersgd" and (effective_error_feedback(cfg) or effective_warm_start(cfg)):
        return max(cfg.start_step, POWERSGD_MIN_STATEFUL_START)
    return cfg.start_step


def compresses_at(cfg: CompressionConfig, step: int) -> bool:
    """Whether communication round ``step`` (0-based, one per synchronised backward) is compressed.

    Steps before the start are uncompressed warm-up; from the start on, every ``period``-th step is compressed
    (the start itself, start + period, ...), the others reduce uncompressed.
    """
    if cfg.method == "none":
        return False
    start = effective_start_step(cfg)
    return step >= start and (step - start) % cfg.period == 0


def compression_notes_for_stage(cfg: CompressionConfig, stage: int) -> list[Note]:
    """Notes for the compression keys that the engine cannot honour at sharding ``stage`` (empty when all are).

    Stages 0 and 1 run DDP and honour everything. Stages 2 and 3 run FSDP2: fp16/bf16 become its reduce dtype
    for the whole run (so ``period`` and ``start_step`` cannot apply), and powersgd/topk/quantize are
    unsupported.
    """
    if stage < 2 or cfg.method == "none":
        return []
    if cfg.method in BUCKET_METHODS:
        return [Note("compression.method", None, cfg.method, Fidelity.UNSUPPORTED,
                     f"'{cfg.method}' compresses DDP's dense gradient buckets, which FSDP2 (sharding.stage "
                     f"{stage}) does not have: gradients would be reduced uncompressed; {_USE_DDP}")]  # fmt: skip
    notes = []
    for field, neutral in (("period", 1), ("start_step", 0)):
        value = getattr(cfg, field)
        if value != neutral:
            notes.append(Note(f"compression.{field}", None, value, Fidelity.UNSUPPORTED,
                              f"under FSDP2 (sharding.stage {stage}) compression.method='{cfg.method}' is the "
                              f"reduce dtype of every step; compressing only some steps needs DDP: "
                              f"{_USE_DDP}"))  # fmt: skip
    return notes


def fsdp_reduce_dtype(cfg: CompressionConfig, reduce_dtype: str | None) -> str | None:
    """The gradient reduce dtype FSDP2 should use: the fp16/bf16 compression method, else ``reduce_dtype``.

    Call it after :func:`fsdp_compression_problems` found nothing (then the two cannot disagree).
    """
    return cfg.method if cfg.method in CAST_METHODS else reduce_dtype


def fsdp_compression_problems(cfg: CompressionConfig, reduce_dtype: str | None) -> list[Problem]:
    """Why ``cfg`` cannot run under FSDP2 with the given explicit ``precision.reduce_dtype`` (empty when it can).

    ``reduce_dtype`` is the user's explicit ``precision.reduce_dtype`` (None when unset). fp16/bf16 compression
    under FSDP2 *is* the reduce dtype; when both are set and differ, neither silently wins.
    """
    if cfg.method == "none":
        return []
    if cfg.method in BUCKET_METHODS:
        return [Problem("compression.method", cfg.method,
                        f"'{cfg.method}' needs DDP's dense gradient buckets, which FSDP2 (sharding.stage 2/3) "
                        f"does not have; {_USE_DDP}")]  # fmt: skip
    problems = []
    if reduce_dtype is not None and reduce_dtype != cfg.method:
        problems.append(Problem("compression.method", cfg.method,
                                f"under FSDP2 (sharding.stage 2/3) fp16/bf16 compression is the gradient reduce "
                                f"dtype, and precision.reduce_dtype is '{reduce_dtype}': the two are one setting "
                                f"there, so neither wins silently. Set precision.reduce_dtype to '{cfg.method}' "
                                f"(or remove it) to reduce in {cfg.method}, or set compression.method to 'none' "
                                f"to reduce in {reduce_dtype}"))  # fmt: skip
    problems += [Problem(n.source_path, n.value, n.reason) for n in compression_notes_for_stage(cfg, 2)]
    return problems
