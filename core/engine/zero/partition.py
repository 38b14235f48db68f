"""ZeRO stages 1 and 2 as DeepSpeed runs them, on plain torch: whole parameters, partitioned optimizer (and at
stage 2 partitioned gradients).

Between steps every rank holds every parameter whole, as an ordinary tensor in the compute dtype (what
``engine.module``, ``state_dict()``, hooks and rank-0-only code see is what DeepSpeed users see). The trainable
parameters of each optimizer parameter group are cut into buckets of about ``reduce_bucket_size`` elements, in
the order backward produces their gradients (the reverse of the module's order). Each bucket, padded to a multiple
of 2W (W the world size), is split into W equal chunks; rank r owns chunk r of every bucket of a group, and the
concatenation of its chunks is its *partition* of that group: one flat fp32 master tensor (on the CPU under
optimizer offload) which the torch optimizer steps, so the optimizer state is one flat tensor per group holding
this rank's 1/W. Elementwise optimizers (Adam, AdamW, SGD, Adagrad, ...) compute exactly what they compute on
whole tensors.

Backward: a post-accumulate-grad hook per parameter counts the bucket's gradients; when a bucket is complete its
gradients are copied into one flat buffer in the reduce dtype (divided by W for a mean, before the sum, as
DeepSpeed's ``average_tensor``; under Ulysses by W / sp, the data-parallel replicas, as DeepSpeed), the
parameters' ``.grad`` freed, and one asynchronous collective launched, in bucket order on every rank (a collective
issued out of order would pair with another rank's other bucket).
Backward goes on computing while it runs (``overlap_comm``). At the end of backward (an autograd callback) the
collectives are waited for and this rank's chunk of each is added to its partition gradient, a flat buffer in
the gradient accumulation dtype (``contiguous_gradients``): stage 2 reduces every micro-step, so gradients are
never held whole beyond one bucket. A parameter without a gradient on this rank counts as zeros.

Step: the partition gradients become the masters' ``.grad`` (fp32), the global gradient norm is the square root
of the all-reduced sum of every rank's squared partition norm (so clipping and the inf/nan skip see every rank's
gradients), the optimizer steps, and the updated chunks are all-gathered in buckets of about
``allgather_bucket_size`` elements and copied into the parameters in the compute dtype.

The collectives: on gloo one ``reduce`` of each chunk to its owner (as DeepSpeed reduces to owners) and, after the
step, each owner writes its piece of every parameter from its master and ``broadcast``s it straight into that
parameter on every rank (no gathered buffer: its first-touch page faults and the copy out of it cost more than the
few extra collectives), measured faster there than gloo's ``all_reduce``, ``reduce_scatter_tensor`` (built from
an all-reduce plus copies) and ``all_gather_into_tensor``; on other backends ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` (in ``allgather_bucket_size`` groups). See ARCHITECTURE.md for the numbers.

Stage 1 (``reduce_in_backward=False``): no gradient hooks. DDP wraps the model and all-reduces the whole
gradients at the accumulation boundary (its buckets overlap backward; its communication hooks carry the
configured reduce op and compression), as DeepSpeed's stage 1 averages the whole gradient; after a reduced
backward :meth:`ZeroPartition.absorb_grads` adds this rank's elements to its partition gradient and frees
``.grad``. The step, the norm and the all-gather are stage 2's.

Checkpoints: :meth:`ZeroPartition.full_view` gathers the fp32 masters and the optimizer state into per-parameter
tensors (a module of whole fp32 parameters and an optimizer of the same class over them), the form stage 0 with
master weights saves and loads, so checkpoints move between stages 0-3 and world sizes unchanged; after a load
each rank slices its chunks back out.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torsh.config import GradientsConfig, OptimizerConfig
from torsh.plan import EnginePlan
from torsh.sharding_plan import ShardingPlan

from ..checkpoint.state import RANK_STATE
from ..distributed import DistInfo
from ..precision import PrecisionPlan
from .partition_checkpoint import CheckpointViews, attach, attach_buffers  # noqa: F401 (attach*: re-exported)

from .slots import ALIGNMENT, ZERO_SLOT  # noqa: F401 (re-exported: the names other modules import from here)

log = logging.getLogger("torsh.engine")


@dataclass
class Bucket:
    """Consecutive parameters of one optimizer group, reduced by one collective."""

    index: int
    group: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    """Elements of the parameters (the flat buffer is padded to ``chunk * W``)."""
    chunk: int
    """Elements each rank owns of this bucket."""
    master_offset: int = 0
    """Where this rank's chunk sits in its group's flat partition."""
    ready: int = 0
    work: Any = None
    flat: torch.Tensor | None = None
    out: torch.Tensor | None = None
    values: torch.Tensor | None = None
    """The parameters' storage: one flat tensor of ``chunk * W`` elements in the compute dtype whose slices are the
    parameters (None when they differ in dtype or device); the all-gather after a step writes straight into it."""


@dataclass
class _Backward:
    """The reduction in flight during one backward."""

    next_launch: int = 0
    finishing: bool = False
    queued: bool = False
    arrived: set = field(default_factory=set)


class ZeroPartition(CheckpointViews):
    """The partitioned gradients, fp32 masters and all-gather of one model (see the module docstring)."""

    def __init__(self, model: nn.Module, groups: list[list[nn.Parameter]], *, bucket_numel: int,
                 allgather_numel: int, compute_dtype: torch.dtype, reduce_dtype: torch.dtype,
                 accum_dtype: torch.dtype, master_device: torch.device | None, mean: bool,
                 process_group: Any = None, reduce_in_backward: bool = True, sp: int = 1):  # fmt: skip
        self.model = model
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.divisor = self.world // sp
        """What a mean divides the reduced gradients by: the ranks, under Ulysses (degree ``sp``) the data-parallel
        replicas (DeepSpeed sums over the sequence-parallel peers)."""
        self.rank = dist.get_rank(process_group)
        self.compute_dtype, self.reduce_dtype, self.accum_dtype = compute_dtype, reduce_dtype, accum_dtype
        self.allgather_numel = allgather_numel
        self.mean = mean
        self.reduces = reduce_in_backward
        """Stage 2: the partition reduces the gradients in backward. Stage 1: DDP all-reduces them whole and
        :meth:`absorb_grads` keeps this rank's elements."""
        self.scatter = dist.get_backend(process_group) != "gloo"  # gloo: reduce / broadcast per owner (faster there)
        self.group_params = groups
        self.legacy_order: list[nn.Parameter | None] = []  # the optimizer's parameters in order (legacy ZeRO-1 state)
        self.buckets = _make_buckets(groups, bucket_numel, self.world)
        sizes = self._place_buckets(len(groups))
        self.device = next((p.device for ps in groups for p in ps), torch.device("cpu"))
        self.master_device = master_device or self.device
        self.masters = [nn.Parameter(torch.zeros(n, dtype=torch.float32, device=self.master_device)) for n in sizes]
        self.params_to_master()
        self.grads = [torch.zeros(n, dtype=accum_dtype, device=self.master_device) for n in sizes]
        self._written: set[int] = set()  # buckets accumulated into self.grads since the last zero_grad
        self.require_grads = False
        """DeepSpeed's ``ignore_unused_parameters: false`` under optimizer offload at stage 2: a parameter of this
        rank's partition without a gradient since the last step is an error at the step."""
        self._got: set[int] = set()  # parameters with a gradient since the last zero_grad (for require_grads)
        self.flats = [_link_group([b for b in self.buckets if b.group == gi], self.world, compute_dtype)
                      for gi in range(len(groups))]  # fmt: skip
        """Each group's parameters as one flat tensor in the compute dtype, their storage (DeepSpeed's
        ``bit16_groups_flat``); None where they could not share one (see :func:`_link_group`)."""
        self.sync = True
        self._bw: _Backward | None = None
        self.collectives = 0  # reduction collectives launched (tests count them)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for b in self.buckets for p in b.params
                         if self.reduces]  # fmt: skip

    def _place_buckets(self, groups: int) -> list[int]:
        """Each bucket's place in its group's partition (and the slot on its parameters); the partition sizes."""
        sizes = [0] * groups
        for b in self.buckets:
            b.master_offset = sizes[b.group]
            sizes[b.group] += b.chunk
            for p, off in zip(b.params, b.offsets):
                setattr(p, ZERO_SLOT, (self, b, off))
        return sizes

    # ---- backward ------------------------------------------------------------------------------

    def _own(self, b: Bucket) -> torch.Tensor:
        return self.masters[b.group].data[b.master_offset:b.master_offset + b.chunk]

    def before_backward(self, sync: bool) -> None:
        """Called by ``engine.backward`` before autograd runs: reduce in this backward or not (stage 1 away from the
        boundary accumulates whole gradients locally, as DeepSpeed's stage 1)."""
        self.sync = sync
        self._bw = None

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.sync or p.grad is None:
            return
        bw = self._bw
        if bw is None or bw.finishing:
            bw = self._bw = _Backward()
        if not bw.queued:
            bw.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        _, b, off = getattr(p, ZERO_SLOT)
        if id(p) in bw.arrived:
            return
        bw.arrived.add(id(p))
        self._got.add(id(p))
        if b.flat is None:  # contiguous_gradients: each gradient is copied into its bucket and freed at once
            b.flat = torch.empty(b.chunk * self.world, dtype=self.reduce_dtype, device=p.device)
            b.flat[b.numel:].zero_()
        with torch.no_grad():
            b.flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None
        b.ready += 1
        self._launch_ready(bw)

    def _launch_ready(self, bw: _Backward) -> None:
        while bw.next_launch < len(self.buckets) and self.buckets[bw.next_launch].ready == len(
                self.buckets[bw.next_launch].params):  # fmt: skip
            self._launch(self.buckets[bw.next_launch], bw.arrived)
            bw.next_launch += 1

    @torch.no_grad()
    def _launch(self, b: Bucket, arrived: set) -> None:
        if b.flat is None:
            b.flat = torch.zeros(b.chunk * self.world, dtype=self.reduce_dtype, device=self.device)
        elif b.ready < len(b.params):  # parameters without a gradient on this rank: zeros
            for p, off in zip(b.params, b.offsets):
                if id(p) not in arrived:
                    b.flat[off:off + p.numel()].zero_()
        flat = b.flat
        if self.mean:
            flat.div_(self.divisor)
        if self.scatter:
            b.out = torch.empty(b.chunk, dtype=flat.dtype, device=flat.device)
            b.work = [dist.reduce_scatter_tensor(b.out, flat, group=self.group, async_op=True)]
        else:  # gloo: one reduce per chunk to its owner (DeepSpeed's way; faster there than an all-reduce)
            b.work = [dist.reduce(flat[r * b.chunk:(r + 1) * b.chunk], dst=self._owner(r), group=self.group,
                                  async_op=True) for r in range(self.world)]  # fmt: skip
        self.collectives += 1

    @torch.no_grad()
    def finish_backward(self) -> None:
        """Launch what is left (parameters without a gradient count as zeros), wait, and add this rank's chunks to
        the partition gradients. Runs at the end of autograd's backward; ``engine.backward`` calls it too (a no-op
        when it already ran), so a backward that produced no gradient on this rank still joins the collectives."""
        bw = self._bw
        if not self.reduces or not self.sync or (bw is not None and bw.finishing):
            return
        if bw is None:
            bw = self._bw = _Backward()
        bw.finishing = True
        for b in self.buckets[bw.next_launch:]:
            self._launch(b, bw.arrived)
        bw.next_launch = len(self.buckets)
        for b in self.buckets:
            self._land(b)

    def _land(self, b: Bucket) -> None:
        """Wait for bucket ``b``'s collective and add this rank's chunk to its partition gradient."""
        for work in b.work:
            work.wait()
        part = b.out if self.scatter else b.flat[self.rank * b.chunk:(self.rank + 1) * b.chunk]
        target = self.grads[b.group][b.master_offset:b.master_offset + b.chunk]
        if b.index in self._written:
            target.add_(part.to(target.device))
        else:
            target.copy_(part)
            self._written.add(b.index)
        b.work = b.flat = b.out = None
        b.ready = 0

    @torch.no_grad()
    def absorb_grads(self, grads: dict[int, torch.Tensor] | None = None) -> None:
        """Stage 1, after a reduced backward: every rank holds the whole averaged gradients (DDP left them in
        ``.grad``; or the caller reduced them itself and passes ``grads`` by parameter id, the pipeline engine's
        fp32 accumulation of low-precision weights' gradients, as DeepSpeed's bf16 optimizer); this rank's
        elements are added to its partition gradient (in the accumulation dtype). ``.grad`` is freed, so a later
        micro-step's reduction does not count it again (``grads`` the caller frees). A no-op at stage 2."""
        if self.reduces:
            return
        for b in self.buckets:
            first = b.index not in self._written
            target = self.grads[b.group]
            for p in b.params:
                view = self.local_view(p, target)
                grad = p.grad if grads is None else grads.get(id(p))
                if grad is None:
                    if first:
                        view.zero_()
                    continue
                start, end = self.local_range(p)
                part = grad.reshape(-1)[start:end]
                view.copy_(part) if first else view.add_(part.to(view.dtype))
                if grads is None:
                    p.grad = None
            self._written.add(b.index)

    # ---- step ----------------------------------------------------------------------------------

    def step_tensors(self) -> list[nn.Parameter]:
        """The fp32 masters with their partition gradients as ``.grad`` (what the optimizer steps). Stage 1: a
        gradient still in ``.grad`` (a backward under ``no_sync`` at the boundary, not reduced) is taken as it is,
        as the optimizer would have stepped it before stage 1 ran on the partition."""
        self.absorb_grads()
        if self.require_grads:
            self._check_all_grads()
        for b in self.buckets:
            if b.index not in self._written:  # no reduced backward since the last step: zeros
                self.grads[b.group][b.master_offset:b.master_offset + b.chunk].zero_()
                self._written.add(b.index)
        for m, g in zip(self.masters, self.grads):
            m.grad = g if g.dtype == m.dtype else g.to(m.dtype)
        return self.masters

    def _check_all_grads(self) -> None:
        """DeepSpeed's check at the step of ZeRO-2 with optimizer offload and ``ignore_unused_parameters: false``:
        every parameter this rank holds elements of got a gradient. An AssertionError, as DeepSpeed's, on every rank
        together (one all-reduce), so that no rank is left waiting in the step's collectives."""
        missing = {id(p) for b in self.buckets for p in b.params
                   if id(p) not in self._got and self.local_range(p) != (0, 0)}  # fmt: skip
        flag = torch.tensor([float(bool(missing))], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not float(flag):
            return
        names = [n for n, p in self.model.named_parameters() if id(p) in missing]
        where = f"parameter(s) {', '.join(names)} were" if names else "parameters another rank holds were"
        raise AssertionError(f"{where} not used in producing the loss (no gradient since the last step), which "
                             "zero_optimization.ignore_unused_parameters: false refuses under optimizer offload at "
                             "ZeRO-2: set ignore_unused_parameters to true (DeepSpeed's default), or make every "
                             "trainable parameter and the forward's outputs take part in the loss")  # fmt: skip

    def global_norm(self, grads: list[torch.Tensor], *, skip: list[nn.Parameter] = (), over: tuple = ()) -> float:
        """The 2-norm of every rank's partition gradients together (one all-reduce over the data-parallel group,
        and one over each group of ``over``), not counting the elements of the parameters in ``skip`` (the
        pipeline's later copies of a tied weight)."""
        local = torch.zeros((), dtype=torch.float64, device=self.master_device)
        for g in grads:
            if g.numel():  # each partition's norm in its dtype (fp64 would cost ~30x on the CPU), summed in fp64
                local += torch.linalg.vector_norm(g, 2).double() ** 2
        for p in skip:
            _, b, _ = getattr(p, ZERO_SLOT)
            grad = self.masters[b.group].grad
            if grad is not None:
                local -= self.local_view(p, grad).double().pow(2).sum()
        local = local.to(self.device)
        for group in (self.group, *over):
            dist.all_reduce(local, group=group)
        return math.sqrt(float(local)) if math.isfinite(float(local)) else float(local)

    @torch.no_grad()
    def gather_params(self) -> None:
        """Every rank's updated chunks into every rank's parameters, in the compute dtype: each bucket's owners send
        their chunks straight into its flat parameter storage (pieces of at most ``allgather_bucket_size`` elements
        a collective), so no gathered copy is made; a parameter whose storage was replaced since (``p.data = ...``)
        or that could not share one gets its values copied from a temporary flat buffer."""
        pending = []
        for b in self.buckets:
            flat = b.values if b.values is not None else torch.empty(b.chunk * self.world, dtype=self.compute_dtype,
                                                                     device=self.device)  # fmt: skip
            flat[self.rank * b.chunk:(self.rank + 1) * b.chunk].copy_(self._own(b))
            pending.append((b, flat, self._send_chunks(b, flat) if self.world > 1 else []))
        for b, flat, works in pending:
            for work in works:
                work.wait()
            self._copy_out(b, flat)

    def _send_chunks(self, b: Bucket, flat: torch.Tensor) -> list:
        """Launch the collectives that bring every owner's chunk of ``b`` into ``flat`` (this rank's already there):
        on gloo each owner broadcasts (measured faster there than its all-gather), elsewhere an all-gather."""
        piece = max(1, min(b.chunk, self.allgather_numel // self.world))
        works = []
        for lo in range(0, b.chunk, piece):
            hi = min(lo + piece, b.chunk)
            rows = [flat[r * b.chunk + lo:r * b.chunk + hi] for r in range(self.world)]
            if self.scatter and hi - lo == b.chunk:
                works.append(dist.all_gather_into_tensor(flat, rows[self.rank].clone(), group=self.group,
                                                         async_op=True))  # fmt: skip
            elif self.scatter:
                works.append(dist.all_gather(rows, rows[self.rank].clone(), group=self.group, async_op=True))
            else:
                works += [dist.broadcast(row, src=self._owner(r), group=self.group, async_op=True)
                          for r, row in enumerate(rows)]  # fmt: skip
        return works

    def _owner(self, r: int) -> int:
        """The global rank of this group's rank ``r``."""
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def _copy_out(self, b: Bucket, flat: torch.Tensor) -> None:
        """The gathered values of ``b`` into those of its parameters that are not slices of ``flat``."""
        dst, src = [], []
        for p, off in zip(b.params, b.offsets):
            view = flat[off:off + p.numel()]
            if p.data.data_ptr() != view.data_ptr() or p.dtype != view.dtype or p.device != view.device:
                dst.append(p.data)
                src.append(view.view_as(p))
        if dst:
            torch._foreach_copy_(dst, src)

    def zero_grad(self) -> None:
        """Drop the partition gradients (the next reduction writes instead of adding)."""
        self._written.clear()
        self._got.clear()
        for m in self.masters:
            m.grad = None
        for b in self.buckets:
            for p in b.params:
                p.grad = None

    @torch.no_grad()
    def params_to_master(self) -> None:
        """The masters from the parameters' values (after ``engine.load_state_dict`` wrote them)."""
        for b in self.buckets:
            flat = _flatten(b.params, b.chunk * self.world, torch.float32)
            self._own(b).copy_(flat[self.rank * b.chunk:(self.rank + 1) * b.chunk])

    def remove(self) -> None:
        """Take the gradient hooks off the parameters (``engine.destroy``)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- whole values --------------------------------------------------------------------------

    def _gather_flat(self, local: torch.Tensor, b: Bucket | None = None) -> torch.Tensor:
        """Every rank's ``local`` (a flat partition of one group), rank after rank."""
        out = torch.empty(local.numel() * self.world, dtype=local.dtype, device=self.device)
        dist.all_gather_into_tensor(out, local.to(self.device).contiguous(), group=self.group)
        return out.view(self.world, -1)

    def _split(self, rows: torch.Tensor, group: int) -> dict[int, torch.Tensor]:
        """Gathered partitions of ``group`` -> whole value of each of its parameters (by id)."""
        out = {}
        for b in self.buckets:
            if b.group != group:
                continue
            flat = rows[:, b.master_offset:b.master_offset + b.chunk].reshape(-1)
            for p, off in zip(b.params, b.offsets):
                out[id(p)] = flat[off:off + p.numel()].view_as(p).clone()
        return out

    def _local_of(self, b: Bucket, values: list[torch.Tensor | None]) -> torch.Tensor:
        flat = _flatten(values, b.chunk * self.world, torch.float32, like=b.params)
        return flat[self.rank * b.chunk:(self.rank + 1) * b.chunk]

    def full_master(self, p: nn.Parameter) -> torch.Tensor:
        """The whole fp32 master of ``p`` (collective)."""
        _, b, _ = getattr(p, ZERO_SLOT)
        return self._split(self._gather_flat(self.masters[b.group].data), b.group)[id(p)]

    def full_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """The whole reduced gradient of ``p`` in fp32 (collective). Before a reduced backward: the gradient the
        backward left on ``p`` locally (stage 1 under ``no_sync``, as DeepSpeed's ZeRO-1 gives it), else None."""
        _, b, _ = getattr(p, ZERO_SLOT)
        if b.index not in self._written:
            return None if p.grad is None else p.grad.detach().float().clone()
        return self._split(self._gather_flat(self.grads[b.group]), b.group)[id(p)].float()

    @torch.no_grad()
    def set_full_master(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Write the whole fp32 value of ``p`` (the same on every rank) into this rank's chunk of its master."""
        _, b, _ = getattr(p, ZERO_SLOT)
        values = [value.reshape(q.shape) if q is p else None for q in b.params]
        mask = self._local_of(b, [torch.ones_like(v) if v is not None else None for v in values]).bool()
        own = self._own(b)
        own.copy_(torch.where(mask.to(own.device), self._local_of(b, values).to(own.device), own))

    def local_range(self, p: nn.Parameter) -> tuple[int, int]:
        """The elements of ``p`` (flattened) this rank owns: ``[start, end)``, possibly empty."""
        _, b, off = getattr(p, ZERO_SLOT)
        lo, hi = self.rank * b.chunk, (self.rank + 1) * b.chunk
        start, end = max(off, lo), min(off + p.numel(), hi)
        return (start - off, end - off) if end > start else (0, 0)

    def local_view(self, p: nn.Parameter, flat: torch.Tensor) -> torch.Tensor:
        """``p``'s part of this rank's flat partition ``flat`` (a view, 1-D)."""
        _, b, off = getattr(p, ZERO_SLOT)
        start, end = self.local_range(p)
        base = b.master_offset + off + start - self.rank * b.chunk
        return flat[base:base + end - start]


def _flatten(values: list, size: int, dtype: torch.dtype, like: list | None = None) -> torch.Tensor:
    """``values`` flattened into one tensor of ``size`` elements (zeros for None and the padding)."""
    like = like or values
    parts, used = [], 0
    device = like[0].device
    for v, ref in zip(values, like):
        parts.append(v.detach().reshape(-1).to(dtype) if v is not None else torch.zeros(ref.numel(), dtype=dtype,
                                                                                        device=device))
        used += ref.numel()
    if size > used:
        parts.append(torch.zeros(size - used, dtype=dtype, device=device))
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def _make_buckets(groups: list[list[nn.Parameter]], bucket_numel: int, world: int) -> list[Bucket]:
    """Buckets of each group's parameters in backward order (the reverse of the module's), at most about
    ``bucket_numel`` elements each, listed in the order they complete during a backward."""
    order = [(gi, p) for gi, ps in enumerate(groups) for p in ps]
    position = {id(p): i for i, (_, p) in enumerate(order)}
    order.sort(key=lambda item: -position[id(item[1])])
    buckets: list[Bucket] = []
    open_: dict[int, list[nn.Parameter]] = {}

    def close(gi: int) -> None:
        params = open_.pop(gi)
        offsets, n = [], 0
        for p in params:
            offsets.append(n)
            n += p.numel()
        chunk = ALIGNMENT * max(1, -(-n // (world * ALIGNMENT)))  # every rank's chunk starts 4-byte aligned
        buckets.append(Bucket(index=len(buckets), group=gi, params=params, offsets=offsets, numel=n, chunk=chunk))

    for gi, p in order:
        bucket = open_.setdefault(gi, [])
        if bucket and sum(q.numel() for q in bucket) + p.numel() > bucket_numel:
            close(gi)
            bucket = open_.setdefault(gi, [])
        bucket.append(p)
    for gi in sorted(open_, key=lambda g: -max(position[id(p)] for p in open_[g])):
        close(gi)
    return buckets


def _link_group(buckets: list[Bucket], world: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Make the parameters of one group's ``buckets`` slices of one flat tensor in the compute dtype (DeepSpeed's
    flat parameter group), each bucket a run of ``chunk * W`` elements (padded), so that the all-gather after a step
    writes into them directly; returns it. None, the parameters left as they are, for an empty group and when they
    differ in dtype or device or are not dense and contiguous."""
    params = [p for b in buckets for p in b.params]
    if not params or any(p.dtype != dtype or p.device != params[0].device or p.layout != torch.strided
                         or not p.is_contiguous() for p in params):  # fmt: skip
        return None
    with torch.no_grad():
        flat = torch.zeros(sum(b.chunk * world for b in buckets), dtype=dtype, device=params[0].device)
        start = 0
        for b in buckets:
            b.values = flat[start:start + b.chunk * world]
            start += b.chunk * world
            for p, off in zip(b.params, b.offsets):
                b.values[off:off + p.numel()].copy_(p.data.reshape(-1))
                p.data = b.values[off:off + p.numel()].view_as(p)
    return flat


# --------------------------------------------------------------------------------------------------
# building the partition and its optimizer


def build_zero(model: nn.Module, *, decided: EnginePlan, precision: PrecisionPlan, info: DistInfo,
               gradients: GradientsConfig, optimizer: OptimizerConfig | None, client: Any, groups: list[dict],
               name_of: dict[int, str], process_group: Any = None) -> tuple[Any, Any]:  # fmt: skip
    """The ShardPlan of ZeRO-1/2 and its optimizer (None without one), from :func:`partition_and_optimizer`. At
    stage 1 DDP wraps the model and all-reduces the whole gradients (its buckets, overlap and communication hooks);
    at stage 2 the partition reduces them itself. ``process_group``: the data-parallel group (an mpu's; None: every
    rank)."""
    from .sharding import ShardPlan, apply_ddp, sequence_degree

    partition, built = partition_and_optimizer(model, decided=decided, precision=precision, gradients=gradients,
                                               optimizer=optimizer, client=client, groups=groups,
                                               name_of=name_of, process_group=process_group)  # fmt: skip
    if info.rank == 0:
        log.info("ZeRO-%d: %d bucket(s); this rank holds %d of %d trainable elements", decided.sharding.stage,
                 len(partition.buckets), sum(end - start for start, end in map(partition.local_range, (
                     p for b in partition.buckets for p in b.params))), sum(b.numel for b in partition.buckets))
    if partition.reduces:
        _note_unit_settings(decided.sharding, info.rank)
        shard = ShardPlan(model, model, "zero", partition=partition, sp=sequence_degree(decided))
    else:  # stage 1: DDP all-reduces the whole gradients, as DeepSpeed's stage 1 averages them
        shard = apply_ddp(model, decided, gradients, precision, info, process_group=process_group)
        shard.partition = partition
    if built is not None:
        _accept_legacy_state(built, partition)
    return shard, built


def partition_and_optimizer(model: nn.Module, *, decided: EnginePlan, precision: PrecisionPlan,
                            gradients: GradientsConfig, optimizer: OptimizerConfig | None, client: Any,
                            groups: list[dict], name_of: dict[int, str], process_group: Any = None,
                            accum_dtype: torch.dtype | None = None) -> tuple[ZeroPartition, Any]:  # fmt: skip
    """The partition of ZeRO-1/2 and the optimizer over its flat fp32 masters (None without one): the optimizer's
    parameter groups (the script's optimizer's, else ``model_parameters``'s, by name) decide the partition's
    groups; the optimizer is the script's class and arguments, its callable's, or the configured one
    (``optimizer``). ``process_group``: the data-parallel group (None: every rank); ``accum_dtype``: the partition
    gradients' dtype (None: the precision plan's gradient accumulation dtype). The main engine's ZeRO-1/2 and the
    pipeline engine's ZeRO-1 (over a stage's replicas, fp32 gradients) both build theirs here."""
    from .sharding import sequence_degree

    by_name = dict(model.named_parameters())
    cls, defaults, named = _client_groups(client, optimizer, decided.sharding.stage, groups, name_of, by_name)
    layout = decided.sharding
    partition = ZeroPartition(
        model, _trainable(named, by_name),
        bucket_numel=max(1, layout.reduce_bucket_numel), allgather_numel=max(1, layout.allgather_bucket_numel),
        compute_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype,
        accum_dtype=accum_dtype or precision.grad_accum_dtype or precision.param_dtype,
        master_device=torch.device("cpu") if decided.masters_on_cpu else None, mean=gradients.reduce_op == "mean",
        process_group=process_group, reduce_in_backward=decided.data_parallel != "zero1", sp=sequence_degree(decided),
    )
    partition.legacy_order = [by_name[n] for g in named for n in g["params"]]  # the order ZeRO-1 saved before
    partition.require_grads = partition.reduces and decided.masters_on_cpu and not layout.ignore_unused_parameters
    built = _partition_optimizer(client, cls, defaults, named, partition, optimizer,
                                 offload=decided.optimizer_on_cpu)  # fmt: skip
    if built is not None:
        from .partition_views import attach_zero_members

        built.optimizer = built  # DeepSpeed's engine.optimizer.optimizer: the torch optimizer of the partition
        attach_zero_members(built, partition, offload=decided.masters_on_cpu, stage=layout.stage)
    return partition, built


def _client_groups(client: Any, optimizer: OptimizerConfig | None, stage: int, groups: list[dict],
                   name_of: dict[int, str], by_name: dict[str, nn.Parameter]
                   ) -> tuple[type | None, dict | None, list[dict]]:  # fmt: skip
    """The script's optimizer class, its arguments and its parameter groups by name (``groups``, the
    ``model_parameters``, without one); an optimizer that is not elementwise is refused at ``stage``."""
    from ..optim import check_elementwise
    from ..optim import rebuild_optimizer

    cls = defaults = None
    named = groups
    if isinstance(client, torch.optim.Optimizer):
        cls, defaults, named = rebuild_optimizer(client, name_of, by_name)
    check_elementwise(client, optimizer, cls, stage)
    return cls, defaults, named


def _trainable(named: list[dict], by_name: dict[str, nn.Parameter]) -> list[list[nn.Parameter]]:
    """Each group's parameters the partition steps: trainable floating-point ones."""
    return [[by_name[n] for n in g["params"] if by_name[n].requires_grad and by_name[n].is_floating_point()]
            for g in named]  # fmt: skip


def _partition_optimizer(client: Any, cls: type | None, defaults: dict | None, named: list[dict],
                         partition: ZeroPartition, optimizer: OptimizerConfig | None, *, offload: bool) -> Any:
    """The optimizer over the partition's flat masters, one parameter per group: the script's class and arguments
    (its object then a view of this one), its callable's, or the configured one (``offload``: built for CPU
    tensors); None without any."""
    params = [{**g, "params": [m]} for g, m in zip(named, partition.masters)]
    return optimizer_over(params, client, cls, defaults, optimizer, offload=offload)


def optimizer_over(params: list[dict], client: Any, cls: type | None, defaults: dict | None,
                   optimizer: OptimizerConfig | None, *, offload: bool) -> Any:
    """The optimizer over ``params`` (groups of flat masters): the script's class and arguments (its object then a
    view of this one), its callable's, or the configured one; None without any. Shared by every flat layout."""
    from ..optim import adopt_construction, construct, forward_client

    if cls is not None:
        defaults, params = adopt_construction(cls, defaults, params)
        built = construct(cls, params, defaults)
        forward_client(client, built)
        return built
    if callable(client):
        return client(params)
    if optimizer is not None and optimizer.name:
        from ..optim import build_optimizer

        return build_optimizer(optimizer, params, offload=offload)
    return None


def _accept_legacy_state(optimizer: torch.optim.Optimizer, partition: ZeroPartition) -> None:
    """``optimizer.load_state_dict`` also reads one rank's ZeRO-1 state saved before stage 1 ran on the partition
    (:meth:`ZeroPartition.load_legacy_state`); its own flat state as torch's optimizer loads it."""
    import types

    own = optimizer.load_state_dict

    def load_state_dict(self: Any, state_dict: dict) -> None:
        if isinstance(state_dict, dict) and RANK_STATE in state_dict:
            partition.load_legacy_state(self, state_dict)
        else:
            own(state_dict)

    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)


def _note_unit_settings(sharding: ShardingPlan, rank: int) -> None:
    """FSDP2's unit settings act at stage 3; at ZeRO-2 there are no units (said once, never silently dropped)."""
    wrap = sharding.wrap
    unused = [key for key, used in (("sharding.reshard_after_forward", sharding.reshard_after_forward is True),
                                    ("sharding.wrap", bool(wrap.module_classes or wrap.min_num_params)),
                                    ("sharding.forward_prefetch", sharding.forward_prefetch),
                                    ("sharding.backward_prefetch", sharding.backward_prefetch not in (None, "none")))
              if used]  # fmt: skip
    if unused and rank == 0:
        log.warning("%s: FSDP2 unit settings have no effect at ZeRO-2, which keeps whole parameters on every rank "
                    "(no units); they apply at stage 3", ", ".join(unused))  # fmt: skip
