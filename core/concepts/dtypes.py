"""Floating-point training dtypes and every spelling the dialects use for them."""

from __future__ import annotations

from typing import Any

#: The core dtypes, full precision first.
CORE = ("fp32", "bf16", "fp16")

#: Spelling (lower case) -> core dtype. torch's names come first for each dtype: writers of torch-family dialects
#: emit the first spelling of each (``TORCH``).
SPELLINGS = {
    "torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16",
    "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "torch.float": "fp32", "torch.half": "fp16",
    "float": "fp32", "half": "fp16", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16",
}  # fmt: skip

#: Core dtype -> its torch name, as a torch-family dialect writes it.
TORCH = {core: next(name for name, c in SPELLINGS.items() if c == core) for core in CORE}


def normalise(value: Any) -> Any:
    """The core dtype a spelling names (any case, surrounding space ignored); anything else unchanged."""
    if isinstance(value, str):
        return SPELLINGS.get(value.strip().lower(), value)
    return value


def core_dtype(value: Any) -> str | None:
    """The core dtype a spelling names, or None when it names none."""
    return SPELLINGS.get(value.strip().lower()) if isinstance(value, str) else None
