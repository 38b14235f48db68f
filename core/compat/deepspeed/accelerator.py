"""``deepspeed.accelerator.get_accelerator()``: CUDA when a GPU is available, else the CPU, with DeepSpeed's
accelerator methods (DeepSpeed 0.19.8 ``DeepSpeedAccelerator``) answered by torch.

On the CPU the methods behave as DeepSpeed's CPU accelerator: ``device_name()`` is ``"cpu"``, memory figures are
the process's resident memory (``psutil`` when installed, else 0), streams and graphs are inert.
"""

from __future__ import annotations

import contextlib
import os

import torch


class TorshAccelerator:
    """One device type (``"cuda"`` or ``"cpu"``) behind DeepSpeed's accelerator interface."""

    def __init__(self, name: str):
        self._name = name
        self._cuda = name == "cuda"
        self._max_rss = 0

    # ---- device ---------------------------------------------------------------------------------
    def device_name(self, device_index=None) -> str:
        if device_index is None or not self._cuda:
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index=None):
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self):
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        if self._cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def use_host_timers(self) -> bool:
        return not self._cuda

    def resolves_data_dependency(self) -> bool:
        return not self._cuda

    def handles_memory_backpressure(self) -> bool:
        return not self._cuda

    def synchronize(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def on_accelerator(self, tensor) -> bool:
        return tensor.device.type == self._name

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._cuda else []

    # ---- random numbers ---------------------------------------------------------------------------
    def random(self):
        return torch.random

    def manual_seed(self, seed):
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index=None):
        if self._cuda:
            return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state, device_index=None):
        if self._cuda:
            return torch.cuda.set_rng_state(new_state, device_index if device_index is not None else "cuda")
        return torch.set_rng_state(new_state)

    def default_generator(self, device_index):
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # ---- streams (inert on the CPU) ------------------------------------------------------------------
    @property
    def Stream(self):  # noqa: N802  (DeepSpeed's name)
        return torch.cuda.Stream if self._cuda else None

    def stream(self, stream):
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index) if self._cuda else None

    @property
    def Event(self):  # noqa: N802
        return torch.cuda.Event if self._cuda else None

    def range_push(self, msg, domain=None, category=None):
        if self._cuda:
            return torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain=None):
        if self._cuda:
            return torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        return torch.cuda._lazy_call(callback) if self._cuda else callback()

    # ---- memory --------------------------------------------------------------------------------------
    def _rss(self) -> int:
        try:
            import psutil
        except ImportError:
            return 0
        rss = psutil.Process().memory_info().rss
        self._max_rss = max(self._max_rss, rss)
        return rss

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else self._rss()

    def max_memory_allocated(self, device_index=None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self._rss()
        return self._max_rss

    def reset_max_memory_allocated(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._max_rss = 0

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self._rss()

    def max_memory_reserved(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else self.max_memory_allocated()

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_max_memory_cached(self, device_index=None) -> None:
        self.reset_max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index=None) -> None:
        self.reset_max_memory_allocated(device_index)

    def memory_stats(self, device_index=None) -> dict:
        return torch.cuda.memory_stats(device_index) if self._cuda else {"allocated_bytes.all.current": self._rss()}

    def total_memory(self, device_index=None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        try:
            import psutil
        except ImportError:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return psutil.virtual_memory().total

    def available_memory(self, device_index=None) -> int:
        if self._cuda:
            free, _ = torch.cuda.mem_get_info(device_index)
            return free
        try:
            import psutil
        except ImportError:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return psutil.virtual_memory().available

    # ---- data types ----------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        if self._cuda:
            return True
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:  # an old torch without the probe: DeepSpeed's CPU accelerator says no
            return False

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list:
        dtypes = [torch.float, torch.bfloat16] if self.is_bf16_supported() else [torch.float]
        return dtypes + ([torch.float16] if self.is_fp16_supported() else [])

    def is_triton_supported(self) -> bool:
        return False

    # ---- pinned memory --------------------------------------------------------------------------------
    def pin_memory(self, tensor, align_bytes=1):
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    def pin_memory_alignment(self) -> int:
        return 1

    # ---- tensors with DeepSpeed's accelerator names ----------------------------------------------------
    def _tensor(self, dtype):
        device = self.current_device_name()
        return lambda *args, **kwargs: torch.tensor(*args, dtype=dtype, device=device, **kwargs)

    @property
    def FloatTensor(self):  # noqa: N802
        return self._tensor(torch.float)

    @property
    def HalfTensor(self):  # noqa: N802
        return self._tensor(torch.half)

    @property
    def BFloat16Tensor(self):  # noqa: N802
        return self._tensor(torch.bfloat16)

    @property
    def LongTensor(self):  # noqa: N802
        return self._tensor(torch.long)

    @property
    def IntTensor(self):  # noqa: N802
        return self._tensor(torch.int)

    @property
    def ByteTensor(self):  # noqa: N802
        return self._tensor(torch.uint8)

    @property
    def BoolTensor(self):  # noqa: N802
        return self._tensor(torch.bool)

    # ---- compilation and ops -----------------------------------------------------------------------
    def get_compile_backend(self) -> str:
        return "inductor"

    def create_op_builder(self, class_name):
        from ._unsupported import NotSupportedByTorsh, message

        raise NotSupportedByTorsh(message(f"accelerator.create_op_builder({class_name!r})", "DeepSpeed's compiled "
                                          "ops are not built; the torch implementations are used"))  # fmt: skip

    get_op_builder = create_op_builder

    def __repr__(self) -> str:
        return f"TorshAccelerator({self._name!r})"


_ACCELERATOR: TorshAccelerator | None = None


def get_accelerator() -> TorshAccelerator:
    """The accelerator of this process: CUDA when ``torch.cuda.is_available()``, else the CPU (``DS_ACCELERATOR``
    may name ``cpu`` or ``cuda`` explicitly, as for DeepSpeed)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        name = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
        if name not in ("cpu", "cuda"):
            raise ValueError(f"DS_ACCELERATOR={name!r}: torsh runs on 'cuda' or 'cpu'; unset it or choose one")
        _ACCELERATOR = TorshAccelerator(name)
    return _ACCELERATOR


def set_accelerator(accel_obj) -> None:
    """Use ``accel_obj`` as the accelerator (DeepSpeed's hook for custom accelerators)."""
    global _ACCELERATOR
    _ACCELERATOR = accel_obj


def is_current_accelerator_supported() -> bool:
    return True


DeepSpeedAccelerator = TorshAccelerator
