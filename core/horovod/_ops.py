"""Horovod's collectives (``horovod.torch.mpi_ops``) on torch.distributed, with Horovod's numerics.

Averaging is Horovod's: multiply by ``prescale_factor``, sum across ranks, multiply by
``postscale_factor / size`` (Horovod folds the 1/size of Average into the postscale factor). Compression
casts before the collective and back after it, so scaling happens in the compressed dtype, as in Horovod.
The out-of-place functions are differentiable with Horovod's backward rules.
"""

from __future__ import annotations

import pickle
import warnings

import torch

from ._basics import _get, is_initialized, rank, size
from ._controller import SHUT_DOWN_ERROR, Handle, HorovodInternalError, Request, horovod_dtype

# Horovod's reduce-op constants (horovod/common/message.h ReduceOp values).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_ADASUM = ("op=Adasum is not supported by torsh.horovod: Adasum's scale-invariant pairwise combination has no "
           "torch.distributed equivalent. Use op=hvd.Average (and scale the learning rate by hvd.size() as usual "
           "with Average)")  # fmt: skip


class NoneCompressor:
    """No compression (the default)."""

    @staticmethod
    def compress(tensor):
        """The tensor unchanged, and no context."""
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        """The tensor unchanged."""
        return tensor


class FP16Compressor:
    """Send floating-point tensors as float16 and cast the result back (non-float tensors pass unchanged)."""

    @staticmethod
    def compress(tensor):
        """The tensor as float16 (when floating point) and its original dtype."""
        return (tensor.to(torch.float16) if tensor.dtype.is_floating_point else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        """The tensor back in its original dtype."""
        return tensor.to(ctx) if ctx.is_floating_point else tensor


class Compression:
    """Gradient compression algorithms (``hvd.Compression.none`` / ``hvd.Compression.fp16``)."""

    none = NoneCompressor
    """No compression."""
    fp16 = FP16Compressor
    """float16 on the wire."""


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    Build one from a list of global ranks and register it on every rank with :func:`add_process_set` (or
    ``hvd.init(process_sets=[...])``); pass it as ``process_set=`` to any collective or to ``DistributedOptimizer``.
    Each set runs on its own ``torch.distributed.new_group``. Building from an MPI communicator is not supported.
    """

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks (torsh.horovod has no "
                             "MPI communicators)") from None  # fmt: skip
        if any(not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
        self.ranks = ranks

    def _invalidate(self):
        self.process_set_id = None

    def size(self):
        """Number of ranks in the set, or None if it is not registered."""
        ranks = _set_ranks(self)
        return None if ranks is None else len(ranks)

    def rank(self):
        """This process's index in the set, or None if it is not registered (or not a member)."""
        ranks = _set_ranks(self)
        return None if ranks is None or rank() not in ranks else ranks.index(rank())

    def included(self):
        """Whether this process belongs to the set (None before ``ranks`` are known)."""
        if self.ranks is None:
            return None
        return rank() in self.ranks

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _set_ranks(process_set):
    if process_set.process_set_id is None or not is_initialized():
        return None
    ranks = _controller().set_ranks(process_set.process_set_id)
    return None if ranks is None else list(ranks)


def _controller():
    state = _get()
    if state.controller is None:
        raise HorovodInternalError(SHUT_DOWN_ERROR)
    return state.controller


def _sync_global_set() -> None:
    global_process_set.ranks = list(range(size()))


def add_process_set(process_set):
    """Register a process set on this rank and return it; every rank calls this with the same ranks, in the same order.

    ``process_set`` is a ProcessSet or a list of global ranks. A set with the same ranks as a registered one is a
    ValueError, as in Horovod.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    ranks = tuple(process_set.ranks)
    if any(r < 0 or r >= size() for r in ranks) or not ranks:
        raise ValueError(f"Attempted to add a process set with ranks outside 0..{size() - 1}: {process_set}")
    set_id = _controller().add_process_set(ranks)
    if set_id is None:
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    process_set.process_set_id = set_id
    return process_set


def remove_process_set(process_set) -> bool:
    """Unregister a process set (every rank calls it); False for the global set or a set never registered."""
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return False
    process_set._invalidate()
    return _controller().remove_process_set(set_id)


def _init_process_sets(process_sets) -> None:
    """``hvd.init(process_sets=[...])``: register each (a duplicate of another, or of the global set, is invalidated)."""
    _sync_global_set()
    for ps in process_sets or []:
        if not isinstance(ps, ProcessSet):
            raise ValueError("process_sets must be a list of hvd.ProcessSet")
        if tuple(ps.ranks) == tuple(range(size())):
            ps._invalidate()
            continue
        set_id = _controller().add_process_set(tuple(ps.ranks))
        if set_id is None:
            ps._invalidate()
        else:
            ps.process_set_id = set_id


def resolve_op(op, average) -> int:
    """Horovod's rule for the deprecated ``average=`` argument: ``op`` wins, both given is an error."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    elif average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)  # fmt: skip
        op = Average if average else Sum
    else:
        op = Average
    if op == Adasum:
        raise NotImplementedError(_ADASUM)
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"unknown reduce op {op!r}; expected hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return op


# --- submitting requests ------------------------------------------------------------------------------------------

_handles = 0  # Horovod's handle counter: unnamed operations are "<op>.noname.<handle>" (equal on every rank)


def _op_name(prefix: str, name) -> str:
    global _handles
    _handles += 1
    return f"{prefix}.{name}" if name is not None else f"{prefix}.noname.{_handles}"


_LABEL = {"ALLREDUCE": "Allreduce", "ALLGATHER": "Allgather", "BROADCAST": "Broadcast", "ALLTOALL": "Alltoall",
          "REDUCESCATTER": "Reducescatter", "BARRIER": "Barrier"}  # fmt: skip


def _members(kind: str, process_set) -> tuple:
    ctl = _controller()
    set_id = getattr(process_set, "process_set_id", None)
    ranks = ctl.set_ranks(set_id) if set_id is not None else None
    if ranks is None:
        raise ValueError(f"{_LABEL[kind]}: Process set provided does not exist, or has not been registered.")
    if rank() not in ranks:
        raise ValueError(f"{_LABEL[kind]}: Rank {rank()} is not a member of the provided process set.")
    return set_id, ranks


def _check_tensor(tensor) -> None:
    if not torch.is_tensor(tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise ValueError(f"Tensor type {tensor.type()} is not supported.")
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")


def _submit(kind, name, tensor, process_set, finish=None, **fields) -> Handle:
    set_id, ranks = _members(kind, process_set)
    request = Request(name, kind, set_id, ranks, rank(), shape=tuple(tensor.shape) if tensor is not None else (),
                      dtype=horovod_dtype(tensor.dtype) if tensor is not None else "",
                      device="GPU" if tensor is not None and tensor.is_cuda else "CPU", **fields)  # fmt: skip
    return _controller().submit(request, Handle(tensor=tensor, finish=finish))


def _copy_into(target):
    def finish(result):
        with torch.no_grad():
            (target.data if isinstance(target, torch.nn.Parameter) else target).copy_(result)
        return target

    return finish


def synchronize(handle):
    """Wait for an asynchronous operation and return its output (HorovodInternalError if it failed)."""
    if callable(handle) and not isinstance(handle, Handle):  # sparse_allreduce_async returns a function
        return handle()
    return handle.wait()


def poll(handle) -> bool:
    """True when the operation has completed (``synchronize`` will not block)."""
    return handle.poll()


# --- allreduce ----------------------------------------------------------------------------------------------------


def _allreduce_launch(tensor: torch.Tensor, op: int, prescale: float, postscale: float,
                      process_set=None, name=None) -> Handle:  # fmt: skip
    """In-place allreduce of ``tensor`` (the optimizer's buckets); ``wait()`` the handle for it."""
    _check_tensor(tensor)
    return _submit("ALLREDUCE", _op_name("allreduce", name), tensor, process_set or global_process_set,
                   _copy_into(tensor), op=op, prescale=float(prescale), postscale=float(postscale))  # fmt: skip


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> Handle:  # fmt: skip
    """Start an in-place allreduce; ``synchronize`` the handle for the result."""
    return _allreduce_launch(tensor, resolve_op(op, average), prescale_factor, postscale_factor, process_set, name)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> Handle:  # fmt: skip
    """Start an allreduce into a new tensor."""
    op = resolve_op(op, average)
    _check_tensor(tensor)
    return _submit("ALLREDUCE", _op_name("allreduce", name), tensor, process_set, op=op,
                   prescale=float(prescale_factor), postscale=float(postscale_factor))  # fmt: skip


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):  # fmt: skip
    """Average (or sum, min, max, multiply) ``tensor`` across ranks in place; returns it."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set).wait()


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.args = (op, prescale, postscale, process_set)
        return allreduce_async(tensor, None, name, op, prescale, postscale, process_set).wait()

    @staticmethod
    def backward(ctx, grad):
        # Horovod: the gradient of an allreduce is the allreduce (same op and factors) of the gradient.
        op, prescale, postscale, process_set = ctx.args
        out = allreduce_async(grad.contiguous(), None, None, op, prescale, postscale, process_set).wait()
        return out, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):  # fmt: skip
    """A new tensor: ``tensor`` averaged (by default) across ranks, optionally compressed on the wire."""
    op = resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def _group_handle(handles, finish=None) -> Handle:
    return Handle(parts=handles, finish=finish)


def _group_names(prefix, name, count):
    base = _op_name(prefix, name)
    return [f"{base}_{i}" for i in range(count)]


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> Handle:  # fmt: skip
    """Start an allreduce of each tensor (new tensors); one handle for the group."""
    op = resolve_op(op, average)
    for t in tensors:
        _check_tensor(t)
    names = _group_names("grouped_allreduce", name, len(tensors))
    return _group_handle([_submit("ALLREDUCE", n, t, process_set, op=op, prescale=float(prescale_factor),
                                  postscale=float(postscale_factor)) for n, t in zip(names, tensors, strict=True)])


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set) -> Handle:  # fmt: skip
    """Start an in-place allreduce of each tensor; one handle for the group."""
    op = resolve_op(op, average)
    for t in tensors:
        _check_tensor(t)
    names = _group_names("grouped_allreduce", name, len(tensors))
    return _group_handle([_submit("ALLREDUCE", n, t, process_set, _copy_into(t), op=op,
                                  prescale=float(prescale_factor), postscale=float(postscale_factor))
                          for n, t in zip(names, tensors, strict=True)])  # fmt: skip


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set) -> list:  # fmt: skip
    """``allreduce`` of each tensor, negotiated together (differentiable)."""
    op = resolve_op(op, average)
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [allreduce(t, None, None if name is None else f"{name}_{i}", compression, op, prescale_factor,
                          postscale_factor, process_set) for i, t in enumerate(tensors)]  # fmt: skip
    pairs = [compression.compress(t) for t in tensors]
    out = grouped_allreduce_async([c for c, _ in pairs], None, name, op, prescale_factor, postscale_factor,
                                  process_set).wait()  # fmt: skip
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, pairs, strict=True)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> list:  # fmt: skip
    """``allreduce_`` of each tensor, in place."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set).wait()  # fmt: skip


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Reduce a sparse tensor by allgathering its indices and values; returns a function giving the result."""
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = allgather_async(t._indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                              process_set=process_set)  # fmt: skip
    values = allgather_async(t._values().contiguous(), name=f"{name}.values", process_set=process_set)

    def handle():
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / process_set.size()
        if gathered_indices.dim() == 0 or gathered_values.dim() == 0:
            return t.new().resize_as_(t)
        return torch.sparse_coo_tensor(gathered_indices.transpose(0, 1), gathered_values, t.size())

    return handle


# --- allgather ----------------------------------------------------------------------------------------------------


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    """Start an allgather (first dimensions may differ between ranks)."""
    _check_tensor(tensor)
    return _submit("ALLGATHER", _op_name("allgather", name), tensor, process_set)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.process_set, ctx.dim = process_set, tensor.shape[0] if tensor.dim() else 1
        return allgather_async(tensor, name, process_set).wait()

    @staticmethod
    def backward(ctx, grad):
        # Horovod: average the incoming gradient over the set, then take this rank's rows.
        reduced = allreduce_async(grad.contiguous(), None, None, Average, 1.0, 1.0, ctx.process_set).wait()
        dims = allgather_async(torch.tensor([ctx.dim], dtype=torch.int32), None, ctx.process_set).wait()
        me = ctx.process_set.rank() if ctx.process_set.process_set_id != 0 else rank()
        offset = int(dims[:me].sum()) if me else 0
        return reduced.narrow(0, offset, ctx.dim), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ between ranks)."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> Handle:
    """Start an allgather of each tensor; one handle for the group."""
    for t in tensors:
        _check_tensor(t)
    names = _group_names("grouped_allgather", name, len(tensors))
    return _group_handle([_submit("ALLGATHER", n, t, process_set) for n, t in zip(names, tensors, strict=True)])


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    """``allgather`` of each tensor, negotiated together (differentiable)."""
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [allgather(t, None if name is None else f"{name}_{i}", process_set) for i, t in enumerate(tensors)]
    return grouped_allgather_async(tensors, name, process_set).wait()


# --- broadcast ----------------------------------------------------------------------------------------------------


def _broadcast_submit(tensor, root_rank, name, process_set, finish=None) -> Handle:
    _check_tensor(tensor)
    set_id, ranks = _members("BROADCAST", process_set)
    if root_rank not in ranks:
        raise ValueError(f"broadcast received invalid root rank {root_rank} for provided process set")
    return _submit("BROADCAST", _op_name("broadcast", name), tensor, process_set, finish, root=int(root_rank))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start an in-place broadcast from ``root_rank`` (a global rank)."""
    return _broadcast_submit(tensor, root_rank, name, process_set, _copy_into(tensor))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s value; returns it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start a broadcast into a new tensor."""
    return _broadcast_submit(tensor, root_rank, name, process_set)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return broadcast_async(tensor, root_rank, name, process_set).wait()

    @staticmethod
    def backward(ctx, grad):
        # Horovod: average the gradient over the set; only the root keeps it.
        reduced = allreduce_async(grad.contiguous(), None, None, Average, 1.0, 1.0, ctx.process_set).wait()
        if rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """A new tensor holding ``root_rank``'s ``tensor``."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# --- alltoall -----------------------------------------------------------------------------------------------------


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> Handle:
    """Start an alltoall: ``splits[i]`` first-dimension rows go to rank i of the set (equal parts without splits)."""
    _check_tensor(tensor)
    set_id, ranks = _members("ALLTOALL", process_set)
    given = splits is not None
    if splits is None:
        splits = torch.tensor([], dtype=torch.int32)
    elif not torch.is_tensor(splits):
        splits = torch.tensor(splits, dtype=torch.int32)
    if splits.dim() > 1:
        raise ValueError("alltoall expects a 1D splits tensor")
    if splits.dtype != torch.int32:
        raise ValueError("alltoall expects splits to contain 32-bit integer elements.")
    first = tensor.shape[0] if tensor.dim() else 0
    if splits.numel() == len(ranks):
        send = [int(s) for s in splits.tolist()]
        if sum(send) > first:
            raise ValueError("Sum of splits entries is greater than the first dimension of tensor.")
    elif splits.numel() == 0:
        if first % len(ranks) != 0:
            raise ValueError("splits not provided, but first dimension of tensor is not an even multiple of the "
                             "number of workers.")  # fmt: skip
        send = [first // len(ranks)] * len(ranks)
    else:
        raise ValueError("Number of entries in splits does not equal number of workers.")
    finish = None if given else (lambda result: result[0])
    handle = _submit("ALLTOALL", _op_name("alltoall", name), tensor, process_set, finish, splits=tuple(send))
    return handle


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        handle = alltoall_async(tensor, splits if splits is not None else None, name, process_set)
        handle.finish = None
        output, received = handle.wait()
        ctx.process_set, ctx.received = process_set, received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, *unused):
        out, _ = alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set).wait()
        return out, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Scatter slices of ``tensor`` to every rank of the set and gather theirs.

    Returns the gathered tensor, and the received splits too when ``splits`` is given (Horovod's contract).
    """
    return _Alltoall.apply(tensor, splits, name, process_set)


# --- reducescatter ------------------------------------------------------------------------------------------------


def _reducescatter_op(op) -> int:
    if op == Adasum:
        raise NotImplementedError("Reducescatter does not support Adasum.")
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"unknown reduce op {op!r}")
    return op


def _reducescatter_submit(tensor, name, op, process_set, prescale, postscale, prefix="reducescatter"):
    _check_tensor(tensor)
    if tensor.dim() == 0:
        raise ValueError("Reducescatter does not support scalar inputs")
    return _submit("REDUCESCATTER", name, tensor, process_set, op=_reducescatter_op(op), prescale=float(prescale),
                   postscale=float(postscale))  # fmt: skip


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> Handle:  # fmt: skip
    """Start a reduction across the set whose result's first dimension is split over its ranks."""
    return _reducescatter_submit(tensor, _op_name("reducescatter", name), op, process_set, prescale_factor,
                                 postscale_factor)  # fmt: skip


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.args = (op, process_set, prescale, postscale)
        return reducescatter_async(tensor, name, op, process_set, prescale, postscale).wait()

    @staticmethod
    def backward(ctx, grad):
        op, process_set, prescale, postscale = ctx.args
        grad = grad.clone()
        if op == Sum:
            grad *= len(_members("ALLGATHER", process_set)[1])
        if prescale != 1.0:
            grad *= prescale
        if postscale != 1.0:
            grad *= postscale
        return allgather(grad.contiguous(), process_set=process_set), None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):  # fmt: skip
    """Reduce ``tensor`` across the set (Average by default); this rank gets its share of the first dimension."""
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0) -> Handle:  # fmt: skip
    """Start a reducescatter of each tensor; one handle for the group."""
    for t in tensors:
        _check_tensor(t)
        if t.dim() == 0:
            raise ValueError("Reducescatter does not support scalar inputs")
    names = _group_names("grouped_reducescatter", name, len(tensors))
    return _group_handle([_reducescatter_submit(t, n, op, process_set, prescale_factor, postscale_factor)
                          for n, t in zip(names, tensors, strict=True)])  # fmt: skip


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> list:  # fmt: skip
    """``reducescatter`` of each tensor, negotiated together (differentiable)."""
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [reducescatter(t, None if name is None else f"{name}_{i}", compression, op, process_set,
                              prescale_factor, postscale_factor) for i, t in enumerate(tensors)]  # fmt: skip
    pairs = [compression.compress(t) for t in tensors]
    out = grouped_reducescatter_async([c for c, _ in pairs], name, op, process_set, prescale_factor,
                                      postscale_factor).wait()  # fmt: skip
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, pairs, strict=True)]


# --- objects, barrier, join ---------------------------------------------------------------------------------------


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``root_rank``'s object (pickled), on every rank of the set.

    Horovod names the transfer after the object's type, so ``broadcast_object(x if rank == 0 else None)`` stalls
    there (``dict`` on the root, ``NoneType`` elsewhere); one fixed name unless ``name`` is given matches everywhere.
    """
    name = "broadcast_object" if name is None else name
    payload = pickle.dumps(obj) if rank() == root_rank else b""
    length = broadcast_(torch.tensor([len(payload)], dtype=torch.int64), root_rank, name + ".sz", process_set)
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if rank() == root_rank
            else torch.empty(int(length.item()), dtype=torch.uint8))  # fmt: skip
    broadcast_(data, root_rank, name + ".t", process_set)
    return obj if rank() == root_rank else pickle.loads(bytes(data.numpy()))  # noqa: S301 - our own job's root


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Every rank's object (pickled), in rank order (one fixed name unless ``name`` is given; see broadcast_object)."""
    name = "allgather_object" if name is None else name
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    counts = allgather(torch.tensor([payload.numel()], dtype=torch.int64), name + ".sz", process_set).tolist()
    gathered = allgather(payload, name + ".t", process_set)
    out, offset = [], 0
    for count in counts:
        out.append(pickle.loads(bytes(gathered[offset: offset + count].numpy())))  # noqa: S301
        offset += count
    return out


def barrier(process_set=global_process_set) -> None:
    """Block until every rank of the set arrives (other operations already queued are not waited for)."""
    _submit("BARRIER", "barrier", None, process_set).wait()  # one name, as Horovod's BARRIER_TENSOR_NAME


def join(device=-1) -> int:
    """This rank has no more data: until every rank has joined, it takes part in the others' allreduces with zeros.

    Returns the rank that joined last (the same on every rank). Allgather, broadcast, alltoall and reducescatter
    while a rank has joined fail with Horovod's errors.
    """
    return int(_controller().submit_join().wait())
