"""Horovod's coordination on torch.distributed: collectives matched by name across ranks, run by a background thread.

torch.distributed matches collectives by call order; Horovod matches them by *name*. Programs written for Horovod
rely on that: a rank may start its operations in another order than the other ranks, leave one pending across a
barrier, stop early and ``join`` while the others go on reducing, or disagree with the others (another dtype, shape
or root rank) and get an error back rather than a hang, an abort or wrong numbers. So, as in Horovod, every
operation is a *request* queued by the calling thread and a background thread runs cycles:

1. every rank sends the requests queued since the last cycle to every other rank (one ``all_gather_object`` on a
   control group of its own), so each rank holds the same table ``(process set, name) -> {rank: request}``;
2. every rank walks that table in the same order and takes each entry whose process set's ranks have all asked
   (a rank that joined counts as asking, with zeros, for allreduce), checks the requests against each other
   with Horovod's rules and messages (``ConstructResponse`` in Horovod's controller), and the members run it on
   the process set's own group; a mismatch fails the handle on every member with Horovod's message.

Handles are real: ``poll`` is False until the background thread has run the operation, ``synchronize`` waits. The
cost is one exchange of metadata per cycle (when nothing is queued, cycles pause, backing off to 5 ms or to
``HOROVOD_CYCLE_TIME`` milliseconds, and to 50 ms after a quiet second). ``TORSH_HOROVOD_CHECKS=0`` skips comparing the requests (they are still matched by name).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DUPLICATE_NAME_ERROR = ("Requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor "
                        "that is currently being processed.  If you want to request another tensor, use a different "
                        "tensor name.")  # fmt: skip
SHUT_DOWN_ERROR = ("Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to "
                   "allreduce, allgather or broadcast a tensor after one of the ranks finished execution. If the "
                   "shutdown was caused by an exception, you should see the exception in the log before the first "
                   "shutdown message.")  # fmt: skip

_HOROVOD_DTYPES = {torch.uint8: "HOROVOD_UINT8", torch.int8: "HOROVOD_INT8", torch.int16: "HOROVOD_INT16",
                   torch.int32: "HOROVOD_INT32", torch.int64: "HOROVOD_INT64", torch.float16: "HOROVOD_FLOAT16",
                   torch.float32: "HOROVOD_FLOAT32", torch.float64: "HOROVOD_FLOAT64", torch.bool: "HOROVOD_BOOL",
                   torch.bfloat16: "HOROVOD_BFLOAT16"}  # fmt: skip
# gloo has no 16-bit integer: reductions run in int32 and are cast back (exact, with int16's wrap-around), data
# movement carries the same bits as float16.
_REDUCE_WIRE = {torch.int16: torch.int32}
_MOVE_WIRE = {torch.int16: torch.float16}

# Horovod's reduce-op values (horovod/common/message.h).
AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT = 0, 1, 2, 3, 4, 5
_TORCH_OPS = {AVERAGE: dist.ReduceOp.SUM, SUM: dist.ReduceOp.SUM, MIN: dist.ReduceOp.MIN, MAX: dist.ReduceOp.MAX,
              PRODUCT: dist.ReduceOp.PRODUCT}  # fmt: skip


class HorovodInternalError(RuntimeError):
    """A collective operation failed (Horovod's exception; elastic training treats it as recoverable)."""


def horovod_dtype(dtype: torch.dtype) -> str:
    return _HOROVOD_DTYPES.get(dtype, str(dtype))


@dataclass
class Request:
    """What one rank asks for; every rank sees every rank's requests."""

    name: str
    kind: str  # ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER, JOIN
    process_set: int
    ranks: tuple
    rank: int
    dtype: str = ""
    shape: tuple = ()
    device: str = "CPU"
    root: int = -1
    op: int = SUM
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple = ()


@dataclass
class Handle:
    """An operation in flight: ``poll`` / ``synchronize`` it (``hvd.poll``, ``hvd.synchronize``)."""

    request: Request | None = None
    tensor: torch.Tensor | None = None
    finish: object = None  # result -> what synchronize returns
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None
    parts: list | None = None  # a grouped operation: the handles of its members

    def poll(self) -> bool:
        if self.parts is not None:
            return all(p.poll() for p in self.parts)
        return self.done.is_set()

    def wait(self):
        if self.parts is not None:
            results, first_error = [], None
            for part in self.parts:
                try:
                    results.append(part.wait())
                except HorovodInternalError as exc:
                    first_error = first_error or exc
            if first_error is not None:
                raise first_error
            return self.finish(results) if self.finish else results
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.finish(self.result) if self.finish else self.result

    def complete(self, result=None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


def _cycle_seconds() -> float:
    value = os.environ.get("HOROVOD_CYCLE_TIME")  # milliseconds, as horovodrun --cycle-time-ms
    return max(float(value) / 1000.0, 0.0005) if value else 0.005


class Controller:
    """The background thread and the tables of one ``hvd.init()``."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.checks = os.environ.get("TORSH_HOROVOD_CHECKS", "1") != "0"
        self.control = dist.new_group(backend="gloo")
        self.groups: dict[int, tuple[tuple, object]] = {0: (tuple(range(size)), dist.new_group())}
        self.next_set_id = 1
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.outbox: list[Request] = []
        self.local: dict[tuple, Handle] = {}  # this rank's pending operations by (process set ranks, name)
        self.table: dict[tuple, dict[int, Request]] = {}  # (process set ranks, name) -> {rank: request}
        self.joined: list[int] = []
        self.join_handle: Handle | None = None
        self.stopping = False
        self.dead: str | None = None
        self.thread = threading.Thread(target=self._run, name="torsh-horovod", daemon=True)
        self.thread.start()

    # --- process sets ----------------------------------------------------------------------------------------------

    def add_process_set(self, ranks: tuple) -> int | None:
        """Register a process set on this rank (every rank calls it, in the same order, as in Horovod)."""
        if any(r == ranks for r, _ in self.groups.values()):
            return None
        group = dist.new_group(list(ranks))  # collective over all ranks, members or not
        with self.lock:
            set_id = self.next_set_id
            self.next_set_id += 1
            self.groups[set_id] = (ranks, group)
        return set_id

    def remove_process_set(self, set_id: int) -> bool:
        with self.lock:
            entry = self.groups.pop(set_id, None)
        if entry is not None and entry[1] is not None:
            try:
                dist.destroy_process_group(entry[1])
            except Exception:  # noqa: BLE001 - a group this rank is not in
                pass
        return entry is not None

    def set_ranks(self, set_id: int) -> tuple | None:
        entry = self.groups.get(set_id)
        return entry[0] if entry else None

    # --- the calling thread ----------------------------------------------------------------------------------------

    def submit(self, request: Request, handle: Handle) -> Handle:
        with self.lock:
            if self.dead is not None or self.stopping:
                raise HorovodInternalError(self.dead or SHUT_DOWN_ERROR)
            key = (request.ranks, request.name)  # by ranks, not by id: a set is the same set on every rank
            if key in self.local:
                raise ValueError(DUPLICATE_NAME_ERROR)
            handle.request = request
            self.local[key] = handle
            self.outbox.append(request)
        self.wake.set()
        return handle

    def submit_join(self) -> Handle:
        handle = Handle()
        with self.lock:
            if self.dead is not None or self.stopping:
                raise HorovodInternalError(self.dead or SHUT_DOWN_ERROR)
            self.join_handle = handle
            self.outbox.append(Request("join", "JOIN", 0, tuple(range(self.size)), self.rank))
        self.wake.set()
        return handle

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
        self.wake.set()
        self.thread.join(timeout=60)
        with self.lock:
            groups = [g for set_id, (_, g) in self.groups.items()] + [self.control]
            self.groups, self.control = {}, None
        for group in groups:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - already gone with the default group
                pass

    # --- the background thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        idle, quiet_since = 0.0, time.monotonic()
        try:
            while True:
                with self.lock:
                    mine, self.outbox = self.outbox, []
                    stopping = self.stopping
                everyone: list = [None] * self.size
                dist.all_gather_object(everyone, (mine, stopping), group=self.control)
                if any(stop for _, stop in everyone):
                    self._fail_all(HorovodInternalError(SHUT_DOWN_ERROR))
                    return
                news = False
                for requests, _ in everyone:
                    for req in requests:
                        news = True
                        if req.kind == "JOIN":
                            if req.rank not in self.joined:
                                self.joined.append(req.rank)
                        else:
                            self.table.setdefault((req.ranks, req.name), {})[req.rank] = req
                self._process()
                if news:
                    idle, quiet_since = 0.0, time.monotonic()
                    if self.table:  # waiting for another rank: let it catch up without spinning
                        self.wake.wait(0.0005)
                else:
                    # Nothing new anywhere: back off to the cycle time, and after a quiet second to 50 ms (an idle
                    # or waiting job costs little CPU; the first request after a long pause waits up to that long).
                    longest = _cycle_seconds() if time.monotonic() - quiet_since < 1.0 else max(_cycle_seconds(), 0.05)
                    idle = min(max(idle * 2, 0.0005), longest)
                    self.wake.wait(idle)
                self.wake.clear()
        except Exception as exc:  # noqa: BLE001 - a peer died or the group went away: fail what waits, stop
            self.dead = f"Horovod's background loop stopped: {type(exc).__name__}: {exc}"
            self._fail_all(HorovodInternalError(self.dead))

    def _fail_all(self, error: BaseException) -> None:
        with self.lock:
            pending, self.local = list(self.local.values()), {}
            join, self.join_handle = self.join_handle, None
            self.dead = self.dead or SHUT_DOWN_ERROR
        for handle in pending:
            handle.complete(error=error)
        if join is not None:
            join.complete(error=error)

    def _process(self) -> None:
        joined = set(self.joined)
        for key in list(self.table):
            requests = self.table[key]
            first = next(iter(requests.values()))
            members = first.ranks
            if not all(r in requests or (r in joined and len(members) == self.size) for r in members):
                continue
            if not any(r in requests for r in members):
                continue
            del self.table[key]
            if self.rank not in members:
                continue
            with self.lock:
                handle = self.local.pop(key, None)
            ordered = [requests[r] for r in members if r in requests]
            error = _check(ordered, sum(1 for r in members if r not in requests), self.checks)
            if error is not None:
                if handle is not None:
                    handle.complete(error=HorovodInternalError(error))
                continue
            try:
                set_id = handle.request.process_set if handle is not None else 0  # a joined rank: the global set
                result = _EXECUTE[first.kind](self, ordered, handle, members, self.groups_for(set_id))
            except Exception as exc:  # noqa: BLE001 - reported to the caller's synchronize()
                if handle is None:
                    raise
                handle.complete(error=HorovodInternalError(f"{type(exc).__name__}: {exc}"))
                continue
            if handle is not None:
                handle.complete(result)
        if len(joined) == self.size:  # every rank joined: join() returns the last one everywhere
            last = self.joined[-1]
            self.joined = []
            with self.lock:
                handle, self.join_handle = self.join_handle, None
            if handle is not None:
                handle.complete(last)

    def groups_for(self, set_id: int):
        with self.lock:
            return self.groups[set_id][1] if set_id in self.groups else None


# --- Horovod's checks (controller.cc ConstructResponse), in its order, with its messages ---------------------------


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _check(requests: list[Request], joined: int, checks: bool) -> str | None:
    first = requests[0]
    kind = first.kind
    if checks:
        for r in requests[1:]:
            if r.dtype != first.dtype:
                return f"Mismatched data types: One rank had type {first.dtype}, but another rank had type {r.dtype}."
        for r in requests[1:]:
            if r.kind != kind:
                return f"Mismatched operations: One rank did an {kind}, but another rank did an {r.kind}."
        if kind in ("ALLREDUCE", "BROADCAST", "REDUCESCATTER"):
            for r in requests[1:]:
                if r.shape != first.shape:
                    return (f"Mismatched {kind} tensor shapes: One rank sent a tensor of shape {_shape(first.shape)}, "
                            f"but another rank sent a tensor of shape {_shape(r.shape)}.")  # fmt: skip
        if kind in ("ALLREDUCE", "REDUCESCATTER"):
            for r in requests[1:]:
                if (r.prescale, r.postscale) != (first.prescale, first.postscale):
                    return (f"Mismatched prescale and/or postscale factors: One rank sent factors ({first.prescale:g}, "
                            f"{first.postscale:g}), but another rank sent factors ({r.prescale:g}, "
                            f"{r.postscale:g}).")  # fmt: skip
        if kind == "ALLREDUCE":
            for r in requests[1:]:
                if r.op != first.op:
                    return (f"Mismatched reduction operation: One rank sent reduction op {first.op}, but another rank "
                            f"sent reduction op {r.op}.")  # fmt: skip
    if kind in ("ALLGATHER", "ALLTOALL"):
        if joined:
            return ("Allgather is not supported with Join at this time. Specify sparse_to_dense=True if using "
                    "DistributedOptimizer" if kind == "ALLGATHER" else "Alltoall is not supported with Join at "
                    "this time.")  # fmt: skip
        if len(first.shape) == 0:
            return f"Process-set rank zero tried to {kind} a rank-zero tensor."
        for r in requests[1:]:
            if len(r.shape) != len(first.shape):
                return (f"Mismatched {kind} tensor shapes: One rank sent a tensor of rank {len(first.shape)}, but "
                        f"another rank sent a tensor of rank {len(r.shape)}.")  # fmt: skip
            for dim in range(1, len(first.shape)):
                if first.shape[dim] != r.shape[dim]:
                    return (f"Mismatched {kind} tensor shapes: One rank sent a tensor with dimension {dim} equal to "
                            f"{first.shape[dim]}, but another rank sent a tensor with dimension {dim} equal to "
                            f"{r.shape[dim]}.")  # fmt: skip
    if kind == "REDUCESCATTER":
        if joined:
            return "Reducescatter is not supported with Join at this time."
        if len(first.shape) == 0:
            return f"Process-set rank zero tried to {kind} a rank-zero tensor."
    if kind == "BROADCAST":
        if joined:
            return "Broadcast is not supported with Join at this time."
        for r in requests[1:]:
            if r.root != first.root:
                return (f"Mismatched BROADCAST root ranks: One rank specified root rank {first.root}, but another "
                        f"rank specified root rank {r.root}.")  # fmt: skip
    for r in requests[1:]:
        if r.device != first.device:
            return (f"Mismatched {kind} CPU/GPU device selection: One rank specified device {first.device}, but "
                    f"another rank specified device {r.device}.")  # fmt: skip
    return None


# --- running a matched operation (background thread, members only) -------------------------------------------------


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's scaling: floating point in place; integers through float64, truncated toward zero (a C cast)."""
    if factor == 1.0:
        return tensor
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return tensor.mul_(factor)
    return tensor.copy_(torch.trunc(tensor.double() * factor).to(tensor.dtype))


def _local_or_zeros(handle: Handle | None, first: Request) -> torch.Tensor:
    if handle is not None:
        return handle.tensor
    dtype = next(d for d, n in _HOROVOD_DTYPES.items() if n == first.dtype)
    return torch.zeros(first.shape, dtype=dtype)  # a joined rank's contribution


def _allreduce_into(buf: torch.Tensor, op: int, group) -> torch.Tensor:
    wire = _REDUCE_WIRE.get(buf.dtype)
    carried = buf.to(wire) if wire else buf
    dist.all_reduce(carried, op=_TORCH_OPS[op], group=group)
    if wire:
        buf.copy_(carried.to(buf.dtype))
    return buf


def _move(tensor: torch.Tensor) -> torch.Tensor:
    wire = _MOVE_WIRE.get(tensor.dtype)
    return tensor.view(wire) if wire else tensor


def _own(handle: Handle | None, first: Request) -> Request:
    """This rank's own request (they agree unless checks are off), else the first one (a joined rank)."""
    return handle.request if handle is not None and handle.request is not None else first


def _allreduce(ctl, requests, handle, members, group):
    first = _own(handle, requests[0])
    buf = _local_or_zeros(handle, requests[0]).detach().clone().contiguous()
    scale_(buf, first.prescale)
    _allreduce_into(buf, first.op, group)
    post = first.postscale / len(members) if first.op == AVERAGE else first.postscale
    return scale_(buf, post)


def _allgather(ctl, requests, handle, members, group):
    tensor = handle.tensor.detach().contiguous()
    counts = [r.shape[0] for r in requests]
    longest = max(counts)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather([_move(p) for p in parts], _move(padded), group=group)
    return torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)])


def _broadcast(ctl, requests, handle, members, group):
    buf = handle.tensor.detach().clone().contiguous()
    dist.broadcast(_move(buf), src=requests[0].root, group=group)
    return buf


def _alltoall(ctl, requests, handle, members, group):
    me = members.index(ctl.rank)
    tensor = handle.tensor.detach().contiguous()
    send = list(requests[me].splits)
    recv = [r.splits[me] for r in requests]
    rows = tensor.shape[1:]
    out = tensor.new_empty((sum(recv), *rows))
    dist.all_to_all_single(_move(out), _move(tensor[: sum(send)].contiguous()), output_split_sizes=recv,
                           input_split_sizes=send, group=group)  # fmt: skip
    return out, torch.tensor(recv, dtype=torch.int32)


def reducescatter_rows(first_dim: int, n: int) -> list[int]:
    """Horovod's split: ``first_dim // n`` rows each, one more for the first ``first_dim % n`` ranks."""
    return [first_dim // n + (1 if i < first_dim % n else 0) for i in range(n)]


def _reducescatter(ctl, requests, handle, members, group):
    first = _own(handle, requests[0])
    buf = handle.tensor.detach().clone().contiguous()
    scale_(buf, first.prescale)
    _allreduce_into(buf, first.op, group)
    rows = reducescatter_rows(buf.shape[0], len(members))
    me = members.index(ctl.rank)
    out = buf.narrow(0, sum(rows[:me]), rows[me]).clone()
    post = first.postscale / len(members) if first.op == AVERAGE else first.postscale
    return scale_(out, post)


def _barrier(ctl, requests, handle, members, group):
    return None


_EXECUTE = {"ALLREDUCE": _allreduce, "ALLGATHER": _allgather, "BROADCAST": _broadcast, "ALLTOALL": _alltoall,
            "REDUCESCATTER": _reducescatter, "BARRIER": _barrier}  # fmt: skip
