"""``deepspeed.runtime.activation_checkpointing.offload_activations``: keep marked checkpoint inputs in host memory.

Non-reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``) keeps
only each checkpointed block's inputs until backward; for a transformer those are the hidden states entering
every layer. :class:`CheckpointHiddenStatesOffload` is a ``torch.autograd.graph.saved_tensors_hooks`` context
(the mechanism of ``torch.autograd.graph.save_on_cpu``) that moves exactly those inputs to host memory while
autograd holds them and brings them back when backward needs them. Every other saved tensor passes through.

Which tensors move is decided by marking: ``manager.mark(t)`` before the checkpoint call, or automatically for
Hugging Face layers: while a manager is active, ``transformers.GradientCheckpointingLayer.__call__`` marks its
first positional argument (``hidden_states``) when the layer is training with gradient checkpointing on. The
class attribute is restored when the last active manager exits.

What stays where:

* a marked tensor is skipped (kept as is) when it is not on the accelerator (always so on the CPU), smaller
  than ``min_offload_bytes``, a parameter or buffer, or an overlapping view (a zero stride);
* the newest ``keep_last_count`` marked inputs stay on the device: backward needs them first;
* host buffers are dense, pinned through the accelerator when ``use_pin_memory``, and pooled by shape and dtype
  (at most ``max_cpu_buffer_pool_count``) for the next step;
* a restored tensor is kept until the context exits, so a second backward (``retain_graph=True``) finds it.

Copies are issued on the current stream, asynchronously when the host buffer is pinned: the device and the host
buffer are only touched in stream order, so no synchronisation is needed. ``use_streams`` and
``max_fwd_stash_count`` (DeepSpeed's side copy stream and the window of device tensors it keeps alive while that
stream copies) are accepted and have nothing to tune here: the forward stash stays empty.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks

from ...accelerator import get_accelerator


@dataclass
class CheckpointActivationOffloadStats:
    """Counters of one ``with`` block (reset when the manager is entered)."""

    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    kept_last_tensors: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0


@dataclass(frozen=True)
class _Offloaded:
    """What autograd holds in place of an offloaded tensor: its number in the manager."""

    tensor_id: int


_local = threading.local()  # the active managers of this thread, innermost last


def _active() -> list:
    if not hasattr(_local, "managers"):
        _local.managers = []
    return _local.managers


class CheckpointHiddenStatesOffload(saved_tensors_hooks):
    """Move marked checkpoint inputs to host memory during forward and back for backward (see the module)."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
                 keep_last_count: int = 1):  # fmt: skip
        for name, value in (("keep_last_count", keep_last_count), ("max_fwd_stash_count", max_fwd_stash_count),
                            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
                            ("min_offload_bytes", min_offload_bytes)):  # fmt: skip
            if value < 0:
                raise ValueError(f"CheckpointHiddenStatesOffload: {name} must be >= 0, got {value}")
        self.use_pin_memory = use_pin_memory
        self.use_streams = use_streams
        self.min_offload_bytes = min_offload_bytes
        self.max_fwd_stash_count = max_fwd_stash_count
        self.max_cpu_buffer_pool_count = max_cpu_buffer_pool_count
        self.keep_last_count = keep_last_count
        self.stats = CheckpointActivationOffloadStats()
        self._marks: dict[int, int] = {}  # id(tensor) -> how many packs of it are still to offload
        self._next_id = 0
        self._keep_last: dict[int, torch.Tensor] = {}  # the newest marked inputs, still on the device
        self._tracker: dict[int, tuple] = {}  # id -> (host buffer, device, size, stride, pool key)
        self._fwd_stash: dict[int, torch.Tensor] = {}  # DeepSpeed's copy-stream window: always empty here
        self._restored: dict[int, torch.Tensor] = {}
        self._cpu_buffer_pool: dict[tuple, list[torch.Tensor]] = {}
        self._cpu_buffer_pool_count = 0
        super().__init__(self._pack, self._unpack)

    # ---- marking ---------------------------------------------------------------------------------------
    def mark(self, tensor: torch.Tensor) -> None:
        """Offload ``tensor`` when autograd next saves it (once per call of ``mark``)."""
        self._marks[id(tensor)] = self._marks.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _consume_mark(self, tensor: torch.Tensor) -> bool:
        count = self._marks.get(id(tensor), 0)
        if count == 0:
            return False
        if count == 1:
            del self._marks[id(tensor)]
        else:
            self._marks[id(tensor)] = count - 1
        return True

    # ---- the saved-tensor hooks ------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor):
        self.stats.saved_tensors_seen += 1
        if not self._consume_mark(tensor):
            return tensor
        if self._stays(tensor):
            self.stats.skipped_marked_tensors += 1
            return tensor
        self._next_id += 1
        self._keep_last[self._next_id] = tensor
        while len(self._keep_last) > self.keep_last_count:
            oldest = next(iter(self._keep_last))
            self._offload(oldest, self._keep_last.pop(oldest))
        return _Offloaded(self._next_id)

    def _unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        tensor_id = packed.tensor_id
        if tensor_id in self._restored:
            return self._restored[tensor_id]
        if tensor_id in self._keep_last:
            tensor = self._keep_last.pop(tensor_id)
            self.stats.kept_last_tensors += 1
        elif tensor_id in self._tracker:
            tensor = self._restore(tensor_id)
        else:
            raise RuntimeError(f"CheckpointHiddenStatesOffload: offloaded activation {tensor_id} is gone; run "
                               "backward() inside the same `with` block as the forward that saved it")
        self._restored[tensor_id] = tensor
        return tensor

    def _stays(self, tensor: torch.Tensor) -> bool:
        accelerator = get_accelerator()
        return (accelerator.is_synchronized_device() or not accelerator.on_accelerator(tensor)
                or tensor.element_size() * tensor.nelement() < self.min_offload_bytes
                or isinstance(tensor, torch.nn.Parameter) or isinstance(tensor, getattr(torch.nn, "Buffer", ()))
                or (tensor.numel() > 1 and 0 in tensor.stride()))  # fmt: skip

    # ---- copies and the host-buffer pool ------------------------------------------------------------------
    def _buffer_key(self, tensor: torch.Tensor) -> tuple:
        """Host buffers are dense: tensors differing only in strides share one."""
        return tuple(tensor.size()), tensor.dtype, tensor.layout, self.use_pin_memory

    def _empty_cpu_like(self, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """A dense host buffer of ``tensor``'s size and dtype (from the pool when one is free), and its key."""
        key = self._buffer_key(tensor)
        pool = self._cpu_buffer_pool.get(key)
        if pool:
            self._cpu_buffer_pool_count -= 1
            return pool.pop(), key
        buffer = torch.empty(tuple(tensor.size()), dtype=tensor.dtype, layout=tensor.layout, device="cpu")
        if self.use_pin_memory:
            buffer = get_accelerator().pin_memory(buffer)
        return buffer, key

    def _give_back(self, key: tuple, buffer: torch.Tensor) -> None:
        if self._cpu_buffer_pool_count < self.max_cpu_buffer_pool_count:
            self._cpu_buffer_pool.setdefault(key, []).append(buffer)
            self._cpu_buffer_pool_count += 1

    def _offload(self, tensor_id: int, tensor: torch.Tensor) -> None:
        buffer, key = self._empty_cpu_like(tensor)
        buffer.copy_(tensor.detach(), non_blocking=buffer.is_pinned())
        self._tracker[tensor_id] = (buffer, tensor.device, tensor.size(), tensor.stride(), key)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += buffer.element_size() * buffer.nelement()

    def _restore(self, tensor_id: int) -> torch.Tensor:
        buffer, device, size, stride, key = self._tracker.pop(tensor_id)
        tensor = torch.empty_strided(size, stride, dtype=buffer.dtype, device=device)
        tensor.copy_(buffer, non_blocking=buffer.is_pinned())
        self._give_back(key, buffer)  # later copies into it are ordered after this one on the stream
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += buffer.element_size() * buffer.nelement()
        return tensor

    def _clear(self) -> None:
        for buffer, *_, key in self._tracker.values():
            self._give_back(key, buffer)
        for table in (self._marks, self._keep_last, self._tracker, self._fwd_stash, self._restored):
            table.clear()

    def reset(self) -> None:
        """Forget every tracked tensor and zero the counters (the buffer pool is kept)."""
        self._clear()
        self.stats = CheckpointActivationOffloadStats()
        self._next_id = 0

    # ---- the context -------------------------------------------------------------------------------------
    def __enter__(self):
        if self in _active():
            raise RuntimeError("CheckpointHiddenStatesOffload is not re-entrant: this manager is already active; "
                               "use a second instance for a nested block")
        try:  # acquire counts its user first, so _leave's release balances it even if installing the patch raised
            _MarkerPatch.acquire()
            self.reset()
            _active().append(self)
            return super().__enter__()
        except BaseException:
            self._leave()
            raise

    def __exit__(self, *exc):
        try:
            self._clear()
        finally:
            self._leave()
            super().__exit__(*exc)

    def _leave(self) -> None:
        if self in _active():
            _active().remove(self)
        _MarkerPatch.release()


class _MarkerPatch:
    """``GradientCheckpointingLayer.__call__`` marking its ``hidden_states`` while any manager is active."""

    lock = threading.Lock()
    users = 0
    wrapper = None
    owned = None  # the class's own __call__ before patching (None: it inherited nn.Module's)

    @classmethod
    def acquire(cls) -> None:
        with cls.lock:
            cls.users += 1
            if cls.wrapper is None:
                cls._install()

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            cls.users = max(cls.users - 1, 0)
            if cls.users == 0 and cls.wrapper is not None:
                cls._uninstall()

    @classmethod
    def _install(cls) -> None:
        try:
            from transformers import GradientCheckpointingLayer
        except ImportError:  # no transformers (or one before 4.52): only explicit mark() calls
            return
        cls.owned = GradientCheckpointingLayer.__dict__.get("__call__")
        call = GradientCheckpointingLayer.__call__

        def marking_call(self, *args, **kwargs):
            managers = _active()
            marked = None
            checkpointed = self.training and torch.is_grad_enabled() and getattr(self, "gradient_checkpointing", False)
            if managers and checkpointed and args and torch.is_tensor(args[0]):
                marked, manager = args[0], managers[-1]
                manager.mark(marked)
            try:
                return call(self, *args, **kwargs)
            finally:
                if marked is not None:  # a mark no pack used must not match a later tensor with a reused id()
                    manager._consume_mark(marked)

        GradientCheckpointingLayer.__call__ = marking_call
        cls.wrapper = marking_call

    @classmethod
    def _uninstall(cls) -> None:
        from transformers import GradientCheckpointingLayer

        if GradientCheckpointingLayer.__dict__.get("__call__") is cls.wrapper:
            if cls.owned is None:
                del GradientCheckpointingLayer.__call__
            else:
                GradientCheckpointingLayer.__call__ = cls.owned
        cls.wrapper = cls.owned = None


def patch_gradient_checkpointing_layer_marker() -> None:
    """Install the ``GradientCheckpointingLayer`` marker for good (entering a manager installs it for its block)."""
    try:
        from transformers import GradientCheckpointingLayer  # noqa: F401
    except ImportError as err:
        raise RuntimeError("patch_gradient_checkpointing_layer_marker needs transformers >= 4.52 "
                           "(GradientCheckpointingLayer): pip install transformers") from err
    with _MarkerPatch.lock:
        if _MarkerPatch.wrapper is None:
            _MarkerPatch._install()
        _MarkerPatch.users += 1  # one user that never leaves


def get_checkpoint_hidden_states_offloading_ctx_manager(
        use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1) -> CheckpointHiddenStatesOffload:  # fmt: skip
    """A new :class:`CheckpointHiddenStatesOffload` with these settings."""
    return CheckpointHiddenStatesOffload(use_pin_memory=use_pin_memory, use_streams=use_streams,
                                         min_offload_bytes=min_offload_bytes, max_fwd_stash_count=max_fwd_stash_count,
                                         max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
                                         keep_last_count=keep_last_count)  # fmt: skip
