"""NVMe offload of the optimizer state (DeepSpeed's ZeRO-Infinity ``offload_optimizer.device: nvme``).

The optimizer state that has one value per parameter element (Adam's ``exp_avg`` and ``exp_avg_sq``, AMSGrad's
maximum, SGD's momentum, ...) lives in files under ``nvme_path/zero_stage_<stage>/optimizer/rank<r>/<n>`` (the rank
subdirectory DeepSpeed makes, and in it one folder per optimizer attached in the process, so that two optimizers
given the same path, an RLHF actor and critic, keep apart), one file per parameter and state name. A missing
``nvme_path`` is made, as DeepSpeed makes it; an optimizer's folder is removed when the optimizer is freed. Between steps
only the small state (Adam's ``step`` counter) stays in host memory.

The step reads each parameter's state in pieces of ``sub_group_numel`` elements (DeepSpeed's ``sub_group_size``),
steps that piece of the parameter with the torch optimizer and writes the piece back, so at most one piece of
state is in host memory at a time. While a piece steps, every parameter group holds only that piece, so the
optimizer steps each parameter of each group exactly once per step. For an elementwise optimizer a piece steps
exactly as the whole tensor would (bit for bit): the ``step`` counter each piece starts from is the parameter's,
and the last piece's is kept. Any other optimizer (Lamb's per-tensor trust ratio, Muon) steps one whole
parameter at a time, so it sees the tensors it would see without offload.

The I/O is plain positional file reads and writes (``os.preadv``/``os.pwritev`` straight into and out of the
tensors' memory) in requests of ``block_size`` bytes (DeepSpeed's ``aio.block_size``); with more than one thread
(``aio.intra_op_parallelism``; DeepSpeed 0.19.8 does not read ``aio.thread_count``, which therefore leaves one
thread) a thread pool issues the requests in parallel, and with ``pipeline`` (``pipeline_read`` or
``pipeline_write``, as DeepSpeed) the next piece is read and the last one written while a piece steps. The
optimizer's step hooks (its own and torch's global ones) run once per step, around all the pieces.

The fp32 master weights stay in host memory, as under CPU offload (at ZeRO-1/2 the flat partitions the post-step
all-gather reads, at stage 3 FSDP2's sharded parameters the forward gathers from); ``offload_param: nvme`` keeps
the parameters on the CPU (FSDP2's ``CPUOffloadPolicy``): both are said once in the log.

Checkpoints: :func:`resident` reads the whole state back for the duration of a save or load (and writes it out
after a load); ``optimizer.state_dict()`` and ``load_state_dict()`` do the same, so checkpoints hold the state as
under CPU offload and move between offload devices, stages and world sizes.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import shutil
import tempfile
import types
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from torsh.errors import ConfigError, Problem

from ..agreement import agreed_problem

log = logging.getLogger("torsh.engine")

PATH_KEY = "offload_optimizer.nvme_path"
"""The key a bad path is reported under (the DeepSpeed config's; torsh's ``offload.nvme_path``)."""
SWAP_ATTR = "_torsh_nvme"
"""The attribute of an optimizer holding its :class:`NvmeSwapper`."""
def states_per_element(optimizer: Any) -> int:
    """Files per parameter element the space check asks for: Adam's two moments, three with AMSGrad's maximum (an
    upper bound for the other optimizers, which keep one or two)."""
    return 3 if any(g.get("amsgrad") for g in optimizer.param_groups) else 2
RESERVE = "reserved.space"
"""The file in an optimizer's folder holding the disk space its state files will take until they take it."""


@dataclass
class _File:
    path: str
    dtype: torch.dtype


# --------------------------------------------------------------------------------------------------
# the path


def path_problem(nvme_path: str | None, need_bytes: int) -> str | None:
    """What is wrong with ``nvme_path`` for ``need_bytes`` of state (None: it can be used); a missing directory is
    made (with its parents), as DeepSpeed does. An OS error of any check (a directory this process may not search or
    create) is the problem, never an exception."""
    if not nvme_path:
        return "is not set: give a directory on a local NVMe (or any local) disk"
    path = Path(nvme_path)
    try:
        if not path.exists():  # made as DeepSpeed makes it (parents too)
            path.mkdir(parents=True, exist_ok=True)
        if not path.is_dir():
            return "is not a directory: point the key at a directory on a local NVMe (or any local) disk"
        try:  # a real write (root passes any access() check, a read-only mount does not)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as e:
            return (f"cannot be written by this process ({e.strerror}): choose a directory it can write, or fix "
                    "its mode")  # fmt: skip
        free = shutil.disk_usage(path).free
    except OSError as e:
        return f"cannot be used by this process ({e.strerror or e}): choose a directory it can write, or fix its mode"
    if free < need_bytes:
        return (f"has {free / 2**20:,.1f} MiB free, the optimizer state needs about "
                f"{need_bytes / 2**20:,.1f} MiB: free space there or choose a larger disk")  # fmt: skip
    return None


def steps_in_pieces(optimizer: Any) -> bool:
    """Whether ``optimizer`` updates each element from that element alone (and the step count), so that a piece
    of a parameter steps bit for bit as the whole would: the torch optimizers of ``optim.ELEMENTWISE`` and Lion
    (by class or base class). Any other (Lamb's trust ratio, Muon's matrix, an unknown class) steps whole
    parameters."""
    from .. import optimizers
    from ..optim import ELEMENTWISE

    if isinstance(optimizer, (optimizers.Lamb, optimizers.MuonWithAuxAdam)):
        return False
    return any(c.__name__ in ELEMENTWISE or c.__name__ == "Lion" for c in type(optimizer).__mro__)


# --------------------------------------------------------------------------------------------------
# file I/O


class _Io:
    """Positional reads and writes of whole tensors in ``nvme_block_size`` requests, on ``nvme_threads`` threads
    (``offload``: the offload section)."""

    def __init__(self, offload: Any):
        self.block = max(4096, int(offload.nvme_block_size))
        self.blocks = ThreadPoolExecutor(max_workers=offload.nvme_threads) if offload.nvme_threads > 1 else None
        self.pipe = ThreadPoolExecutor(max_workers=2) if offload.nvme_pipeline else None
        """The pipelined reads and writes of whole pieces (their requests go to ``blocks``)."""

    @staticmethod
    def close(*pools: ThreadPoolExecutor | None) -> None:
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=False)

    def _requests(self, nbytes: int) -> list[tuple[int, int]]:
        return [(start, min(nbytes, start + self.block)) for start in range(0, nbytes, self.block)]

    def _run(self, fn: Any, fd: int, view: memoryview, offset: int) -> None:
        jobs = self._requests(len(view))
        if self.blocks is not None and len(jobs) > 1:
            for f in [self.blocks.submit(fn, fd, view[a:b], offset + a) for a, b in jobs]:
                f.result()
        else:
            for a, b in jobs:
                fn(fd, view[a:b], offset + a)

    def read(self, file: _File, first: int, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=file.dtype)
        size = out.element_size()
        fd = os.open(file.path, os.O_RDONLY)
        try:
            self._run(_pread, fd, _bytes(out), first * size)
        finally:
            os.close(fd)
        return out

    def write(self, file: _File, first: int, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous().view(-1)
        fd = os.open(file.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            self._run(_pwrite, fd, _bytes(tensor), first * tensor.element_size())
        except OSError as e:
            raise _write_error(e, file.path) from e
        finally:
            os.close(fd)


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")


def _pread(fd: int, view: memoryview, offset: int) -> None:
    got = os.preadv(fd, [view], offset)
    if got != len(view):
        raise OSError(errno.EIO, f"short read of an NVMe offload file ({got} of {len(view)} bytes)")


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        done = os.pwritev(fd, [view], offset)
        view, offset = view[done:], offset + done


def _allocate(path: str, nbytes: int, *, truncate: bool) -> None:
    """``path`` (made if missing) with ``nbytes`` of disk allocated to it (``os.posix_fallocate``); raises ENOSPC
    when the disk cannot hold them. A file system without fallocate allocates nothing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0), 0o600)
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    finally:
        os.close(fd)


def _write_error(e: OSError, path: str) -> Exception:
    if e.errno == errno.ENOSPC:
        return ConfigError([Problem(PATH_KEY, os.path.dirname(path), "the disk is full while writing the "
                                    "optimizer state: free space there or choose a larger disk")])  # fmt: skip
    return e


# --------------------------------------------------------------------------------------------------
# the swapper


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of it), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _per_element(value: Any, param: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) == tuple(param.shape)


class NvmeSwapper:
    """Keeps ``optimizer``'s per-element state in files under ``folder`` (see the module docstring)."""

    def __init__(self, optimizer: Any, folder: Path, offload: Any):
        self.optimizer = optimizer
        self.folder = folder
        self.offload = offload
        """The offload section (its ``nvme_*`` I/O sizes)."""
        self.io = _Io(offload)
        self.files: dict[nn.Parameter, dict[str, _File]] = {}
        self.index = {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        self.depth = 0  # nested resident() calls
        self.reserved = (folder / RESERVE).stat().st_size if (folder / RESERVE).exists() else 0
        """Bytes still held in the folder's reserve file (:func:`_rank_folder`)."""
        self.elementwise = steps_in_pieces(optimizer)
        """Whether a piece of a parameter steps as the whole would (else each parameter is stepped whole)."""
        weakref.finalize(self, _Io.close, self.io.blocks, self.io.pipe)  # the threads end with the optimizer

    # the step -----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, original: Any) -> None:
        """Step every parameter with a gradient, of every group, exactly once (``original``: the optimizer's own
        step): an elementwise optimizer piece by piece, any other one parameter at a time (the whole tensor). While
        one piece steps, every group's parameter list holds only that piece (the other parameters' state is in the
        files, so the optimizer must not see them)."""
        groups = self.optimizer.param_groups
        lists = [g["params"] for g in groups]
        pre, post = _step_hooks(self.optimizer)
        for hook in pre:
            hook(self.optimizer, (self.optimizer,), {})
        try:
            with _hooks_held(self.optimizer):  # the pieces step without them: they run once, around the whole step
                for group, params in zip(groups, lists):
                    for p in params:
                        if p.grad is not None:
                            self._step_param(groups, group, p, original)
        finally:
            for g, params in zip(groups, lists):
                g["params"] = params
        for hook in post:
            hook(self.optimizer, (self.optimizer,), {})

    def _step_param(self, groups: list, group: dict, p: nn.Parameter, original: Any) -> None:
        state = self.optimizer.state
        before = state.pop(p, {})
        small = dict(before)
        # state already in host memory (loaded or made outside this swapper): stepped from it, then written out
        held = {k: small.pop(k) for k in list(small) if _per_element(small[k], p)}
        files = self.files.setdefault(p, {})
        flat, grad = _local(p.detach()).view(-1), _local(p.grad).reshape(-1)
        n = flat.numel()
        chunk = int(self.offload.nvme_sub_group_size) if self.elementwise else 0
        chunk = chunk or max(1, n)  # 0 (or a whole-tensor optimizer): the whole parameter
        spans = [(a, min(n, a + chunk)) for a in range(0, max(1, n), chunk)]
        if held:
            reads: Iterator[dict] = iter([{k: _local(v).reshape(-1)[a:b] for k, v in held.items()} for a, b in spans])
        elif files:
            reads = self._reads(files, spans)
        else:  # never stepped: the optimizer makes the state
            reads = iter([{} for _ in spans])
        whole = not self.elementwise  # step p itself (its norms, its layout), with its state as the optimizer holds it
        kept, writing, target = small, _Later(lambda: None), None
        try:
            for (a, b), loaded in zip(spans, reads):
                if whole:
                    target = p
                    loaded = {k: _as_param_like(v.view(_local(p).shape), p) for k, v in loaded.items()}
                else:
                    target = nn.Parameter(flat[a:b], requires_grad=p.requires_grad)
                    target.grad = grad[a:b]
                state[target] = {**{k: v.clone() if torch.is_tensor(v) else v for k, v in small.items()}, **loaded}
                for g in groups:
                    g["params"] = [target] if g is group else []
                original()
                kept, elementwise = self._split(state.pop(target), target)
                target = None
                following = self._write_behind(p, files, a, elementwise)
                writing.result()  # at most two pieces' writes in flight (and in memory)
                writing = following
            writing.result()
        except BaseException:
            if target is not None:
                state.pop(target, None)
            # the step counter as it was; the pieces already stepped stay stepped (the step is partial)
            kept = before
            raise
        finally:
            state[p] = kept

    def _reads(self, files: dict[str, _File], spans: list[tuple[int, int]]) -> Iterator[dict[str, torch.Tensor]]:
        """Each span's state, the next one read while the caller steps this one (``pipeline``)."""
        ahead = self._read_ahead(files, spans[0])
        for following in spans[1:]:
            loaded, ahead = ahead.result(), self._read_ahead(files, following)
            yield loaded
        yield ahead.result()

    def _split(self, st: dict, piece: torch.Tensor) -> tuple[dict, dict]:
        elementwise = {k: v for k, v in st.items() if _per_element(v, piece)}
        return {k: v for k, v in st.items() if k not in elementwise}, elementwise

    def _file(self, files: dict[str, _File], p: nn.Parameter, key: str, dtype: torch.dtype) -> _File:
        if key not in files:
            path = str(self.folder / f"{self.index[p]}_{key}.tensor.swp")
            nbytes = _local(p).numel() * torch.empty(0, dtype=dtype).element_size()
            self._release(nbytes)  # the reserved space becomes this file's
            try:
                _allocate(path, nbytes, truncate=False)
            except OSError as e:
                raise _write_error(e, path) from e
            files[key] = _File(path, dtype)
        return files[key]

    def _release(self, nbytes: int) -> None:
        """Give ``nbytes`` of the space reserved when attaching back to the disk."""
        if self.reserved <= 0:
            return
        self.reserved = max(0, self.reserved - nbytes)
        reserve = self.folder / RESERVE
        with contextlib.suppress(OSError):
            if self.reserved:
                os.truncate(reserve, self.reserved)
            else:
                reserve.unlink()

    def _read_ahead(self, files: dict[str, _File], span: tuple[int, int]) -> Any:
        a, b = span
        if self.offload.nvme_pipeline:
            return self.io.pipe.submit(self._read_span, files, a, b)
        return _Later(lambda: self._read_span(files, a, b))  # read when the piece steps

    def _read_span(self, files: dict[str, _File], a: int, b: int) -> dict[str, torch.Tensor]:
        return {k: self.io.read(f, a, b - a) for k, f in files.items()}

    def _write_behind(self, p: nn.Parameter, files: dict[str, _File], first: int, elementwise: dict) -> Any:
        for k, v in elementwise.items():  # the first step made the state: name its files
            self._file(files, p, k, v.dtype)
        if self.offload.nvme_pipeline:
            return self.io.pipe.submit(self._write_span, files, first, elementwise)
        self._write_span(files, first, elementwise)
        return _Later(lambda: None)

    def _write_span(self, files: dict[str, _File], first: int, elementwise: dict) -> None:
        for k, v in elementwise.items():
            self.io.write(files[k], first, _local(v))

    # whole state in and out ----------------------------------------------------------------------

    @torch.no_grad()
    def swap_in(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Read every parameter's state (or that of ``params``) back into ``optimizer.state`` as the optimizer
        holds it."""
        for p in self.files if params is None else [q for q in params if q in self.files]:
            files = self.files[p]
            st = self.optimizer.state.setdefault(p, {})
            local = _local(p.detach())
            for key, f in files.items():
                st[key] = _as_param_like(self.io.read(f, 0, local.numel()).view(local.shape), p)

    @torch.no_grad()
    def swap_out(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Write every per-element state tensor (or those of ``params``) to its file and drop it from host
        memory."""
        for p in self.index if params is None else [q for q in params if q in self.index]:
            st = self.optimizer.state.get(p)
            if not st:
                continue
            files = self.files.setdefault(p, {})
            for key, value in st.items():
                if _per_element(value, p):
                    value = _local(value)
                    self.io.write(self._file(files, p, key, value.dtype), 0, value)
            # a new dict: a state_dict() taken while resident keeps the old one, with the tensors
            self.optimizer.state[p] = {k: v for k, v in st.items() if not _per_element(v, p)}

    @contextlib.contextmanager
    def resident(self, params: list[torch.Tensor] | None = None) -> Iterator[None]:
        """The whole state (checkpoints), or that of ``params`` (the tensor-fragment API), in host memory for the
        duration, written back out afterwards."""
        if params is not None:
            if self.depth:  # the whole state is in already
                yield
                return
            self.swap_in(params)
            try:
                yield
            finally:
                self.swap_out(params)
            return
        self.depth += 1
        try:
            if self.depth == 1:
                self.swap_in()
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.swap_out()


def _hook_dicts(optimizer: Any) -> tuple[list[dict], list[dict]]:
    """The step pre- and post-hook dicts torch's ``Optimizer.step`` runs, in its order (global ones first before,
    last after)."""
    from torch.optim import optimizer as torch_optimizer

    own_pre = getattr(optimizer, "_optimizer_step_pre_hooks", {})
    own_post = getattr(optimizer, "_optimizer_step_post_hooks", {})
    return ([torch_optimizer._global_optimizer_pre_hooks, own_pre],
            [own_post, torch_optimizer._global_optimizer_post_hooks])  # fmt: skip


def _step_hooks(optimizer: Any) -> tuple[list, list]:
    pre, post = _hook_dicts(optimizer)
    return [h for d in pre for h in d.values()], [h for d in post for h in d.values()]


@contextlib.contextmanager
def _hooks_held(optimizer: Any) -> Iterator[None]:
    """The step hooks emptied for the duration, in place (their handles stay valid), then put back."""
    pre, post = _hook_dicts(optimizer)
    held = [(d, dict(d)) for d in pre + post]
    for d, _ in held:
        d.clear()
    try:
        yield
    finally:
        for d, hooks in held:
            added = dict(d)  # a hook registered while the pieces stepped
            d.clear()
            d.update(hooks)
            d.update(added)


class _Later:
    """A future of the calling thread: ``result()`` runs ``fn``."""

    def __init__(self, fn: Any):
        self.fn = fn

    def result(self) -> Any:
        return self.fn()


def _as_param_like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local`` as the optimizer would hold it for ``p`` (a DTensor of the same layout when ``p`` is one)."""
    if not hasattr(p, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


# --------------------------------------------------------------------------------------------------
# attaching to an optimizer


def attach_nvme(optimizer: Any, offload: Any, *, stage: int, rank: int) -> Any:
    """Under ``offload.optimizer == "nvme"``, keep ``optimizer``'s per-element state in files under
    ``offload.nvme_path`` (the optimizer itself, with its step and state-dict methods swapping); else unchanged.
    Raises a ConfigError naming ``offload_optimizer.nvme_path`` (on every rank) when a rank cannot use it."""
    if offload.params == "nvme" and rank == 0:
        log.warning("offload_param.device=nvme (approximate): the parameters are kept in CPU memory, not swapped to "
                    "files under nvme_path - NVMe parameter swapping is done as CPU offload (FSDP2 CPUOffloadPolicy)")
    if offload.optimizer != "nvme" or optimizer is None:
        return optimizer
    folder = _rank_folder(optimizer, offload.nvme_path, stage, rank)
    swapper = NvmeSwapper(optimizer, folder, offload)
    weakref.finalize(optimizer, shutil.rmtree, str(folder), True)  # the files go with the optimizer
    _patch(optimizer, swapper)
    if rank == 0:
        log.info("offload_optimizer.device=nvme: optimizer state in %s (sub-groups of %d elements, %d-byte "
                 "requests, %d thread(s), pipelined=%s); the fp32 master weights stay in host memory",
                 folder.parent.parent, offload.nvme_sub_group_size, offload.nvme_block_size, offload.nvme_threads,
                 offload.nvme_pipeline)  # fmt: skip
    return optimizer


_ATTACHED = itertools.count()
"""Optimizers attached in this process: each gets its own folder (two optimizers may share one nvme_path)."""


def _rank_folder(optimizer: Any, nvme_path: str, stage: int, rank: int) -> Path:
    """This optimizer's empty swap folder ``nvme_path/zero_stage_<stage>/optimizer/rank<r>/<n>`` (``n``: the
    optimizers attached before it in this process). Every step that can fail (the checks, making the folder,
    clearing a previous run's files from it, allocating the space the state files will take) is done before the ranks
    agree, so that all of them stop together; the space is held in a reserve file that each state file takes its
    share of when it is made, so that a full disk is found here rather than on one rank in the middle of a step."""
    need = sum(_local(p).numel() * 4 for g in optimizer.param_groups for p in g["params"]) * states_per_element(
        optimizer)
    folder = Path(nvme_path or ".") / f"zero_stage_{stage}" / "optimizer" / f"rank{rank}" / str(next(_ATTACHED))
    problem = path_problem(nvme_path, need)
    if problem is None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for stale in folder.glob("*.tensor.swp"):  # a previous run's state: a resumed run loads its checkpoint
                stale.unlink()
            _allocate(str(folder / RESERVE), need, truncate=True)  # a disk too small fails here, on this rank
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                problem = (f"has too little free space for the optimizer state (about {need / 2**20:,.1f} MiB): free "
                           "space there or choose a larger disk")  # fmt: skip
            else:
                problem = (f"cannot be used by this process ({e.strerror or e} at {folder}): choose a directory it "
                           "can write")  # fmt: skip
    problem = agreed_problem(problem, rank)
    if problem is not None:
        raise ConfigError([Problem(PATH_KEY, nvme_path, problem)])
    return folder


def _patch(optimizer: Any, swapper: NvmeSwapper) -> None:
    """The optimizer's ``step``, ``state_dict`` and ``load_state_dict`` swap (instance attributes, so that an LR
    scheduler built afterwards wraps this step)."""
    own_step, own_save, own_load = optimizer.step, optimizer.state_dict, optimizer.load_state_dict

    def step(self: Any, closure: Any = None) -> Any:
        if closure is not None:  # the closure recomputes the loss: step everything at once, resident
            with swapper.resident():
                return own_step(closure)
        swapper.step(own_step)
        return None

    def state_dict(self: Any) -> dict:
        with swapper.resident():
            return own_save()

    def load_state_dict(self: Any, state_dict: dict) -> None:
        with swapper.resident():
            own_load(state_dict)

    optimizer.step = types.MethodType(step, optimizer)
    optimizer.state_dict = types.MethodType(state_dict, optimizer)
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)
    setattr(optimizer, SWAP_ATTR, swapper)


@contextlib.contextmanager
def resident(optimizer: Any, params: list[torch.Tensor] | None = None) -> Iterator[None]:
    """``optimizer``'s whole state, or that of ``params``, in host memory for the duration (no-op without NVMe
    offload)."""
    swapper = getattr(optimizer, SWAP_ATTR, None)
    if swapper is None:
        yield
        return
    with swapper.resident(params):
        yield
