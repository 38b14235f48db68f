"""A checkpoint directory as one full state dict, in one process: what ``torsh-migrate merge``, the
``zero_to_fp32.py`` written beside every save and ``deepspeed.utils.zero_to_fp32`` compute.

Two kinds of checkpoint directory, both in DeepSpeed's layout (``save_dir/latest`` naming ``save_dir/<tag>/``):

* torsh's (``engine.save_checkpoint``): ``torch.distributed.checkpoint`` shards from any world size and ZeRO stage.
  They are read in one process by DCP's own loader into full-size tensors, through the safe reader of
  :mod:`torsh.engine.checkpoint.io`, after checking the files against their checksums.
* DeepSpeed's (``mp_rank_00_model_states.pt``, ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, ZeRO 0-3):
  reassembled by :mod:`torsh.engine.checkpoint.from_deepspeed` (what DeepSpeed's ``zero_to_fp32.py`` computes), its
  pickles read with ``weights_only=True`` and no DeepSpeed install.

Nothing in a checkpoint can run code. Only the model's weights and buffers are kept, keyed by the module's names:
the fp32 master weights when the job kept them (bf16/fp16 training). Errors are :class:`~torsh.errors.ConfigError`
naming the directory (``CHECKPOINT``), the tag (``--tag``) or the output (``-o``), as the command line shows them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from torsh.errors import ConfigError, Problem

from .from_deepspeed import _read_checked, is_deepspeed_checkpoint
from .io import CheckpointError, read_dcp_metadata, read_manifest, safe_dcp_classes, safe_torch_load, verify_files
from .save_load import DCP_METADATA, ENGINE_STATES, LATEST

MODEL_PREFIX = "model."


def resolve(root: Path, tag: str | None) -> Path:
    """The tag directory to merge: ``root/<tag>``, ``root/<latest>``, or ``root`` itself when it is one."""
    if not root.is_dir():
        raise ConfigError([Problem("CHECKPOINT", str(root), "no such directory")])
    if tag is not None:
        path = root / tag
        if not _is_checkpoint(path):
            raise ConfigError([Problem("--tag", tag, f"{path} is not a checkpoint; tags in {root}: "
                                       f"{_tags(root) or 'none'}")])  # fmt: skip
        return path
    if _is_checkpoint(root):
        return root
    if (root / LATEST).is_file():
        named = (root / LATEST).read_text(encoding="utf-8", errors="replace").strip()
        path = root / named
        if named and "/" not in named and not named.startswith(".") and _is_checkpoint(path):
            return path
        raise ConfigError([Problem("CHECKPOINT", str(root), f"{root / LATEST} names {named[:80]!r}, which is not a "
                                   f"checkpoint here; pass --tag (tags: {_tags(root) or 'none'})")])  # fmt: skip
    tags = _tags(root)
    hint = f"pass --tag (tags: {tags})" if tags else "it holds no torsh or DeepSpeed checkpoint"
    raise ConfigError([Problem("CHECKPOINT", str(root), f"no 'latest' file and not a checkpoint directory; {hint}")])


def is_deepspeed(path: Path) -> bool:
    """A DeepSpeed checkpoint directory (not one torsh wrote, which may hold DeepSpeed's files beside DCP's)."""
    return is_deepspeed_checkpoint(path) and not (path / DCP_METADATA).is_file()


def _is_checkpoint(path: Path) -> bool:
    return (path / DCP_METADATA).is_file() or is_deepspeed(path)


def _subdirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _tags(root: Path) -> str:
    return ", ".join(p.name for p in _subdirs(root) if _is_checkpoint(p))


def merged_weights(path: Path) -> tuple[dict[str, Any], str, frozenset[str] | None]:
    """The model's full state dict from a torsh or DeepSpeed checkpoint directory ``path``, a note (or ""), and
    the names of its frozen parameters (None: a torsh checkpoint, which does not record them).

    DeepSpeed ZeRO 1-3: the fp32 weights reassembled from every rank's flat partitions (what ``zero_to_fp32.py``
    writes), frozen and tied parameters included, buffers as saved. Stage 0 saves whole weights in the model's
    dtype; with bf16/fp16 its fp32 masters are in the optimizer state, by position in the model's parameter order,
    and are used when they line up with the parameters shape for shape.
    """
    if not is_deepspeed(path):
        return merge_state_dict(path), "", None
    try:
        restored = _read_checked(path, with_optimizer=False)
    except CheckpointError as exc:
        raise ConfigError([Problem("CHECKPOINT", str(path), str(exc))]) from None
    state, note = _stage0_masters(dict(restored.weights), restored.model_states)
    return state, note, frozenset(restored.model_states.get("frozen_param_shapes") or ())


def merge_state_dict(path: Path) -> dict[str, Any]:
    """The model's full (unsharded) state dict from the checkpoint directory ``path``, on the CPU.

    Checks the files against the checkpoint's manifest when it has one, reads the DCP metadata without unpickling
    code, then lets DCP's loader fill full-size tensors from every rank's shards (the same resharding as loading
    at world size 1). Raises :class:`ConfigError` naming the file for anything missing, corrupt or unsafe.
    """
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata


    try:
        files = read_manifest(path)
        if files is not None:
            problems = verify_files(path, files, 0, 1)
            if problems:
                raise CheckpointError(f"checkpoint {path} is corrupt: {'; '.join(problems[:3])}")
        metadata = read_dcp_metadata(path / DCP_METADATA)
        template: dict[str, Any] = {}
        for key, item in metadata.state_dict_metadata.items():
            if key.startswith(MODEL_PREFIX):
                is_tensor = isinstance(item, TensorStorageMetadata)
                template[key] = torch.empty(item.size, dtype=item.properties.dtype) if is_tensor else None
        if not template:
            raise CheckpointError(f"checkpoint {path} has no model entries ('{MODEL_PREFIX}*'); is it a torsh "
                                  "checkpoint?")  # fmt: skip
        _dcp_load(template, path)
        state = {key[len(MODEL_PREFIX):]: value for key, value in template.items()}
        _tie(state, _recorded_ties(path), path)
    except CheckpointError as exc:
        raise ConfigError([Problem("CHECKPOINT", str(path), str(exc))]) from None
    return state


def _recorded_ties(path: Path) -> dict[str, str]:
    """The tied parameters the engine recorded with the checkpoint (``engine_states.pt``: the engine state's
    ``shared_params``, each further name -> the first name, as DeepSpeed's model states hold them); {} when none."""
    file = path / ENGINE_STATES
    saved = safe_torch_load(file) if file.is_file() else None
    engine = saved.get("engine") if isinstance(saved, dict) else None
    shared = engine.get("shared_params") if isinstance(engine, dict) else None
    return shared if isinstance(shared, dict) else {}


def _tie(state: dict[str, Any], shared: dict[str, str], path: Path) -> None:
    """Each recorded alias of a tied weight becomes the very tensor of its source (DCP stores both names' values
    separately), as DeepSpeed's ``zero_to_fp32`` returns it: one tensor under both names."""
    import torch

    for alias, source in shared.items():
        if alias not in state or source not in state:
            continue
        a, b = state[alias], state[source]
        if a.shape != b.shape or a.dtype != b.dtype or not torch.allclose(a, b, rtol=0, atol=0, equal_nan=True):
            raise CheckpointError(f"checkpoint {path} records {alias} as tied to {source}, but their saved values "
                                  "differ")  # fmt: skip
        state[alias] = state[source]


def _stage0_masters(weights: dict[str, Any], model_states: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Stage 0: replace the parameters by DeepSpeed's fp32 masters (``optimizer.fp32_groups``) when present
    (under ZeRO the model states hold no optimizer: the weights are already the fp32 ones)."""
    import torch

    optimizer = model_states.get("optimizer")
    groups = optimizer.get("fp32_groups") if isinstance(optimizer, dict) else None
    masters = [t for group in groups for t in group] if isinstance(groups, (list, tuple)) else []
    if not masters or not all(isinstance(m, torch.Tensor) for m in masters):
        return weights, ""
    buffers = set(model_states.get("buffer_names") or [])
    params = [name for name in weights if name not in buffers]
    if len(masters) != len(params) or any(tuple(m.shape) != tuple(weights[n].shape) for n, m in zip(params, masters)):
        return weights, ("stage-0 checkpoint: its fp32 master weights do not line up with the parameters (another "
                         "parameter order or grouping); wrote the weights in the model's dtype")  # fmt: skip
    return {**weights, **dict(zip(params, masters))}, ""


def _dcp_load(state: dict[str, Any], path: Path) -> None:
    """``dcp.load`` in this one process through the safe reader and planner; failures name the checkpoint."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader_cls, planner_cls = safe_dcp_classes()
    reader = reader_cls(path)
    try:
        with warnings.catch_warnings():  # DCP notes that it runs without a process group: that is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=planner_cls(reader), no_dist=True)
    except CheckpointError:
        raise
    except CheckpointException as exc:  # a BaseException
        raise CheckpointError(f"cannot load checkpoint {path}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - named and re-raised
        raise CheckpointError(f"cannot load checkpoint {path}: {exc}") from None


def write(state: dict[str, Any], output: Path, kind: str) -> None:
    """Write ``state`` atomically (a temporary file renamed into place) as safetensors or with torch.save."""
    import torch

    if kind == "safetensors":
        others = sorted(k for k, v in state.items() if not isinstance(v, torch.Tensor))
        if others:
            raise ConfigError([Problem("-o", str(output), f"entries that are not tensors cannot go into a "
                                       f".safetensors file: {', '.join(others[:5])}; write a .pt file")])  # fmt: skip
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
    os.close(fd)
    try:
        if kind == "safetensors":
            from safetensors.torch import save_file

            save_file(_unshared(state), tmp, metadata={"format": "pt"})
        else:
            torch.save(state, tmp)
        os.replace(tmp, output)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _unshared(state: dict[str, Any]) -> dict[str, Any]:
    """safetensors refuses tensors that share memory (a tied weight under two names): each gets its own copy."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        ptr = value.untyped_storage().data_ptr()
        out[key] = value.clone() if ptr in seen else value.contiguous()
        seen.add(ptr)
    return out
