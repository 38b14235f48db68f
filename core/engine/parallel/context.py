"""Context parallelism: each sequence split over the ``cp`` ranks of a context-parallel group, attention over the
whole of it (``parallelism.cp``; Accelerate's ``parallelism_config_cp_size``, torchtitan's
``context_parallel_degree``).

What Accelerate and torchtitan run with torch's ``context_parallel``, on any device: inside
``engine.context_parallel(buffers=[...], buffer_seq_dims=[...])`` (Accelerate's ``maybe_context_parallel``) each
buffer the script gives (input ids, labels, position ids) is replaced in place by this rank's part of its sequence
dimension, and every ``torch.nn.functional.scaled_dot_product_attention`` call attends from this rank's queries to the
keys and values of the whole sequence, all-gathered over the group (torch's "allgather" rotation); a causal call runs
torch's causal kernel over the keys up to this rank's part, without a mask of the whole sequence. Rank ``r`` holds the
``r``-th of ``cp`` contiguous parts. (torch load-balances instead, rank ``r`` holding chunks ``r`` and ``2cp - 1 - r`` of
``2 x cp``, which shares a ring's causal work out evenly; here the last rank of a group does the most, and contiguous
parts keep each rank's position ids contiguous, which Hugging Face models would otherwise take for packed sequences
and mask.) The gather's backward reduce-scatters the key and value gradients to the ranks that hold them. On leaving
the context each buffer gets its whole value back (unless it is in ``no_restore_buffers``). What cannot be split (a
mask, cross-attention, ranks given different batches, a block in a block) is refused on every rank of the group.

Why not torch's own ``context_parallel``: torch 2.13's splits only the CUDA attention kernels, and raises
``NotImplementedError`` for the CPU one (``_scaled_dot_product_flash_attention_for_cpu``).

The context-parallel peers hold the same model and read the same batch shard; each rank's loss is the mean over its
part of the sequence, and the gradients are averaged over every data-parallel and context-parallel rank (FSDP2 over
the flattened ``dp_shard x cp`` ranks, as Accelerate and torchtitan shard; DDP and ZeRO-1/2 over every rank without
tensor parallelism), which is the gradient of the whole sequence's mean when every part counts as many tokens.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torsh.errors import ConfigError, Problem
from torsh.plan import Degrees, context_groups

from ..agreement import agreed_problem
from ..distributed import own_group

KEY = "parallelism.cp"


@dataclass(frozen=True)
class ContextGroups:
    """This rank's context-parallel groups (:func:`build_context_groups`)."""

    size: int
    """The context-parallel degree."""
    group: Any
    """This rank's context-parallel group: the ranks that share its sequences."""
    ranks: tuple[int, ...]
    """The global ranks of :attr:`group`, in the order of the sequence's parts."""
    replicas: Any
    """The data-parallel group: the ranks at this rank's position of the context-parallel (and tensor-parallel)
    dimension, one per batch shard."""

    @property
    def rank(self) -> int:
        """This rank's index in its group: which parts of the sequence it holds."""
        return self.ranks.index(dist.get_rank())


def build_context_groups(laid: Degrees | None, *, experts: bool = False, mpu: Any = None) -> ContextGroups | None:
    """This rank's groups (collective: every rank makes every group, in one order); None without context
    parallelism. ``experts``: the model has local MoE experts; ``mpu``: the script passed one (both refused)."""
    if laid is None or laid.cp == 1:
        return None
    if experts or mpu is not None:
        what = "MoE expert parallelism (the MoE layers' ep_size)" if experts else "an mpu passed to initialize"
        raise ConfigError([Problem(KEY, laid.cp, f"context parallelism beside {what} is not run by the torsh engine: "
                                   "set parallelism.cp to 1, or drop the other")])  # fmt: skip
    cp_groups, dp_groups = context_groups(laid)
    group, ranks = own_group(cp_groups)
    replicas, _ = own_group(dp_groups)
    return ContextGroups(laid.cp, group, ranks, replicas)


def shard(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """This rank's part of ``tensor`` along ``dim``: the ``rank``-th of ``size`` contiguous parts (a copy)."""
    return tensor.chunk(size, dim=dim)[rank].clone(memory_format=torch.contiguous_format)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dimension (-2) over the group, in rank order; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups: ContextGroups) -> torch.Tensor:
        ctx.groups = groups
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(groups.size)]
        dist.all_gather(parts, x.contiguous(), group=groups.group)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = [p.contiguous() for p in grad.chunk(ctx.groups.size, dim=-2)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=ctx.groups.group)
        return out, None


def _extremes(values: list[float], groups: ContextGroups, device: torch.device) -> tuple[list[float], list[float]]:
    """The smallest and the largest of each value over the ranks of the group (one all-reduce); this rank's own
    without a process group."""
    if groups.group is None or not (dist.is_available() and dist.is_initialized()):
        return list(values), list(values)
    both = torch.tensor([*values, *(-v for v in values)], dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=groups.group)
    got = both.tolist()
    return [-v for v in got[len(values):]], got[: len(values)]


def _refuse_together(problem: str | None, what: list[float], groups: ContextGroups, device: torch.device,
                     differing: str) -> None:  # fmt: skip
    """Raise on every rank of the group when any rank has a ``problem``, or when the ranks' ``what`` differ
    (``differing`` says why that is wrong): a refusal on one rank alone would leave the others waiting in the next
    collective. The check is one small all-reduce; only a refusal gathers the ranks' texts
    (:func:`torsh.engine.agreement.agreed_problem`)."""
    low, high = _extremes([float(problem is not None), *what], groups, device)
    if high[0]:
        problem = agreed_problem(problem, dist.get_rank(groups.group) if groups.group is not None else 0,
                                 groups.group)  # fmt: skip
    elif low != high:
        problem = differing
    if problem:
        raise ConfigError([Problem(KEY, groups.size, problem)])


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):  # fmt: skip
    return locals()


_SDPA_PARAMETERS = inspect.signature(_sdpa_arguments)
_SDPA = F.scaled_dot_product_attention
"""torch's own function (:func:`attention_patched` replaces the module's name for a backward)."""
#: What runs a backward: a torch function mode is off while it handles one, so the recomputation of a checkpointed
#: forward inside it calls ``scaled_dot_product_attention`` unseen (:func:`attention_patched` covers it).
_BACKWARDS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
#: The module-level names bound to torch's function that split calls came through (``from torch.nn.functional import
#: scaled_dot_product_attention``): :class:`attention_patched` replaces them as well as the module's own name.
_BY_NAME: dict[tuple[int, str], tuple[dict, str]] = {}


def _note_caller(frame: Any) -> None:
    """Remember the names of ``frame``'s module that are torch's function (the frame that called it)."""
    if frame is None:
        return
    names = frame.f_globals
    for name in frame.f_code.co_names:
        if names.get(name) is _SDPA and (id(names), name) not in _BY_NAME:
            _BY_NAME[(id(names), name)] = (names, name)


class SplitAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` over the whole sequence from this rank's part (counted in :attr:`calls`)."""

    def __init__(self, groups: ContextGroups):
        super().__init__()
        self.groups = groups
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BACKWARDS:
            with attention_patched(self.groups):
                return func(*args, **kwargs)
        if func is not _SDPA:
            return func(*args, **kwargs)
        _note_caller(sys._getframe(1))
        self.calls += 1
        return self.attend(**_SDPA_PARAMETERS.bind(*args, **kwargs).arguments)

    def attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False) -> torch.Tensor:  # fmt: skip
        groups = self.groups
        length = query.shape[-2]
        problem = None
        if attn_mask is not None:
            problem = ("scaled_dot_product_attention was given an attn_mask inside the context-parallel context: each "
                       "rank holds part of the sequence, so a mask over it cannot be split; context parallelism runs "
                       "causal or unmasked attention (a Hugging Face model: pass no attention_mask, and pack or pad "
                       "the batch instead)")  # fmt: skip
        elif key.shape[-2] != length or value.shape[-2] != length:
            problem = (f"scaled_dot_product_attention with {length} queries and {key.shape[-2]} keys inside the "
                       "context-parallel context: only self-attention over the split sequence is split (keys and "
                       "values of the same length as the queries)")  # fmt: skip
        _refuse_together(problem, [length], groups, query.device, "the ranks of a context-parallel group hold "
                         "parts of different lengths: every rank of a group must be given the same batch (the "
                         "engine's dataloader does; a script's own sampler takes engine.get_data_parallel_rank() and "
                         "dp_world_size)")  # fmt: skip
        keys, values = _GatherSequence.apply(key, groups), _GatherSequence.apply(value, groups)
        if not is_causal:
            return _SDPA(query, keys, values, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)
        # Causal: this rank's queries see the keys before its part and its own part causally, none after. As the
        # last rows of a causal attention over that prefix, with the queries before them zeros whose outputs are
        # dropped (their gradients are zero, so they add nothing to the keys' and values'): no mask of the whole
        # sequence (which the CPU kernel would keep per layer, as floats), only the causal kernel.
        before = groups.rank * length
        seen = before + length
        queries = torch.cat([query.new_zeros(*query.shape[:-2], before, query.shape[-1]), query], dim=-2) \
            if before else query
        out = _SDPA(queries, keys[..., :seen, :], values[..., :seen, :], dropout_p=dropout_p, is_causal=True,
                    scale=scale, enable_gqa=enable_gqa)  # fmt: skip
        return out[..., before:, :]


class attention_patched(contextlib.AbstractContextManager):  # noqa: N801 (used as a function-like context)
    """``torch.nn.functional.scaled_dot_product_attention`` split for the block (the module's name replaced, and
    every module-level name bound to torch's function that split calls came through): what a backward needs, where
    the torch function mode is off, for activation checkpointing's recomputation of a forward that ran inside the
    context. Leaving puts back what was there, unless something else replaced it meanwhile (a plain object, not a
    generator: one never left, after a failed backward, must not put anything back whenever it is collected)."""

    def __init__(self, groups: ContextGroups):
        split = SplitAttention(groups)

        def attention(*args, **kwargs):
            return split.attend(**_SDPA_PARAMETERS.bind(*args, **kwargs).arguments)

        self.attention = attention

    def __enter__(self):
        global _PATCHED
        _PATCHED, self.replaced = self, F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self.attention
        self.by_name = [(names, name) for names, name in _BY_NAME.values() if names.get(name) is _SDPA]
        for names, name in self.by_name:
            names[name] = self.attention
        return self

    def __exit__(self, *exc):
        global _PATCHED
        if _PATCHED is self:
            _PATCHED = None
        if F.scaled_dot_product_attention is self.attention:
            F.scaled_dot_product_attention = self.replaced
        for names, name in self.by_name:
            if names.get(name) is self.attention:
                names[name] = _SDPA
        return False


_PATCHED: attention_patched | None = None
"""The split a backward installed and has not taken back yet (None: none)."""


def _seq_dims(buffers: list, dims: list | None) -> list[int]:
    dims = [1] * len(buffers) if dims is None else list(dims)
    if len(dims) != len(buffers):
        raise ConfigError([Problem("buffer_seq_dims", dims, f"one sequence dimension per buffer: {len(buffers)} "
                                   f"buffer(s), {len(dims)} dimension(s)")])  # fmt: skip
    for i, (buffer, dim) in enumerate(zip(buffers, dims)):
        if not isinstance(dim, int) or not -buffer.dim() <= dim < buffer.dim():
            raise ConfigError([Problem("buffer_seq_dims", dims, f"buffer {i} has {buffer.dim()} dimension(s): "
                                       f"{dim!r} is not one of them")])  # fmt: skip
    return dims


class ContextParallel(contextlib.AbstractContextManager):
    """``engine.context_parallel(...)``: the buffers split for the duration, attention over the whole sequence."""

    def __init__(self, groups: ContextGroups, module: torch.nn.Module, buffers=None, buffer_seq_dims=None,
                 no_restore_buffers=None):  # fmt: skip
        self.groups, self.module = groups, module
        self.buffers = _tensors("buffers", buffers)
        self.dims = _seq_dims(self.buffers, buffer_seq_dims)
        self.keep = {id(b) for b in _tensors("no_restore_buffers", no_restore_buffers)}
        for i, (buffer, dim) in enumerate(zip(self.buffers, self.dims)):
            if buffer.shape[dim] % groups.size:
                raise ConfigError([Problem("buffers", f"buffer {i}", f"its sequence dimension ({dim}) has "
                                           f"{buffer.shape[dim]} elements, not a multiple of cp = {groups.size} "
                                           "(each context-parallel rank holds an equal part): pad the batch's "
                                           f"sequences to a multiple of {groups.size}")])  # fmt: skip
        self.mode = SplitAttention(groups)
        self._whole: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.restored = False
        """Whether leaving the block gave a buffer its whole value back."""

    def __enter__(self):
        global _ACTIVE
        if _ACTIVE is not None:
            raise ConfigError([Problem(KEY, self.groups.size, "engine.context_parallel inside another "
                                       "context-parallel block: its buffers would be split twice; leave the outer "
                                       "block first")])  # fmt: skip
        _same_batch(self.buffers, self.groups)
        done = set()
        for buffer, dim in zip(self.buffers, self.dims):
            if id(buffer) in done:
                continue
            done.add(id(buffer))
            whole = buffer.data
            buffer.data = shard(whole, dim, self.groups.rank, self.groups.size)
            if id(buffer) not in self.keep:
                self._whole.append((buffer, whole))
        self.mode.__enter__()
        _ACTIVE = self
        return self

    def __exit__(self, *exc):
        global _ACTIVE
        _ACTIVE = None
        self.mode.__exit__(*exc)
        for buffer, whole in self._whole:
            buffer.data = whole
        # autograd keeps the buffers themselves (token ids, targets): a backward after the block would find them
        # whole again (_split_for_backward refuses it)
        self.restored = bool(self._whole)
        self._whole, self.buffers = [], []
        return False


_ACTIVE: ContextParallel | None = None
"""The context-parallel block open in this process (one at a time)."""


def _active(engine: Any) -> ContextParallel | None:
    """The block open on ``engine`` (None: none)."""
    return _ACTIVE if _ACTIVE is not None and _ACTIVE.module is engine else None


def _tensors(key: str, given: Any) -> list:
    """``given`` as a list of tensors (None: none), else the ConfigError naming ``key``."""
    if given is None:
        return []
    if isinstance(given, torch.Tensor) or not isinstance(given, (list, tuple, set, frozenset)) \
            or not all(isinstance(b, torch.Tensor) for b in given):  # fmt: skip
        raise ConfigError([Problem(key, type(given).__name__, "engine.context_parallel takes a list of tensors "
                                   "(the batch's input ids, labels, position ids...)")])  # fmt: skip
    return list(given)


def _same_batch(buffers: list, groups: ContextGroups) -> None:
    """Refuse, on every rank of the group, buffers that differ between its ranks (each rank would hold part of
    another sequence: a script's own sampler over the global ranks, say): a checksum of each, compared."""
    if not buffers:
        return
    sums = [float(b.detach().double().sum() + (b.detach().double().flatten() * torch.arange(
        b.numel(), dtype=torch.float64, device=b.device).remainder(7)).sum()) for b in buffers]  # fmt: skip
    _refuse_together(None, sums, groups, buffers[0].device, "buffers: the ranks of a context-parallel group were "
                     "given different batches: every rank of a group holds part of the same sequences (the engine's "
                     "dataloader gives them the same batch; a script's own sampler takes "
                     "engine.get_data_parallel_rank() and engine.dp_world_size, not the global rank and world "
                     "size)")  # fmt: skip


@contextlib.contextmanager
def forward_context(engine: Any):
    """Around the engine's forward: remembers whether it ran inside the context (for :func:`backward_context`), and
    refuses a forward inside it that called no ``scaled_dot_product_attention`` (its attention would see only this
    rank's part of the sequence)."""
    active = _active(engine)
    if active is not None or torch.is_grad_enabled():  # (a no_grad forward, an evaluation, makes no graph to redo)
        engine.__dict__["_cp_last_forward"] = active  # the block of the forward a backward would redo
    if _PATCHED is not None:  # a direct backward failed while the function was split: put back what was there
        _PATCHED.__exit__(None, None, None)
    if active is None:
        yield
        return
    before = active.mode.calls
    yield
    if active.mode.calls == before:
        raise ConfigError([Problem(KEY, active.groups.size, "the model's forward inside engine.context_parallel "
                                   "called no torch.nn.functional.scaled_dot_product_attention: context parallelism "
                                   "splits that call only, and attention written out by hand would see only this "
                                   "rank's part of the sequence (a Hugging Face model: load it with "
                                   "attn_implementation=\"sdpa\"); run the forward outside the context, or set "
                                   "parallelism.cp to 1")])  # fmt: skip


def _split_for_backward(engine: Any) -> attention_patched | None:
    """The split a backward outside the block needs, after a forward inside it (None: none is needed)."""
    block = engine.__dict__.get("_cp_last_forward")
    if block is None or _active(engine) is not None:
        return None
    if block.restored:
        raise ConfigError([Problem("no_restore_buffers", None, "a backward after the context-parallel block whose "
                                   "buffers were restored: autograd keeps the buffers themselves (token ids, "
                                   "targets), which hold the whole sequences again; give every buffer in "
                                   "no_restore_buffers, or run the backward inside the block")])  # fmt: skip
    return attention_patched(block.groups)


def direct_backward_started(engine: Any) -> Any:
    """A script's own ``loss.backward()`` after the block, from a forward inside it: the split attention for that
    backward (:class:`attention_patched`); returns what puts torch's back when it finishes (the next forward puts it
    back too, should the backward fail)."""
    patch = None if engine.__dict__.get("_running_backward") else _split_for_backward(engine)
    if patch is None:
        return lambda: None
    patch.__enter__()
    return lambda: patch.__exit__(None, None, None)


def backward_context(engine: Any) -> contextlib.AbstractContextManager:
    """Around ``engine.backward`` outside the context after a forward inside it: the split attention again, for
    activation checkpointing's recomputation of that forward."""
    return _split_for_backward(engine) or contextlib.nullcontext()


class ContextParallelMethods:
    """The engine's context-parallel members (an :class:`torsh.engine.engine.Engine` base)."""

    def context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        """Split ``buffers`` (tensors the model reads, each with its sequence dimension in ``buffer_seq_dims``,
        default 1) over the context-parallel group for the ``with`` block, attention over the whole sequence; the
        buffers get their whole values back at its end, except those in ``no_restore_buffers``. Without context
        parallelism (``parallelism.cp`` 1) it does nothing, so a script runs at any degree (Accelerate's
        ``maybe_context_parallel``)."""
        groups = self.__dict__.get("_context_groups")
        if groups is None:
            return contextlib.nullcontext()
        return ContextParallel(groups, self, buffers, buffer_seq_dims, no_restore_buffers)

    maybe_context_parallel = context_parallel
