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
import torch.distributed as dist

from ._basics import _get, rank, size

# Horovod's reduce-op constants (horovod/common/basics: ReduceOp values).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5

_TORCH_OPS = {Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN, Max: dist.ReduceOp.MAX,
              Product: dist.ReduceOp.PRODUCT}  # fmt: skip
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
    """Only the global process set exists here."""


global_process_set = ProcessSet()


def _check_process_set(process_set) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError("torsh.horovod supports only the global process set")


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
    if op != Average and op not in _TORCH_OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return op


class Handle:
    """An asynchronous operation; ``synchronize(handle)`` waits and returns its result."""

    def __init__(self, works, finish):
        self._works, self._finish, self._done = works, finish, False
        self._result = None

    def wait(self):
        if not self._done:
            for work in self._works:
                work.wait()
            self._result, self._done = self._finish(), True
        return self._result

    def poll(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)


def synchronize(handle: Handle):
    """Wait for an asynchronous operation and return its output tensor."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True when the operation has completed (``synchronize`` will not block)."""
    return handle.poll()


def _scale(tensor: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.mul_(factor)
    else:  # Horovod scales integer buffers element by element and truncates toward zero (a C cast)
        tensor.copy_(torch.trunc(tensor.double() * factor).to(tensor.dtype))


def _allreduce_launch(tensor: torch.Tensor, op: int, prescale: float, postscale: float) -> Handle:
    """In-place allreduce of ``tensor``; Average folds 1/size into the postscale factor as Horovod does."""
    _get()
    _scale(tensor, prescale)
    if op == Average:
        postscale = postscale / size()
    work = dist.all_reduce(tensor, op=_TORCH_OPS.get(op, dist.ReduceOp.SUM), async_op=True)

    def finish():
        _scale(tensor, postscale)
        return tensor

    return Handle([work], finish)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> Handle:  # fmt: skip
    """Start an in-place allreduce; ``synchronize`` the handle for the result."""
    _check_process_set(process_set)
    return _allreduce_launch(tensor, resolve_op(op, average), prescale_factor, postscale_factor)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> Handle:  # fmt: skip
    """Start an allreduce into a new tensor."""
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor, postscale_factor,
                            process_set)  # fmt: skip


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):  # fmt: skip
    """Average (or sum, min, max, multiply) ``tensor`` across ranks in place; returns it."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set).wait()


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale):
        ctx.op = op
        return _allreduce_launch(tensor.detach().clone(), op, prescale, postscale).wait()

    @staticmethod
    def backward(ctx, grad):
        # Horovod: the gradient of an allreduce is the allreduce (same op) of the gradient.
        return _allreduce_launch(grad.detach().clone(), ctx.op, 1.0, 1.0).wait(), None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):  # fmt: skip
    """A new tensor: ``tensor`` averaged (by default) across ranks, optionally compressed on the wire."""
    _check_process_set(process_set)
    op = resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def _gather_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """All ranks' tensors concatenated along dim 0 (first dimensions may differ) and each rank's length."""
    _get()
    tensor = tensor.detach().contiguous()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    n = size()
    lengths = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    all_lengths = [torch.empty_like(lengths) for _ in range(n)]
    dist.all_gather(all_lengths, lengths)
    counts = [int(x.item()) for x in all_lengths]
    longest = max(counts)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)]), counts


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        gathered, counts = _gather_rows(tensor)
        ctx.offset, ctx.length = sum(counts[: rank()]), counts[rank()]
        return gathered

    @staticmethod
    def backward(ctx, grad):
        # Horovod: average the incoming gradient across ranks, then take this rank's rows.
        reduced = _allreduce_launch(grad.detach().clone(), Average, 1.0, 1.0).wait()
        return reduced.narrow(0, ctx.offset, ctx.length)


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ between ranks)."""
    _check_process_set(process_set)
    return _Allgather.apply(tensor)


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    """``allgather`` as a handle (it completes before returning)."""
    result = allgather(tensor, name, process_set)
    return Handle([], lambda: result)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start an in-place broadcast from ``root_rank``."""
    _check_process_set(process_set)
    _get()
    target = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
    work = dist.broadcast(target, src=root_rank, async_op=True)
    return Handle([work], lambda: tensor)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s value; returns it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank):
        ctx.root_rank = root_rank
        out = tensor.detach().clone()
        dist.broadcast(out, src=root_rank)
        return out

    @staticmethod
    def backward(ctx, grad):
        # Horovod: average the gradient; only the root keeps it.
        reduced = _allreduce_launch(grad.detach().clone(), Average, 1.0, 1.0).wait()
        if rank() != ctx.root_rank:
            reduced.zero_()
        return reduced, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """A new tensor holding ``root_rank``'s ``tensor``."""
    _check_process_set(process_set)
    _get()
    return _Broadcast.apply(tensor, root_rank)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start a broadcast into a new tensor."""
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def _device() -> torch.device:
    # NCCL moves only CUDA tensors; gloo only CPU ones.
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _to_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.detach().cpu().clone().untyped_storage())


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``root_rank``'s object (pickled), on every rank."""
    _check_process_set(process_set)
    _get()
    payload = pickle.dumps(obj) if rank() == root_rank else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=_device())
    dist.broadcast(length, src=root_rank)
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(_device()) if rank() == root_rank
            else torch.empty(int(length.item()), dtype=torch.uint8, device=_device()))  # fmt: skip
    dist.broadcast(data, src=root_rank)
    return obj if rank() == root_rank else pickle.loads(_to_bytes(data))  # noqa: S301 - from our own job's root


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Every rank's object (pickled), in rank order."""
    _check_process_set(process_set)
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(_device())
    gathered, counts = _gather_rows(payload)
    out, offset = [], 0
    for count in counts:
        out.append(pickle.loads(_to_bytes(gathered[offset: offset + count])))  # noqa: S301
        offset += count
    return out


def barrier(process_set=global_process_set) -> None:
    """Block until every rank arrives."""
    _check_process_set(process_set)
    _get()
    dist.barrier()


def join(device=-1) -> int:
    """Block until every rank has called ``join``; returns the rank that joined last.

    Unlike Horovod, a rank waiting here does not contribute zeros to other ranks' allreduces: every rank
    must run the same number of collectives before joining (equal numbers of batches per rank).
    """
    _get()
    store = dist.distributed_c10d._get_default_store()
    arrived = store.add(f"torsh_hvd_join_{_join_round()}", 1)
    last = torch.tensor([rank() if arrived == size() else -1], dtype=torch.int64)
    dist.all_reduce(last, op=dist.ReduceOp.MAX)
    return int(last.item())


_join_calls = 0


def _join_round() -> int:
    global _join_calls
    _join_calls += 1
    return _join_calls



def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set) -> list:  # fmt: skip
    """``allreduce`` of each tensor (Horovod reduces a group in one fused operation; the numbers are the same)."""
    return [allreduce(t, average, name, compression, op, prescale_factor, postscale_factor, process_set)
            for t in tensors]  # fmt: skip


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> list:  # fmt: skip
    """``allreduce_`` of each tensor, in place."""
    _check_process_set(process_set)
    op = resolve_op(op, average)
    handles = [_allreduce_launch(t, op, prescale_factor, postscale_factor) for t in tensors]
    return [h.wait() for h in handles]
