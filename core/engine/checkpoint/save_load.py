"""Checkpoints in DeepSpeed's directory convention, written with ``torch.distributed.checkpoint`` (DCP).

Layout::

    save_dir/
      latest                     # text: the newest tag (written by rank 0 when save_latest)
      <tag>/                     # e.g. global_step100
        .metadata, *.distcp      # DCP: model and optimizer state, sharded; reshards at another world size
        engine_states.pt         # rank 0: scheduler, loss scaler, engine counters, client state
        mp_rank_00_model_states.pt  # rank 0, where it holds the whole model: DeepSpeed's file (its readers)
        rng_states/rank<r>.pt    # every rank: python / numpy / torch (and CUDA) RNG states
        manifest.json            # SHA-256 and size of every other file, verified at load

Model and optimizer state go through ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict`` (keys are parameter names without DDP/FSDP wrapper prefixes), so a checkpoint written by a
DDP job loads into an FSDP2 job and the reverse, at any world size. ``ZeroRedundancyOptimizer`` is handled here:
each rank writes the optimizer state of the parameters it owns under the same parameter-name keys, so no
consolidation on one rank is needed and a different partition (world size) reads what it owns.

Atomicity: everything is written into ``save_dir/.tmp-<tag>``; after a barrier rank 0 renames it to
``save_dir/<tag>`` and then replaces ``latest`` with ``os.replace``. A process killed at any point leaves
``latest`` pointing at a complete earlier checkpoint. Re-saving an existing tag moves the old directory aside
(``.old-<tag>``) for the instant between the two renames; if a crash hits exactly there, loading reads the
set-aside copy and the next save moves it back. The next save also deletes staging directories of killed saves.

Loading is safe and verified: no file is unpickled with plain pickle (DCP's metadata and non-tensor items go
through :mod:`torsh.engine.checkpoint.io`, every ``.pt`` loads with ``weights_only=True``), every file is checked
against ``manifest.json`` first, and a checkpoint that was asked for (an explicit tag, or the one ``latest`` names)
but is missing, incomplete, corrupt or unsafe raises :class:`CheckpointError` naming the file, on every rank.
Only "there is no checkpoint at all" (no ``latest``, no tag) returns ``(None, None, None)`` with a warning, as
DeepSpeed does. Like DeepSpeed, loading does not restore RNG states unless asked (``load_rng_states=True``).

A directory written by DeepSpeed itself (``mp_rank_00_model_states.pt``, ``*_optim_states.pt``; ZeRO stages
0-3) loads too, at any world size and into any stage: see :mod:`torsh.engine.checkpoint.from_deepspeed`.

Every rank calls :func:`save_checkpoint` and :func:`load_checkpoint` (they are collective). The directory must
be visible to every rank (a shared filesystem), as for DeepSpeed.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .io import (
    MANIFEST,
    CheckpointError,
    hash_share,
    read_dcp_metadata,
    read_manifest,
    safe_dcp_classes,
    safe_torch_load,
    verify_files,
    write_manifest,
)
from .state import (
    _barrier,
    _broadcast,
    _dist,
    _gather,
    _is_zero,
    _on_every_rank,
    _param_names,
    _rank,
    _torch_optimizer,
    _world_size,
    _zero_load,
    _zero_load_template,
    _zero_state_dict,
)
from .from_deepspeed import is_deepspeed_checkpoint
from .moe_experts import rename_state
from ..zero.whole_params import sharded_state

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "after_save", "load_checkpoint", "save_checkpoint"]

LATEST = "latest"
ENGINE_STATES = "engine_states.pt"
RNG_DIR = "rng_states"
DCP_METADATA = ".metadata"
FORMAT_VERSION = 2  # 2: manifest.json with checksums
MAX_TAG_LENGTH = 200


# --------------------------------------------------------------------------------------------------
# small file helpers


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _torch_bytes(obj: Any, what: str) -> bytes:
    """``obj`` serialised, checked to load back with ``weights_only=True`` (checkpoints are loaded safely)."""
    import torch

    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised with the offending part named
        raise TypeError(
            f"the {what} cannot be stored in a checkpoint that loads with weights_only=True: keep it to tensors, "
            f"numbers, strings, None and lists/tuples/dicts of those ({exc})"
        ) from None
    return buffer.getvalue()


def _tag_problem(tag: str) -> str | None:
    """Why ``tag`` cannot name a checkpoint directory, or None."""
    for broken, why in _TAG_RULES:
        if broken(tag):
            return why
    return None


def _not_a_plain_name(tag: str) -> bool:
    return not tag or tag in (".", "..") or any(sep in tag for sep in ("/", "\\", os.sep)) or tag.startswith(".")


def _has_control_or_padding(tag: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in tag) or tag != tag.strip()


_TAG_RULES = (
    (lambda tag: tag == LATEST, f"'{LATEST}' is the name of the file that points at the newest checkpoint"),
    (_not_a_plain_name, "it must be a plain directory name (no '/' or '\\', not starting with '.')"),
    (_has_control_or_padding, "it must not contain control characters or leading/trailing whitespace"),
    (lambda tag: len(tag.encode("utf-8", "surrogatepass")) > MAX_TAG_LENGTH,
     f"it must be at most {MAX_TAG_LENGTH} bytes long"),
)


def _check_tag(tag: Any) -> str:
    """``tag`` as a string, or ValueError saying why it cannot name a checkpoint directory."""
    tag = str(tag)
    problem = _tag_problem(tag)
    if problem:
        raise ValueError(f"checkpoint tag {tag!r} is not allowed: {problem}; pass another tag (or tag=None for "
                         f"global_step<N>)")  # fmt: skip
    return tag


class TagMismatchError(AssertionError, ValueError):
    """Ranks saved under different tags with ``checkpoint.tag_validation: FAIL`` (DeepSpeed: AssertionError)."""


def _check_same_tag(tag: str, mode: str = "fail") -> str:
    """The tag every rank saves under (DeepSpeed's tag validation, ``mode`` warn/ignore/fail). Tags that differ
    across ranks raise on all ranks together under ``fail``; under ``warn`` (logged) and ``ignore`` the one sharded
    checkpoint is saved under rank 0's tag (DeepSpeed writes each rank's files under its own tag)."""
    dist = _dist()
    if not dist:
        return tag
    tags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(tags, tag)
    if len(set(tags)) == 1:
        return tag
    if str(mode).lower() == "fail":
        raise TagMismatchError(f"ranks save under different checkpoint tags {tags}: pass the same tag on every "
                               "rank (checkpoint.tag_validation is FAIL)")  # fmt: skip
    if str(mode).lower() == "warn" and _rank() == 0:
        log.warning("ranks save under different checkpoint tags %s: the checkpoint is saved under rank 0's tag "
                    "%r (checkpoint.tag_validation WARN; IGNORE says nothing, FAIL raises)", tags, tags[0])  # fmt: skip
    return tags[0]


def _is_complete(path: Path) -> bool:
    return (path / DCP_METADATA).is_file() and (path / ENGINE_STATES).is_file()


# --------------------------------------------------------------------------------------------------
# RNG


def _rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        # numpy arrays do not load with weights_only=True; a tensor does.
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            np = None
        if np is not None:
            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------------------------------
# save

_AFTER_SAVE: list[Callable[[str, str], None]] = []


def after_save(callback: Callable[[str, str], None], *, remove: bool = False) -> None:
    """Call ``callback(directory, tag)`` on every rank after each checkpoint is complete and published (``torsh run
    --on ray`` reports it to Ray Train this way); ``remove``: stop calling it."""
    if remove:
        if callback in _AFTER_SAVE:
            _AFTER_SAVE.remove(callback)
    elif callback not in _AFTER_SAVE:
        _AFTER_SAVE.append(callback)



def save_checkpoint(save_dir: str | os.PathLike, tag: Any, *, model: Any, optimizer: Any, lr_scheduler: Any,
                    loss_scaler: Any, engine_state: dict, client_state: dict, save_latest: bool,
                    frozen: frozenset[str] = frozenset(), tag_validation: str = "fail",
                    model_states: dict | None = None, key_map: dict[str, str] | None = None,
                    rank_files: dict[str, Any] | None = None) -> bool:  # fmt: skip
    """Write a checkpoint to ``save_dir/<tag>/`` atomically; collective (every rank calls it). Returns True.

    ``tag`` None means ``global_step{engine_state['global_steps']}`` (DeepSpeed's default). ``client_state`` is
    returned by :func:`load_checkpoint`; it must hold tensors, numbers, strings and containers of those.
    With ``save_latest`` rank 0 points ``save_dir/latest`` at the tag once the checkpoint is complete. The
    parameters named in ``frozen`` are left out of the model state (DeepSpeed's ``exclude_frozen_parameters``:
    a LoRA job's checkpoints hold its adapters, not the base model; load them with ``load_module_strict=False``).
    ``model_states`` (rank 0's; None elsewhere or for none): DeepSpeed's model-states file, written beside the DCP
    files and covered by the manifest (:mod:`torsh.engine.checkpoint.ds_model_states`). ``key_map``: model and
    optimizer-state keys saved under another name (a rank's MoE experts under their global names,
    :mod:`torsh.engine.checkpoint.moe_experts`); ``rank_files``: this rank's further files (name -> object to
    ``torch.save``), written beside the others (DeepSpeed's expert files).
    """
    import torch.distributed.checkpoint as dcp

    if tag is None:
        tag = f"global_step{engine_state.get('global_steps', 0)}"
    tag = _check_tag(tag)
    # Serialise the small states first, on every rank: a client_state that cannot be stored then fails on all
    # ranks alike before any collective, instead of on rank 0 alone while the others wait at a barrier.
    engine_bytes = _engine_bytes(lr_scheduler, loss_scaler, engine_state, client_state)
    rng_bytes = _torch_bytes(_rng_state(), "RNG state")
    tag = _check_same_tag(tag, tag_validation)
    root = Path(save_dir)
    final, staging = root / tag, root / f".tmp-{tag}"
    rank = _rank()

    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale(root)
        staging.mkdir()
    _barrier()

    # 1. model and optimizer (sharded; every rank writes its part, rank 0 writes .metadata last)
    with sharded_state(model), _quiet_without_dist():  # DCP writes each rank's shards
        state = rename_state(_state_to_save(model, _torch_optimizer(optimizer), frozen), key_map)
        dcp.save(state, checkpoint_id=staging)

    # 2. small states: rank 0 writes the shared ones, every rank its RNG (and its files)
    _write_small_states(staging, rank, engine_bytes, rng_bytes, model_states, rank_files)
    _barrier()

    # 3. checksums: every rank hashes a share of the files, rank 0 writes the manifest into the staging dir
    shares = _gather(hash_share(staging, rank, _world_size()))
    if rank == 0:
        _write_bytes(staging / MANIFEST, write_manifest(staging, shares))

    # 4. publish: rename the complete directory into place, then move `latest`
    if rank == 0:
        _publish(root, staging, final, tag if save_latest else None)
        from .recovery_script import write_recovery_script

        write_recovery_script(root)  # save_dir/zero_to_fp32.py, as DeepSpeed writes it
    _barrier()
    for callback in list(_AFTER_SAVE):
        callback(str(final), tag)
    return True


def _write_small_states(staging: Path, rank: int, engine_bytes: bytes, rng_bytes: bytes, model_states: dict | None,
                        rank_files: dict[str, Any] | None) -> None:  # fmt: skip
    if rank == 0:
        _write_bytes(staging / ENGINE_STATES, engine_bytes)
        if model_states is not None:
            _write_model_states(staging, model_states)
    for name, obj in (rank_files or {}).items():
        _write_model_states(staging, obj, name)
    (staging / RNG_DIR).mkdir(exist_ok=True)
    _write_bytes(staging / RNG_DIR / f"rank{rank}.pt", rng_bytes)


def _write_model_states(staging: Path, states: dict, name: str | None = None) -> None:
    """DeepSpeed's model-states file (rank 0; or the file ``name``), written straight to disk (it holds the whole
    model)."""
    import torch

    from .ds_model_states import MODEL_STATES

    with open(staging / (name or MODEL_STATES), "wb") as f:
        torch.save(states, f)
        f.flush()
        os.fsync(f.fileno())


def _engine_bytes(lr_scheduler: Any, loss_scaler: Any, engine_state: dict, client_state: dict) -> bytes:
    return _torch_bytes({
        "format": FORMAT_VERSION,
        "world_size": _world_size(),
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "loss_scaler": loss_scaler.state_dict() if loss_scaler is not None else None,
        "engine": dict(engine_state),
        "client_state": dict(client_state or {}),
    }, "client_state / engine state")  # fmt: skip


def _state_to_save(model: Any, optimizer: Any, frozen: frozenset[str]) -> dict[str, Any]:
    """The model's (without ``frozen``) and the optimizer's state by parameter name; a ZeroRedundancyOptimizer
    gives the state of the parameters this rank owns."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    elif _is_zero(optimizer):
        state = {"model": get_model_state_dict(model), "optim": _zero_state_dict(optimizer, _param_names(model))}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    state["model"] = {k: v for k, v in state["model"].items() if k not in frozen}
    return state


def _remove_stale(root: Path) -> None:
    """Rank 0: tidy what killed saves left behind: staging dirs are deleted; a set-aside copy is deleted when its
    replacement is complete, and moved back into place when the replacement never arrived."""
    for entry in list(root.iterdir()):
        if entry.name.startswith(".tmp-"):
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.startswith(".old-"):
            original = root / entry.name[len(".old-"):]
            if _is_complete(original):
                shutil.rmtree(entry, ignore_errors=True)
            elif not original.exists() and _is_complete(entry):
                os.replace(entry, original)


def _publish(root: Path, staging: Path, final: Path, latest_tag: str | None) -> None:
    """Rank 0: make the staged checkpoint visible, each step atomic."""
    _fsync_dir(staging)
    aside = root / f".old-{final.name}"
    if final.exists():  # re-saving a tag: keep the old copy until the new one is in place
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(staging, final)
    _fsync_dir(root)
    shutil.rmtree(aside, ignore_errors=True)
    if latest_tag is not None:
        tmp = root / f".{LATEST}.tmp"
        _write_bytes(tmp, latest_tag.encode())
        os.replace(tmp, root / LATEST)
        _fsync_dir(root)


# --------------------------------------------------------------------------------------------------
# load


def _read_latest(latest: Path) -> str:
    """The tag ``latest`` names; CheckpointError when the file is not a short text holding a valid tag."""
    if not latest.is_file():  # a directory, a FIFO (which would block), a device
        raise CheckpointError(f"the checkpoint pointer {latest} is not a regular file; it must hold the tag of the "
                              f"newest checkpoint (or pass a tag)")  # fmt: skip
    try:
        with open(latest, "rb") as f:
            raw = f.read(4 * MAX_TAG_LENGTH + 1)
        text = raw.decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read the checkpoint pointer {latest}: {exc}; it must hold the tag of the "
                              f"newest checkpoint (or pass a tag)") from None  # fmt: skip
    problem = _tag_problem(text) if len(raw) <= 4 * MAX_TAG_LENGTH else "it is too long"
    if problem:
        raise CheckpointError(f"the checkpoint pointer {latest} holds {text[:80]!r}, which is not a checkpoint tag "
                              f"({problem}); write the newest tag into it or pass a tag")  # fmt: skip
    return text


def _missing_files(path: Path) -> list[str]:
    return [name for name in (DCP_METADATA, ENGINE_STATES) if not (path / name).is_file()]


def _resolve(load_dir: Path, tag: str | None) -> Path | None:
    """The checkpoint directory to load; None (with a warning) only when there is no checkpoint at all, i.e. no
    tag was given and ``latest`` does not exist. A checkpoint that is named but missing or incomplete raises."""
    if tag is None:
        latest = load_dir / LATEST
        if not latest.exists():
            log.warning("no checkpoint to load: %s does not exist (pass a tag to load a specific one)", latest)
            return None
        tag, named_by = _read_latest(latest), f"named by {latest}"
    else:
        named_by = "requested"
    path = load_dir / tag
    if _is_complete(path) or is_deepspeed_checkpoint(path):
        return path
    aside = load_dir / f".old-{tag}"
    if not path.exists() and _is_complete(aside):  # a re-save of this tag was killed between its two renames
        log.warning("checkpoint %s was being replaced when a save stopped; loading the previous copy %s", path, aside)
        return aside
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} ({named_by}) does not exist")
    missing = ", ".join(str(path / name) for name in _missing_files(path))
    raise CheckpointError(f"checkpoint {path} ({named_by}) is incomplete: {missing} missing")


def _resolve_on_rank0(load_dir: Path, tag: Any) -> Path | None:
    """:func:`_resolve` on rank 0 (one view of the filesystem), its result or its error on every rank; a tag that
    cannot name a checkpoint is a ValueError on every rank."""
    tag = None if tag is None else _check_tag(tag)
    if _rank() == 0:
        try:
            outcome: tuple[str, Any] = ("ok", _resolve(load_dir, tag))
        except CheckpointError as exc:
            outcome = ("error", str(exc))
    else:
        outcome = ("ok", None)
    kind, value = _broadcast(outcome)
    if kind == "error":
        raise CheckpointError(value)
    return value


def _verify(path: Path) -> dict[str, Any] | None:
    """Check every file of ``path`` against its manifest (each rank a share); the manifest, or None if the
    checkpoint predates checksums."""
    files = _on_every_rank(read_manifest, path)
    if files is None:
        return None
    problems = [p for share in _gather(verify_files(path, files, _rank(), _world_size())) for p in share]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"checkpoint {path} is corrupt: {'; '.join(problems[:3])}{more}")
    return files


def _read_engine_states(path: Path) -> dict[str, Any]:
    saved = safe_torch_load(path / ENGINE_STATES)
    needed = {"world_size", "lr_scheduler", "loss_scaler", "engine", "client_state"}
    if not isinstance(saved, dict) or not needed <= set(saved):
        raise CheckpointError(f"checkpoint file {path / ENGINE_STATES} does not hold torsh engine states")
    return saved


def load_checkpoint(load_dir: str | os.PathLike, tag: Any, *, model: Any, optimizer: Any, lr_scheduler: Any,
                    loss_scaler: Any, load_module_strict: bool = True, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                    load_rng_states: bool = False, key_map: dict[str, str] | None = None,
                    experts: Any = None, model_parallel: tuple[int, int] = (0, 1)
                    ) -> tuple[str | None, dict | None, dict | None]:  # fmt: skip
    """Load a checkpoint written by :func:`save_checkpoint` (at any world size); collective.

    ``tag`` None reads ``load_dir/latest``. Returns ``(path, client_state, engine_state)``; ``(None, None, None)``
    with a warning when there is no checkpoint at all (no ``latest`` and no tag), as DeepSpeed returns
    ``(None, None)``. A checkpoint that was asked for but is missing, incomplete, corrupt (checksum mismatch) or
    holds anything but plain data raises :class:`CheckpointError` naming the file, on every rank.
    ``load_module_only`` loads the weights only (no optimizer, scheduler, loss scaler; ``engine_state`` is None
    so the engine keeps its counters). The loss scaler is restored together with the optimizer states. RNG
    states are restored only with ``load_rng_states=True`` (DeepSpeed never restores them). ``key_map``: as for
    :func:`save_checkpoint`; ``experts``: the model's MoE layers
    (:class:`~torsh.engine.checkpoint.moe_experts.ExpertCheckpoint`), for a DeepSpeed checkpoint's expert files;
    ``model_parallel``: ``(rank, size)`` of this rank's model-parallel group, for a DeepSpeed checkpoint's
    ``mp_rank_XX`` files.
    """
    path = _resolve_on_rank0(Path(load_dir), tag)
    if path is None:
        return None, None, None
    if is_deepspeed_checkpoint(path) and not (path / ENGINE_STATES).exists():
        return _load_deepspeed(path, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                               loss_scaler=loss_scaler, strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states,
                               load_module_only=load_module_only, experts=experts,
                               model_parallel=model_parallel)  # fmt: skip
    with_optimizer = load_optimizer_states and not load_module_only and optimizer is not None
    saved = _load_torsh(path, model, optimizer if with_optimizer else None, strict=load_module_strict,
                        key_map=key_map)  # fmt: skip
    if not load_module_only:
        _load_small_states(saved, lr_scheduler, loss_scaler, scheduler=load_lr_scheduler_states,
                           scaler=with_optimizer)  # fmt: skip
    if load_rng_states:
        _on_every_rank(_load_rng, path, saved["world_size"])
    _barrier()
    return str(path), saved["client_state"], None if load_module_only else saved["engine"]


def _load_torsh(path: Path, model: Any, optimizer: Any, *, strict: bool,
                key_map: dict[str, str] | None) -> dict[str, Any]:  # fmt: skip
    """Model (and optimizer, unless None) state of a torsh checkpoint; its engine states."""
    saved = _verified_engine_states(path)
    with sharded_state(model), _quiet_without_dist():
        _load_model_and_optimizer(path, model, _torch_optimizer(optimizer), strict=strict, key_map=key_map)
    return saved


def _verified_engine_states(path: Path) -> dict[str, Any]:
    """The engine states of a torsh checkpoint whose files match its manifest (one written before checksums
    loads with a warning)."""
    files = _verify(path)
    saved = _on_every_rank(_read_engine_states, path)
    if files is None:
        if saved.get("format", 1) >= 2:
            raise CheckpointError(f"checkpoint {path} has no {path / MANIFEST} (it was removed); it cannot be "
                                  f"verified")  # fmt: skip
        log.warning("checkpoint %s predates checksums; its files are not verified", path)
    return saved


def _load_small_states(saved: dict[str, Any], lr_scheduler: Any, loss_scaler: Any, *, scheduler: bool,
                       scaler: bool) -> None:  # fmt: skip
    """The scheduler's state (if ``scheduler``) and the loss scaler's (if ``scaler``: with the optimizer's)."""
    if scheduler and lr_scheduler is not None and saved["lr_scheduler"] is not None:
        lr_scheduler.load_state_dict(saved["lr_scheduler"])
    if scaler and loss_scaler is not None and saved["loss_scaler"] is not None:
        loss_scaler.load_state_dict(saved["loss_scaler"])


def _load_deepspeed(path: Path, **kwargs: Any) -> tuple[str, dict, dict | None]:
    """A checkpoint directory written by DeepSpeed (see :mod:`torsh.engine.checkpoint.from_deepspeed`)."""
    from .from_deepspeed import load_deepspeed_checkpoint

    log.info("loading DeepSpeed checkpoint %s", path)
    with sharded_state(kwargs["model"]), _quiet_without_dist():
        result = load_deepspeed_checkpoint(path, **kwargs)
    _barrier()
    return result


def _dcp_load(state: dict[str, Any], path: Path, *, allow_partial_load: bool) -> None:
    """``dcp.load`` through the safe reader and planner; every failure is a CheckpointError naming the files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader_cls, planner_cls = safe_dcp_classes()
    reader = reader_cls(path)
    planner = planner_cls(reader, allow_partial_load=allow_partial_load)
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except CheckpointError:
        raise
    except CheckpointException as exc:  # a BaseException: it would pass `except Exception` in user code
        raise CheckpointError(_failures_text(path, exc) + _partial_hint(exc)) from None
    except Exception as exc:  # noqa: BLE001 - named and re-raised
        raise CheckpointError(f"cannot load checkpoint {path}: {exc}{_partial_hint(exc)}") from None


def _partial_hint(exc: BaseException) -> str:
    """What to do when the model's keys are missing: a checkpoint saved with ``exclude_frozen_parameters``."""
    if "Missing key in checkpoint state_dict: model." not in str(exc) and not any(
            "Missing key in checkpoint state_dict: model." in str(f) for f in getattr(exc, "failures", {}).values()):
        return ""
    return (" (a checkpoint saved with exclude_frozen_parameters=True holds only the trainable parameters: load it "
            "with load_module_strict=False, as the Hugging Face Trainer does for PEFT models)")


def _failures_text(path: Path, exc: Any) -> str:
    """One message from DCP's per-rank failures (each a wrapped exception)."""
    messages: list[str] = []
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        text = str(inner) if isinstance(inner, CheckpointError) else f"{type(inner).__name__}: {inner}"
        if text not in messages:
            messages.append(text)
    return f"cannot load checkpoint {path}: {'; '.join(messages) or exc}"


def _load_model_and_optimizer(path: Path, model: Any, optimizer: Any, *, strict: bool,
                              key_map: dict[str, str] | None = None) -> None:  # fmt: skip
    """Read model (and optimizer, unless None) state from the DCP files, resharding to the current layout."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    # Read the metadata once up front: a bad file then fails here with one clear message on every rank.
    metadata = _on_every_rank(read_dcp_metadata, path / DCP_METADATA)
    options = StateDictOptions(strict=strict)
    # Non-strict loading tolerates parameters the checkpoint lacks (DCP refuses them otherwise).
    partial = not strict
    key_map = key_map or {}
    back = {v: k for k, v in key_map.items()}
    if key_map and _is_zero(optimizer):
        raise NotImplementedError("MoE experts saved under their global names with a ZeroRedundancyOptimizer")
    if optimizer is None:
        state = rename_state({"model": get_model_state_dict(model)}, key_map)
        _dcp_load(state, path, allow_partial_load=partial)
        set_model_state_dict(model, rename_state(state, back)["model"], options=options)
    elif _is_zero(optimizer):
        names = _param_names(model)
        state = {"model": get_model_state_dict(model), "optim": _zero_load_template(optimizer, names, metadata)}
        _dcp_load(state, path, allow_partial_load=partial)
        set_model_state_dict(model, state["model"], options=options)
        _zero_load(optimizer, names, state["optim"])
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = rename_state({"model": model_sd, "optim": optim_sd}, key_map)
        _dcp_load(state, path, allow_partial_load=partial)
        state = rename_state(state, back)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)  # fmt: skip


@contextlib.contextmanager
def _quiet_without_dist():
    """DCP warns that it assumes a single process when torch.distributed is not initialised; that is intended."""
    with warnings.catch_warnings():
        if _dist() is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _load_rng(path: Path, saved_world_size: int) -> None:
    rng_file = path / RNG_DIR / f"rank{_rank()}.pt"
    if rng_file.is_file():
        state = safe_torch_load(rng_file)
        try:
            _set_rng_state(state)
        except Exception as exc:  # noqa: BLE001 - a well-formed file holding something else
            raise CheckpointError(f"checkpoint file {rng_file} does not hold RNG states: {exc}") from None
    else:
        log.warning("checkpoint %s was written by %d ranks and has no RNG state for rank %d; RNG not restored",
                    path, saved_world_size, _rank())  # fmt: skip
