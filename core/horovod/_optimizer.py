"""``hvd.DistributedOptimizer``, ``broadcast_parameters`` and ``broadcast_optimizer_state`` on torch.distributed.

The wrapper keeps Horovod's contract: the returned object is an instance of a subclass of the wrapped
optimizer's class (built from its ``param_groups``, as Horovod does), gradients are combined in ``step()``
(or an explicit ``synchronize()``), ``backward_passes_per_step`` backward passes accumulate locally before one
reduction, more passes than that raise Horovod's AssertionError, and ``zero_grad()`` between ``backward()``
and ``step()`` raises Horovod's AssertionError.

One deliberate difference: Horovod's coordinator matches tensors across ranks by name, so each gradient's
allreduce may start whenever its hook fires. torch.distributed matches collectives by call order, and hooks
fire in a rank-dependent order when ranks take different branches. So gradients are grouped into fixed
buckets of at most ``HOROVOD_FUSION_THRESHOLD`` bytes (Horovod's tensor fusion; reverse parameter order, the
order backward produces them), and bucket k is launched from a hook only after buckets 0..k-1: every rank
issues the same collectives in the same order, communication still overlaps the backward pass, and a
bucket a rank never completed (an unused parameter) is launched by ``synchronize()``. The numbers are
Horovod's.
"""

from __future__ import annotations

import collections
import os
import warnings
from contextlib import contextmanager

import torch
from torch._utils import _flatten_dense_tensors

from ._basics import size
from ._ops import _ADASUM, Adasum, Average, Compression, ProcessSet, _allreduce_launch, broadcast_, broadcast_async_
from ._ops import broadcast_object
from ._ops import global_process_set, resolve_op

_DEFAULT_FUSION_BYTES = 128 * 1024 * 1024  # horovodrun --fusion-threshold-mb default


def _fusion_threshold() -> int:
    value = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    return int(value) if value else _DEFAULT_FUSION_BYTES


class _DistributedOptimizer:
    """Mixed in before the user's optimizer class (see :func:`DistributedOptimizer`)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set):  # fmt: skip
        super().__init__(params)
        self.process_set = process_set
        self._compression = compression
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v) for i, group in enumerate(self.param_groups)
                                for j, v in enumerate(group["params"])]  # fmt: skip
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced "
                             "by model.named_parameters().")  # fmt: skip
        names = [k for k, _ in named_parameters]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
        named_ids = {id(v) for _, v in named_parameters}
        unnamed = [id(v) for g in self.param_groups for v in g["params"] if id(v) not in named_ids]
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                             f"Python object ids: {', '.join(map(str, unnamed))}")  # fmt: skip
        self._parameter_names = {v: k for k, v in named_parameters}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {v: backward_passes_per_step for _, v in named_parameters}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self._groups = groups
        self._pending: set = set()  # parameters whose gradient changed since the last synchronize()
        self._hook_handles = []
        self._synchronized = False
        self._should_synchronize = True
        self._requires_update = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._in_flight: list = []
        # As Horovod: a rank outside the process set keeps its own gradients.
        if process_set.included() and (size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"):
            self._buckets = _bucket_layout(self._requires_update, compression)
            self._bucket_of = {p: i for i, bucket in enumerate(self._buckets) for p in bucket}
            self._next, self._ready = 0, [0] * len(self._buckets)
            for p in self._requires_update:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(self._count_pass))

    def _count_pass(self, p: torch.Tensor) -> None:
        if self._allreduce_delay[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call to "
                                 "step(). Increase backward_passes_per_step to accumulate gradients locally.")
        self._allreduce_delay[p] -= 1
        self._pending.add(p)
        if self._allreduce_delay[p] == 0:  # the last local pass: this gradient is final until step()
            self._ready[self._bucket_of[p]] += 1
            while self._next < len(self._buckets) and self._ready[self._next] == len(self._buckets[self._next]):
                self._launch(self._next)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change the number of local backward passes per reduction."""
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def load_state_dict(self, *args, **kwargs):
        """The wrapped optimizer's ``load_state_dict``; also resets the accumulation counters (as Horovod)."""
        for *_, handle in self._in_flight:  # collectives already issued must still complete on every rank
            handle.wait()
        self._in_flight.clear()
        if self._hook_handles:
            self._next, self._ready = 0, [0] * len(self._buckets)
        self._pending.clear()
        self._synchronized = False
        self._should_synchronize = True
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        return super().load_state_dict(*args, **kwargs)

    def synchronize(self) -> None:
        """Combine every gradient across ranks now (Horovod's ``synchronize``)."""
        if self._hook_handles:
            while self._next < len(self._buckets):  # buckets not completed by hooks (fewer passes, unused params)
                self._launch(self._next)
            for bucket, flat, ctxs, handle in self._in_flight:
                handle.wait()
                outputs = _split(flat, [shape for _, shape in ctxs])
                for p, out, (ctx, _) in zip(bucket, outputs, ctxs, strict=True):
                    reduced = self._compression.decompress(out, ctx)
                    if p.grad.is_sparse:
                        p.grad = reduced.to_sparse()
                    else:
                        p.grad.copy_(reduced)
            self._in_flight.clear()
            self._next, self._ready = 0, [0] * len(self._buckets)
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._pending.clear()
        self._synchronized = True

    def _launch(self, index: int) -> None:
        # Average: prescale 1/f, sum, postscale f (and 1/size) - Horovod's split of the mean.
        prescale, postscale = ((1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor)
                               if self.op == Average else (1.0, 1.0))  # fmt: skip
        bucket, parts, ctxs = self._buckets[index], [], []
        for p in bucket:
            if p.grad is None:  # another rank may have a gradient for it: take part with zeros, as Horovod does
                p.grad = torch.zeros_like(p)
            compressed, ctx = self._compression.compress(p.grad.to_dense() if p.grad.is_sparse else p.grad)
            parts.append(compressed)
            ctxs.append(ctx)
        flat = _flatten_dense_tensors(parts) if len(parts) > 1 else parts[0].clone()
        self._in_flight.append((bucket, flat, [(c, t.shape) for c, t in zip(ctxs, parts, strict=True)],
                                _allreduce_launch(flat, self.op, prescale, postscale, self.process_set,
                                                  self._bucket_name(bucket))))  # fmt: skip
        self._next = index + 1

    def _bucket_name(self, bucket) -> str:
        # Matched across ranks by name, as Horovod names each gradient's allreduce after its parameter.
        first = self._parameter_names[bucket[0]]
        return first if len(bucket) == 1 else f"{first}+{len(bucket) - 1}"

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not synchronize (after an explicit ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize gradients (unless skipped), then the wrapped optimizer's step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.", stacklevel=2)  # fmt: skip
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        """The wrapped optimizer's ``zero_grad``; forbidden between ``backward()`` and ``step()`` (as Horovod)."""
        if self._pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                                 "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        return super().zero_grad(set_to_none=set_to_none)


def _bucket_layout(params: list, compression) -> list[list]:
    """Fixed buckets in reverse parameter order, one dtype and device each, at most the fusion threshold."""
    threshold, buckets, used = _fusion_threshold(), [], 0
    for p in reversed(params):
        wire = torch.float16 if compression is Compression.fp16 and p.dtype.is_floating_point else p.dtype
        nbytes = p.numel() * torch.empty((), dtype=wire).element_size()
        last = buckets[-1][-1] if buckets else None
        if last is None or threshold <= 0 or used + nbytes > threshold or (last.dtype, last.device) != (
                p.dtype, p.device):  # fmt: skip
            buckets.append([])
            used = 0
        buckets[-1].append(p)
        used += nbytes
    return buckets


def _split(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    if len(shapes) == 1:
        return [flat]
    out, offset = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        out.append(flat[offset: offset + n].view(shape))
        offset += n
    return out


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,  # noqa: N802 - Horovod's name
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                         groups=None, sparse_as_dense=False, process_set=global_process_set):  # fmt: skip
    """Wrap ``optimizer`` so that ``step()`` first combines gradients across ranks (average by default).

    Arguments are Horovod's. ``op=hvd.Adasum`` raises NotImplementedError (no torch.distributed equivalent).
    ``groups`` / ``num_groups`` are validated and accepted; gradients are fused by size instead (same numbers).
    """
    if not isinstance(process_set, ProcessSet) or process_set.process_set_id is None:
        raise ValueError("process_set must be an hvd.ProcessSet registered with hvd.add_process_set")
    if op == Adasum:
        raise NotImplementedError(_ADASUM)
    op = resolve_op(op, None)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set)  # fmt: skip


def broadcast_parameters(params, root_rank: int) -> None:
    """Overwrite parameters with ``root_rank``'s: a ``state_dict()`` or a list of (named) parameters."""
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    # Named after their keys, as in Horovod (matched across ranks by name), and negotiated together.
    handles = [broadcast_async_(p, root_rank, name) for name, p in params if p is not None]
    for handle in handles:
        handle.wait()


def broadcast_optimizer_state(optimizer, root_rank: int, model=None) -> None:
    """Overwrite the optimizer's state and hyper-parameters with ``root_rank``'s.

    As in Horovod, an optimizer without state first takes one step with zero gradients so its state exists
    (with weight decay that step moves the parameters, exactly as under Horovod).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        # A DistributedOptimizer's own step() would reduce: step the wrapped class directly, as Horovod does.
        if isinstance(optimizer, _DistributedOptimizer):
            super(_DistributedOptimizer, optimizer).step()
        else:
            optimizer.step()
        state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        return
    tensors, scalars, setters = [], {}, {}
    occurrences: collections.Counter = collections.Counter()
    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key != "params":
                scalars[f"{key}.{index}"] = value
                setters[f"{key}.{index}"] = (lambda v, i=index, k=key: optimizer.param_groups[i].__setitem__(k, v))
        for pid in group["params"]:
            if pid not in state_dict["state"]:
                continue
            for name, value in state_dict["state"][pid].items():
                occurrences[name] += 1
                key = f"{name}.{occurrences[name]}"
                if torch.is_tensor(value):
                    tensors.append((key, value))
                else:
                    scalars[key] = value
                    setters[key] = (lambda v, s=state_dict["state"][pid], n=name: s.__setitem__(n, v))
    # state_dict() tensors are the optimizer's own: broadcasting in place updates it.
    broadcast_parameters(tensors, root_rank)
    for key, value in broadcast_object(scalars, root_rank).items():
        setters[key](value)

