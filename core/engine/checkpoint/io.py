"""Reading checkpoint files safely and verifiably.

Safety: nothing read from a checkpoint can run code. ``torch.distributed.checkpoint``'s own reader unpickles the
``.metadata`` file and every non-tensor ("bytes") item with plain :mod:`pickle`; :func:`safe_dcp_classes` (a
reader and a load planner) replaces exactly those two steps: the metadata goes through an unpickler that only
constructs the classes DCP metadata is made of (its dataclasses, ``torch.Size``, dtypes, layouts, paths), and
bytes items load with ``torch.load(weights_only=True)``. Tensor data is already read with ``weights_only=True`` by
torch. Anything else is refused with a :class:`CheckpointError` naming the file.

Integrity: :func:`write_manifest` records the SHA-256 and size of every file of a checkpoint in ``manifest.json``
(written inside the staging directory, so it is published atomically with the files it describes);
:func:`verify_files` checks them at load.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import io
import json
import pickle
from pathlib import Path
from typing import Any

__all__ = ["CheckpointError", "read_dcp_metadata", "safe_dcp_classes", "safe_torch_load", "verify_files",
           "write_manifest"]

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1


class CheckpointError(Exception):
    """A checkpoint that was asked for cannot be loaded: missing, incomplete, corrupt or holding something that
    is not plain data. The message names the file and what to do."""


# --------------------------------------------------------------------------------------------------
# DCP metadata: a restricted unpickler


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """The (module, name) pairs a ``.metadata`` pickle written by DCP legitimately refers to."""
    import pathlib

    import torch
    import torch.serialization
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {("torch", "Size"): torch.Size}
    for name in ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata",
                 "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING"):  # fmt: skip
        if hasattr(metadata, name):
            allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    if hasattr(torch.serialization, "_get_layout"):  # layouts pickle as a call with the layout's name
        allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath):
        allowed[("pathlib", cls.__name__)] = cls  # StorageMeta.checkpoint_id: the path written to
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and refuses every other global, so a planted payload cannot run."""

    def __init__(self, file: Any, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is not None:
            return found
        if module == "torch":
            import torch

            candidate = getattr(torch, name, None)
            if isinstance(candidate, torch.dtype):
                return candidate
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: not part of checkpoint metadata")


def read_dcp_metadata(path: Path) -> Any:
    """The DCP ``Metadata`` in ``path`` (a ``.metadata`` file), read without running code from the file."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint metadata {path}: {exc.strerror or exc}") from None
    try:
        result = _MetadataUnpickler(io.BytesIO(data), _metadata_globals()).load()
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is a corrupt or unsafe file
        raise CheckpointError(f"checkpoint metadata {path} is corrupt or unsafe: {exc}") from None
    if not isinstance(result, Metadata):
        raise CheckpointError(f"checkpoint metadata {path} holds a {type(result).__name__}, not DCP metadata")
    return result


def safe_torch_load(path: Path | io.BytesIO, *, name: str | None = None, **kwargs: Any) -> Any:
    """``torch.load(weights_only=True, map_location='cpu')``; a file that does not load that way (corrupt, or
    holding objects other than tensors and plain data) is a :class:`CheckpointError` naming it."""
    import torch

    try:
        return torch.load(path, weights_only=True, map_location="cpu", **kwargs)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {name or path} is missing") from None
    except Exception as exc:  # noqa: BLE001 - the unpickler's refusal, a truncated zip, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint file {name or path} is corrupt or holds objects that are not plain data "
                              f"(it is loaded with weights_only=True): {first}") from None  # fmt: skip


@functools.cache
def safe_dcp_classes() -> tuple[type, type]:
    """``(SafeFileSystemReader, SafeLoadPlanner)``: DCP's file-system reader and default load planner with the
    two unsafe steps replaced (built on first use, so importing this module does not import torch)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        """DCP's reader with the metadata read by :func:`read_dcp_metadata` and read errors naming the file."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def file_of(self, storage_index: Any) -> str:
            """The path of the file holding an item, for error messages."""
            info = self.storage_data.get(storage_index)
            return str(Path(str(self.path)) / info.relative_path) if info is not None else str(self.path)

        def read_data(self, plan: Any, planner: Any) -> Any:
            try:
                return super().read_data(plan, planner)
            except CheckpointError:
                raise
            except Exception as exc:  # noqa: BLE001 - a short read, a tensor that is not a tensor, ...
                files = sorted({self.file_of(item.storage_index) for item in plan.items})
                raise CheckpointError(f"cannot read checkpoint data from {', '.join(files)}: {exc}") from None

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's default load planner, except that non-tensor items load with ``weights_only=True``."""

        def __init__(self, reader: SafeFileSystemReader, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._reader = reader

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element

            name = f"{self._reader.file_of(read_item.storage_index)} (item {read_item.dest_index.fqn})"
            obj = safe_torch_load(value, name=name)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeFileSystemReader, SafeLoadPlanner


# --------------------------------------------------------------------------------------------------
# checksums


def _files(root: Path) -> list[str]:
    """Every regular file under ``root`` except the manifest, as sorted relative POSIX paths."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _digest(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"sha256": digest, "size": path.stat().st_size}


def hash_share(root: Path, rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """Checksums of this rank's share of the files under ``root`` (every rank hashes a different share)."""
    return {name: _digest(root / name) for i, name in enumerate(_files(root)) if i % world_size == rank}


def write_manifest(root: Path, shares: list[dict[str, dict[str, Any]]]) -> bytes:
    """The manifest for ``root`` from every rank's :func:`hash_share`, as bytes to write to ``root/manifest.json``."""
    files: dict[str, Any] = {}
    for share in shares:
        files.update(share)
    manifest = {"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": dict(sorted(files.items()))}
    return json.dumps(manifest, indent=1).encode()


def read_manifest(root: Path) -> dict[str, dict[str, Any]] | None:
    """The file table of ``root/manifest.json``; None when the checkpoint has none (written before checksums)."""
    path = root / MANIFEST
    if not path.exists():
        return None
    try:
        return _manifest_files(json.loads(path.read_bytes()))
    except Exception as exc:  # noqa: BLE001 - any unreadable manifest is a corrupt checkpoint
        raise CheckpointError(f"checkpoint manifest {path} is corrupt ({exc}); the checkpoint cannot be verified")


def _manifest_files(manifest: Any) -> dict[str, dict[str, Any]]:
    """The file table of a parsed manifest, each entry a relative path inside the checkpoint with a sha256 and a
    size; anything else raises."""
    files = manifest["files"]
    if manifest.get("algorithm") != "sha256" or not isinstance(files, dict):
        raise ValueError("unknown layout")
    for name, entry in files.items():
        if not _is_inside(name) or not isinstance(entry.get("sha256"), str) or not isinstance(entry.get("size"), int):
            raise ValueError(f"bad entry {name!r}")
    return files


def _is_inside(name: Any) -> bool:
    """A relative path that stays inside the checkpoint directory."""
    return isinstance(name, str) and not name.startswith("/") and ".." not in Path(name).parts


def verify_files(root: Path, files: dict[str, dict[str, Any]], rank: int, world_size: int) -> list[str]:
    """Check this rank's share of ``files`` (from :func:`read_manifest`); the problems found, each naming a file."""
    problems = []
    for i, name in enumerate(sorted(files)):
        if i % world_size != rank:
            continue
        path, expected = root / name, files[name]
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        actual = _digest(path)
        if actual["size"] != expected["size"]:
            problems.append(f"{path} has {actual['size']} bytes, the manifest says {expected['size']}")
        elif actual["sha256"] != expected["sha256"]:
            problems.append(f"{path} does not match its checksum in {root / MANIFEST} (the file is corrupt)")
    return problems
