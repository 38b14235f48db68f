"""Gradient compression as DDP communication hooks, with bytes-on-the-wire accounting.

:func:`apply_compression` registers one hook on a ``DistributedDataParallel`` model. Per communication round
(one synchronised backward) the hook decides, from ``compression.start_step`` and ``compression.period``,
whether the round is compressed; uncompressed rounds are a plain averaging allreduce. The methods:

* ``fp16`` / ``bf16``: torch's ``fp16_compress_wrapper`` / ``bf16_compress_wrapper`` around a counting
  averaging allreduce (the same numerics as torch's ``fp16_compress_hook``: divide by the world size in the
  low dtype, then sum).
* ``powersgd``: torch's ``powerSGD_hook`` and ``PowerSGDState`` (rank, warm start, error feedback).
* ``topk``: each rank sends its ``ratio`` largest-magnitude entries (values and int32 indices) with one
  all_gather; the receivers scatter-add and divide by the world size. The entries not sent stay in a per-rank
  residual that is added to the next compressed round (error feedback).
* ``quantize``: each rank sends its bucket as 8/4/2-bit codes packed into bytes plus a per-bucket offset and
  scale, with one all_gather; the receivers dequantize, sum and divide by the world size. Without error
  feedback the rounding is stochastic (unbiased); with it, rounding is to nearest and the error is carried.

Every method averages (divides by the world size), never sums. ``CompressionState.stats`` counts, per round,
the bytes an uncompressed allreduce would have passed to the collective and the bytes actually passed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from torsh.compression_rules import (
    compresses_at,
    effective_error_feedback,
    effective_powersgd_rank,
    effective_start_step,
    effective_warm_start,
    fsdp_compression_problems,
)
from torsh.config import CompressionConfig
from torsh.errors import ConfigError

__all__ = ["CompressionState", "CompressionStats", "StepBytes", "apply_compression", "check_fsdp_compression"]

#: How many per-step records ``CompressionStats.history`` keeps (totals cover every step).
HISTORY = 1024


# --------------------------------------------------------------------------------------------------
# accounting


@dataclass(frozen=True)
class StepBytes:
    """Bytes of one communication round on this rank."""

    step: int
    """0-based communication round (one per synchronised backward)."""
    dense_bytes: int
    """Bytes an uncompressed allreduce of the gradient buckets passes to the collective."""
    sent_bytes: int
    """Bytes this rank actually passed to collectives (values, indices, scales, factors)."""
    compressed: bool
    """Whether the round was compressed (False in warm-up and between periods)."""
    buckets: int | None
    """Gradient buckets reduced in the round (None for method none, where DDP's built-in reduction runs)."""

    @property
    def ratio(self) -> float:
        """sent / dense for this round."""
        return self.sent_bytes / self.dense_bytes if self.dense_bytes else 1.0


@dataclass
class CompressionStats:
    """Bytes per communication round: what an uncompressed allreduce would send versus what was sent."""

    method: str
    """The compression method."""
    steps: int = 0
    """Communication rounds completed."""
    dense_bytes_total: int = 0
    """Sum of ``dense_bytes`` over every round."""
    sent_bytes_total: int = 0
    """Sum of ``sent_bytes`` over every round."""
    history: deque[StepBytes] = field(default_factory=lambda: deque(maxlen=HISTORY))
    """The last :data:`HISTORY` rounds."""
    _dense: int = field(default=0, repr=False)  # the round in progress
    _sent: int = field(default=0, repr=False)

    @property
    def ratio(self) -> float:
        """Cumulative sent / dense (1.0 before the first round and for method none)."""
        return self.sent_bytes_total / self.dense_bytes_total if self.dense_bytes_total else 1.0

    @property
    def last(self) -> StepBytes | None:
        """The most recent completed round."""
        return self.history[-1] if self.history else None

    def add(self, dense_bytes: int, sent_bytes: int) -> None:
        """Count bytes of the current round."""
        self._dense += dense_bytes
        self._sent += sent_bytes

    def end_step(self, compressed: bool, buckets: int | None) -> None:
        """Close the current round."""
        self.history.append(StepBytes(self.steps, self._dense, self._sent, compressed, buckets))
        self.dense_bytes_total += self._dense
        self.sent_bytes_total += self._sent
        self.steps += 1
        self._dense = self._sent = 0

    def to_dict(self) -> dict[str, Any]:
        """Totals, ratio and the last round, for logs and JSON reports."""
        last = self.last
        return {
            "method": self.method,
            "steps": self.steps,
            "dense_bytes_total": self.dense_bytes_total,
            "sent_bytes_total": self.sent_bytes_total,
            "ratio": self.ratio,
            "last": None if last is None else {**asdict(last), "ratio": last.ratio},
        }


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# --------------------------------------------------------------------------------------------------
# the state DDP passes to the hook


class CompressionState:
    """What :func:`apply_compression` registered, its per-rank memory and its byte counts (``stats``)."""

    def __init__(self, cfg: CompressionConfig, process_group: Any):
        self.cfg = cfg
        """The compression section."""
        self.process_group = process_group
        """The data-parallel group the gradients are averaged over."""
        self.world_size = dist.get_world_size(process_group)
        """Ranks in that group."""
        self.step = 0
        """The current communication round (0-based)."""
        self.start_step = effective_start_step(cfg)
        """The first round that may be compressed (PowerSGD with memory starts no earlier than 2)."""
        self.stats = CompressionStats(cfg.method)
        """Bytes per round; read it from any rank (each counts its own sends)."""
        self._codec: _Codec | None = _CODECS[cfg.method](self) if cfg.method != "none" else None

    @property
    def method(self) -> str:
        """The compression method."""
        return self.cfg.method

    def compresses(self, step: int) -> bool:
        """Whether round ``step`` is compressed."""
        return compresses_at(self.cfg, step)

    def _communicate(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        compressed = self.compresses(self.step)
        if compressed:
            fut = self._codec.reduce(bucket)
        else:
            fut = _dense_allreduce(self, bucket.buffer())
            self._codec.on_dense_round(bucket)
        if bucket.is_last():
            self.stats.end_step(compressed, bucket.index() + 1)
            self.step += 1
        return fut


def _comm_hook(state, bucket):  # no annotations: DDP compares them with real classes, and ours are strings
    """The one hook registered on the model: dispatches each bucket to the method or a dense allreduce.

    (Registering torch's bf16 hook by name would also be refused off NCCL, although gloo reduces bf16 fine.)
    """
    return state._communicate(bucket)


def _dense_allreduce(state: CompressionState, tensor: torch.Tensor, count_dense: bool = True):
    """Average ``tensor`` over the group (divide first, as DDP does, so low dtypes do not overflow)."""
    sent = _nbytes(tensor)
    state.stats.add(sent if count_dense else 0, sent)
    tensor.div_(state.world_size)
    work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# --------------------------------------------------------------------------------------------------
# methods


class _Codec:
    """One compression method: ``reduce`` a bucket on compressed rounds; bookkeeping on dense rounds."""

    def __init__(self, state: CompressionState):
        self.state = state

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        raise NotImplementedError

    def on_dense_round(self, bucket: dist.GradBucket) -> None:
        """Called for each bucket of an uncompressed round."""


class _Cast(_Codec):
    """fp16 / bf16: torch's compress wrapper casts the bucket; the inner allreduce counts what it sends."""

    def __init__(self, state: CompressionState, wrapper: Any):
        super().__init__(state)

        def counting_allreduce(hook_state: CompressionState, bucket: dist.GradBucket):
            # The wrapper has already cast the bucket, so the collective sees (and we count) the small dtype.
            return _dense_allreduce(hook_state, bucket.buffer(), count_dense=False)

        self._hook = wrapper(counting_allreduce)

    def reduce(self, bucket):
        self.state.stats.add(_nbytes(bucket.buffer()), 0)
        return self._hook(self.state, bucket)


class _PowerSGD(_Codec):
    """torch's PowerSGD; its iteration counter follows every round so its start agrees with ours."""

    def __init__(self, state: CompressionState):
        super().__init__(state)
        cfg = state.cfg
        self.psgd = powerSGD_hook.PowerSGDState(
            process_group=state.process_group,
            matrix_approximation_rank=effective_powersgd_rank(cfg),
            start_powerSGD_iter=state.start_step,
            use_error_feedback=effective_error_feedback(cfg),
            warm_start=effective_warm_start(cfg),
            # Only its logger reads this; we report through CompressionStats instead.
            compression_stats_logging_frequency=2**62,
        )
        # torch's hook blocks inside its future callbacks (``.wait()`` on the next allreduce). gloo runs those
        # callbacks on its worker threads (two by default), so two buckets in flight block both workers and
        # the allreduces they wait for never run. One bucket at a time keeps a worker free.
        self._one_bucket_at_a_time = dist.get_backend(state.process_group) == "gloo"

    def reduce(self, bucket):
        buffer = bucket.buffer()
        dense, element = _nbytes(buffer), buffer.element_size()
        before = self.psgd.total_numel_after_compression
        fut = powerSGD_hook.powerSGD_hook(self.psgd, bucket)
        # The hook adds, synchronously, the element counts of the P and Q factors and of the tensors it sends
        # uncompressed (vectors, or matrices too small to gain): exactly the tensors it allreduces.
        self.state.stats.add(dense, (self.psgd.total_numel_after_compression - before) * element)
        if self._one_bucket_at_a_time:
            fut.wait()
        return fut

    def on_dense_round(self, bucket):
        self.psgd.maybe_increase_iter(bucket)


class _Residuals:
    """Per-rank error-feedback memory, one flat tensor per bucket, kept per parameter.

    DDP rebuilds its buckets after the first iteration (in the order gradients became ready), so memory keyed
    only by bucket index would be added to the wrong gradients; a new bucket layout is filled from the old one,
    parameter by parameter.
    """

    def __init__(self) -> None:
        self._flat: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
        self._by_param: dict[int, torch.Tensor] = {}

    def get(self, bucket: dist.GradBucket) -> torch.Tensor:
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        entry = self._flat.get(bucket.index())
        if entry is not None and entry[0] == key:
            return entry[1]
        buffer = bucket.buffer()
        flat = torch.zeros_like(buffer)
        packed = 0  # DDP lays the gradients out back to back; their views into the buffer say so exactly
        for param, grad in zip(params, bucket.gradients(), strict=True):
            offset = (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()
            if not 0 <= offset <= buffer.numel() - grad.numel():
                offset = packed
            packed = offset + grad.numel()
            view = flat[offset : offset + grad.numel()]
            old = self._by_param.get(id(param))
            if old is not None and old.numel() == view.numel():
                view.copy_(old)
            self._by_param[id(param)] = view
        self._flat[bucket.index()] = (key, flat)
        return flat


class _TopK(_Codec):
    """Top-k sparsification with one all_gather of (values, int32 indices) per bucket."""

    def __init__(self, state: CompressionState):
        super().__init__(state)
        self.ratio = state.cfg.ratio
        self.residuals = _Residuals() if effective_error_feedback(state.cfg) else None

    def reduce(self, bucket):
        state, buffer = self.state, bucket.buffer()
        n, world = buffer.numel(), state.world_size
        if self.residuals is not None:
            residual = self.residuals.get(bucket)
            buffer.add_(residual)
        k = min(n, max(1, math.ceil(self.ratio * n)))
        index_dtype = torch.int32 if n < 2**31 else torch.int64
        indices = _top_k_indices(buffer.abs(), k)
        values = buffer[indices]
        if self.residuals is not None:
            residual.copy_(buffer)
            residual[indices] = 0
        # One collective instead of two: values and indices travel as one byte string per rank.
        payload = torch.cat([values.view(torch.uint8), indices.to(index_dtype).view(torch.uint8)])
        state.stats.add(_nbytes(buffer), _nbytes(payload))
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=buffer.device)
        work = dist.all_gather_into_tensor(gathered, payload, group=state.process_group, async_op=True)
        value_bytes = values.numel() * values.element_size()

        def decode(fut: torch.futures.Future) -> torch.Tensor:
            rows = gathered.view(world, -1)
            all_values = rows[:, :value_bytes].contiguous().view(buffer.dtype).reshape(-1)
            all_indices = rows[:, value_bytes:].contiguous().view(index_dtype).reshape(-1).long()
            buffer.zero_()
            buffer.index_add_(0, all_indices, all_values)  # entries chosen by several ranks add up
            return buffer.div_(world)

        return work.get_future().then(decode)


def _top_k_indices(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries (in no order): the exact set ``torch.topk`` selects, faster.

    A full ``topk`` over millions of entries dominates a CPU step, so a threshold from a strided sample keeps
    about 2k candidates and ``topk`` runs over those. Every entry left out is below every candidate, so the
    result is exact whenever at least k candidates remain; otherwise it falls back to the full ``topk``.
    """
    n = magnitude.numel()
    stride = n // 4096
    if stride < 4 or 8 * k > n:
        return torch.topk(magnitude, k, sorted=False).indices
    sample = magnitude[::stride]
    keep = max(1, min(sample.numel(), round(2 * k * sample.numel() / n)))
    threshold = sample.kthvalue(sample.numel() - keep + 1).values
    candidates = (magnitude >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return torch.topk(magnitude, k, sorted=False).indices
    return candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes of ``bits`` bits, 8 // bits to a byte (codes padded with zeros to a whole byte)."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    pad = (-codes.numel()) % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    lanes = codes.view(-1, per_byte)
    packed = lanes[:, 0].clone()
    for lane in range(1, per_byte):
        packed |= lanes[:, lane] << (bits * lane)
    return packed


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`_pack` over the last dimension; returns the first ``n`` codes."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed[..., :n]
    mask = (1 << bits) - 1
    lanes = [(packed >> (bits * lane)) & mask for lane in range(per_byte)]
    return torch.stack(lanes, dim=-1).flatten(-2)[..., :n]


class _Quantize(_Codec):
    """Uniform ``bits``-bit quantization over [min, max] of each bucket, codes packed, one all_gather."""

    HEADER = 8  # float32 offset and scale

    def __init__(self, state: CompressionState):
        super().__init__(state)
        self.bits = state.cfg.bits
        self.residuals = _Residuals() if effective_error_feedback(state.cfg) else None
        # Stochastic rounding needs randomness that differs per rank and is reproducible run to run.
        self.generator = torch.Generator().manual_seed(1234 + dist.get_rank())

    def reduce(self, bucket):
        state, buffer = self.state, bucket.buffer()
        n, world, levels = buffer.numel(), state.world_size, (1 << self.bits) - 1
        x = buffer.float()
        if self.residuals is not None:
            residual = self.residuals.get(bucket)
            x += residual
        low, high = torch.aminmax(x)
        scale = torch.where(high > low, (high - low) / levels, torch.ones_like(high))
        position = torch.sub(x, low).div_(scale)
        if self.residuals is not None:
            codes = position.round_()
        else:
            noise = torch.rand(n, generator=self.generator).to(position.device)
            codes = position.add_(noise).floor_()  # unbiased: E[code] = position
        codes = codes.clamp_(0, levels)
        if self.residuals is not None:
            residual.copy_(x - (low + codes * scale))
        header = torch.stack([low, scale]).view(torch.uint8)
        payload = torch.cat([header, _pack(codes.to(torch.uint8), self.bits)])
        state.stats.add(_nbytes(buffer), _nbytes(payload))
        gathered = torch.empty(world * payload.numel(), dtype=torch.uint8, device=buffer.device)
        work = dist.all_gather_into_tensor(gathered, payload, group=state.process_group, async_op=True)

        def decode(fut: torch.futures.Future) -> torch.Tensor:
            rows = gathered.view(world, -1)
            headers = rows[:, : self.HEADER].contiguous().view(torch.float32)  # (world, 2): offset, scale
            codes = _unpack(rows[:, self.HEADER :], self.bits, n).float()  # (world, n)
            # sum_r (offset_r + code_r * scale_r) / world, as one matrix-vector product over the codes
            mean = torch.mv(codes.t(), headers[:, 1] / world).add_(headers[:, 0].sum() / world)
            return buffer.copy_(mean)

        return work.get_future().then(decode)


_CODECS = {
    "fp16": lambda state: _Cast(state, default_hooks.fp16_compress_wrapper),
    "bf16": lambda state: _Cast(state, default_hooks.bf16_compress_wrapper),
    "powersgd": _PowerSGD,
    "topk": _TopK,
    "quantize": _Quantize,
}


# --------------------------------------------------------------------------------------------------
# entry points


def apply_compression(ddp_model: Any, cfg: CompressionConfig, *, process_group: Any = None) -> CompressionState:
    """Register the communication hook for ``cfg.method`` on a ``DistributedDataParallel`` model.

    Call it after wrapping and before the first forward (DDP accepts one hook, before training starts).
    ``process_group``: the group gradients are averaged over (default: the model's own group). Method
    ``none`` registers nothing, so DDP keeps its built-in allreduce; its ``stats`` still count one dense
    round per forward that will synchronise gradients (grad enabled and not under ``no_sync``).
    """
    group = process_group if process_group is not None else getattr(ddp_model, "process_group", None)
    state = CompressionState(cfg, group)
    if cfg.method == "none":
        dense = sum(_nbytes(p) for p in ddp_model.parameters() if p.requires_grad)

        def count_round(module: Any, args: Any) -> None:
            # The same condition DDP's forward uses to prepare a reducing backward.
            if torch.is_grad_enabled() and module.require_backward_grad_sync:
                state.stats.add(dense, dense)
                state.stats.end_step(False, None)
                state.step += 1

        ddp_model.register_forward_pre_hook(count_round)
        return state
    ddp_model.register_comm_hook(state, _comm_hook)
    return state


def check_fsdp_compression(cfg: CompressionConfig, reduce_dtype: str | None) -> None:
    """Raise ConfigError when ``cfg`` cannot run under FSDP2 (sharding stage 2/3); return when it can.

    fp16/bf16 are honoured as FSDP2's reduce dtype (the engine passes ``cfg.method`` as
    ``MixedPrecisionPolicy.reduce_dtype``); ``reduce_dtype`` is the explicit ``precision.reduce_dtype`` (None
    when unset) and must then be unset or equal. powersgd/topk/quantize, and a ``period``/``start_step`` with
    fp16/bf16, need DDP (stage 0/1).
    """
    problems = fsdp_compression_problems(cfg, reduce_dtype)
    if problems:
        raise ConfigError(problems)
