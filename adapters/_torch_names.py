"""Spellings shared by the PyTorch-family dialects (fsdp, fairscale, accelerate): enums, dtypes, booleans, meshes.

Configs of these frameworks are Python call arguments, so the same value reaches us spelt many ways:
``"FULL_SHARD"``, ``"ShardingStrategy.FULL_SHARD"``, ``1``, ``"full_shard"`` (Accelerate); ``"bfloat16"``,
``"torch.bfloat16"``. And transcriptions of real code carry expressions the script evaluates at run time
(``"cfg.fsdp.sharding_strategy"``): those are reported, never guessed.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import Any

from torsh.concepts import dtypes, sharding
from torsh.deferred import AUTO, is_deferred
from torsh.translate import Fidelity, FieldMap, Note, ReadContext, Status, WriteContext, delete_path

#: FSDP1's strategies, their other spellings and their core layouts: ``torsh.concepts.sharding``.
SHARDING_STRATEGIES, STRATEGY_ALIASES = sharding.FSDP1_STRATEGIES, sharding.FSDP1_ALIASES
NO_SHARD_REASON = ("NO_SHARD (deprecated in FSDP1) replicates parameters and all-reduces gradients like DDP; torsh "
                   "runs DDP: same numerics, different bucketing")  # fmt: skip

#: torch dtype spellings -> core dtype; the first spelling of each is what writers emit.
DTYPES = dtypes.SPELLINGS

_TRUE = {"y", "yes", "t", "true", "on", "1"}
_FALSE = {"n", "no", "f", "false", "off", "0"}
_ENUM_MEMBER = re.compile(r"_?[A-Z][A-Z0-9_]*")


def enum_name(value: Any, members: tuple[str, ...], enum: str, ctx: ReadContext, path: str,
              aliases: Mapping[str, str] | None = None) -> str | None:  # fmt: skip
    """The member named by ``value`` (``"X"``, ``"Enum.X"``, any case, or its 1-based ``auto()`` integer).

    An unknown spelling is a problem on ``ctx`` with a did-you-mean; returns None then.
    """
    aliases = aliases or {}
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= len(members):
        return members[value - 1]
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit() and 1 <= int(text) <= len(members):
            return members[int(text) - 1]
        if text.startswith(enum + "."):
            text = text[len(enum) + 1:]
        upper = text.upper()
        upper = aliases.get(upper, upper)
        for member in members:
            if member == upper or member.lstrip("_") == upper:
                return member
    from torsh.errors import did_you_mean

    ctx.problem(path, value, f"unknown {enum}; expected one of {', '.join(members)} (or {enum}.NAME, or 1-"
                f"{len(members)})", did_you_mean(str(value).split(".")[-1].upper(), members))  # fmt: skip
    return None


def to_bool(value: Any, ctx: ReadContext, path: str) -> bool | None:
    """A boolean from YAML/JSON or Accelerate's ``str_to_bool`` spellings; anything else is a problem."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    ctx.problem(path, value, "expected true or false")
    return None


def dtype(value: Any, ctx: ReadContext, path: str) -> str | None:
    """The core dtype of a torch dtype spelling; None (no problem) for None; unknown spellings are problems."""
    if value is None:
        return None
    core = DTYPES.get(str(value).strip().lower()) if isinstance(value, str) else None
    if core is None:
        ctx.problem(path, value, "unsupported dtype; expected torch.float32, torch.bfloat16 or torch.float16")
    return core


def is_expression(value: Any, known: frozenset[str] = frozenset()) -> bool:
    """True for a Python expression the training script evaluates (``"args.fsdp_cpu_offload"``).

    Literal spellings are not expressions: enum members (even misspelt, so they get a did-you-mean), torch
    dtypes, booleans, ``"auto"`` and any spelling in ``known``.
    """
    if not isinstance(value, str) or not value.strip():
        return False
    text = value.strip()
    if text.lower() in known or text.lower() in DTYPES or text.lower() in _TRUE | _FALSE | {"auto", "none", "null"}:
        return False
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    if isinstance(tree.body, ast.Constant):
        return False  # a number or a literal, not something the script computes
    if any(ch in text for ch in "()[] "):
        return True
    return not (_ENUM_MEMBER.fullmatch(text.rsplit(".", 1)[-1]) or text.startswith("torch."))


EXPRESSION_REASON = ("a Python expression the training script evaluates at run time; its value is not in the file, "
                     "so the framework default applies here - replace it by the value to translate it")  # fmt: skip


def split_expressions(raw: Mapping[str, Any], fmap: FieldMap, dialect: str,
                      known: frozenset[str] = frozenset()) -> tuple[dict, list[Note], dict]:  # fmt: skip
    """Take run-time expressions out of ``raw`` before mapping: ``(clean, notes, kept)``.

    Only values of known keys whose rule maps them (To, Hook, or a section given as a string) are taken; keys with
    a status keep their own note, and unknown keys stay for the driver's did-you-mean.
    """
    notes: list[Note] = []
    kept: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> dict:
        out = {}
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            rule = fmap.lookup(path)
            if isinstance(value, Mapping) and rule is None:
                out[key] = walk(value, path)
            elif value is None and rule is None and fmap.has_children(path):
                notes.append(Note(path, None, None, Fidelity.EXACT, "None: the framework default"))
            elif is_expression(value, known) and not isinstance(rule, Status) and (
                    rule is not None or fmap.has_children(path)):  # fmt: skip
                notes.append(Note(path, None, value, Fidelity.DROPPED, EXPRESSION_REASON))
                kept[path] = value
            else:
                out[key] = value
        return out

    return walk(raw, ""), notes, kept


#: Keys of a mesh description that say how the script builds the mesh, not how it shards.
_MESH_BUILD_KEYS = ("device_type", "expr", "parent_mesh", "dim")
_MESH_KEYS = {"shape", "dim_names", *_MESH_BUILD_KEYS}
#: The shard group's dimension of a 2-D mesh (dim 0 replicates).
_SHARD_DIM = sharding.MESH_DIMS.index("shard")


def mesh_shard_size(mesh: Any, ctx: ReadContext, path: str) -> tuple[int, Any] | None:
    """Read a device-mesh description: ``(ndim, shard_size or None)``; notes every part of it.

    The description is a mapping with ``shape`` (ints; -1 means "the remaining ranks"), ``dim_names``,
    ``device_type`` and ``expr`` (the script's own expression, kept). In a 2-D mesh dim 0 replicates and dim 1
    shards (``torsh.concepts.sharding.MESH_DIMS``), so the shard group size is ``shape[1]``.
    """
    if mesh is None:
        ctx.note(path, Fidelity.EXACT, "no mesh: one group over all ranks", None)
        return 1, None
    if is_expression(mesh):
        ctx.keep(path, mesh)
        ctx.note(path, Fidelity.DROPPED, EXPRESSION_REASON + " (read as a 1-D mesh over all ranks)", mesh)
        return None
    if not isinstance(mesh, Mapping):
        ctx.problem(path, mesh, "a device mesh is described by a mapping with shape / dim_names")
        return None
    _note_mesh_keys(mesh, ctx, path)
    shape, names = mesh.get("shape"), mesh.get("dim_names")
    ndim = len(shape) if isinstance(shape, list) else len(names) if isinstance(names, list) else 1
    if "dim_names" in mesh:
        _note_dim_names(names, ndim == 2 and "shape" not in mesh, ctx, f"{path}.dim_names")
    return _mesh_shape(shape, ctx, f"{path}.shape") if "shape" in mesh else (ndim, None)


def _note_mesh_keys(mesh: Mapping, ctx: ReadContext, path: str) -> None:
    for key in sorted(set(mesh) - _MESH_KEYS):
        ctx.problem(f"{path}.{key}", mesh[key], "unknown mesh key; expected shape, dim_names, device_type, expr")
    for key in (k for k in _MESH_BUILD_KEYS if k in mesh):
        ctx.keep(f"{path}.{key}", mesh[key])
        ctx.note(f"{path}.{key}", Fidelity.IGNORED, "describes how the script builds the mesh", mesh[key])


def _note_dim_names(names: Any, sizes_unknown: bool, ctx: ReadContext, path: str) -> None:
    ctx.keep(path, names)
    if sizes_unknown:
        ctx.note(path, Fidelity.DROPPED, "a 2-D mesh (hybrid sharding) whose sizes the script computes at run time; "
                 "give shape: [replicate, shard] to translate the group size", names)  # fmt: skip
    else:
        ctx.note(path, Fidelity.IGNORED, "dimension names do not change the sharding", names)


def _mesh_shape(shape: Any, ctx: ReadContext, path: str) -> tuple[int, Any] | None:
    if not isinstance(shape, list) or not 1 <= len(shape) <= 2:
        ctx.problem(path, shape, "expected a list of 1 (FSDP) or 2 (HSDP: replicate, shard) sizes")
        return None
    if len(shape) == 1:
        ctx.note(path, Fidelity.EXACT, "1-D mesh: shard over all its ranks", shape)
        return 1, None
    size = shape[_SHARD_DIM]
    if is_deferred(size):
        ctx.note(path, Fidelity.DEFERRED, "shard within each node", shape)
        return 2, AUTO
    if sharding.is_count(size) and size > 0:
        return 2, size
    ctx.keep(path, shape)
    ctx.note(path, Fidelity.DROPPED, "the shard size (dim 1) is computed at run time; give it as a number to "
             "translate the hybrid group size", shape)  # fmt: skip
    return 2, None


def mesh_description(shard_size: Any, names: tuple[str, str]) -> dict[str, Any]:
    """The 2-D mesh description a writer emits for a hybrid shard group of ``shard_size`` ranks."""
    return {"shape": [-1, shard_size], "dim_names": list(names)}


def prune_defaults(ctx: WriteContext, defaults: Mapping[str, Any]) -> None:
    """Remove written keys whose value is the dialect's own default (the file then reads as a user would write it).

    The note stays, with no target and a reason saying why nothing was written.
    """
    from torsh.config import get_path

    notes = []
    for note in ctx.notes:
        path = note.target_path
        if path in defaults and get_path(ctx.out, path, object()) == defaults[path] and note.fidelity is Fidelity.EXACT:
            delete_path(ctx.out, path, keep_top_level=True)
            note = Note(note.source_path, None, note.value, note.fidelity, f"{ctx.dialect} default; not written")
        notes.append(note)
    ctx.notes[:] = notes


#: Who sets a value the source left "auto" when the target is a PyTorch-style config (core path prefix -> text).
AUTO_SETTERS = {
    "precision": "the training dtype is the script's choice (the HF Trainer's --bf16 / --fp16); set it there",
    "sharding.hybrid_shard_size": "the shard group is each node: build the mesh as (world size // LOCAL_WORLD_SIZE, "
    "LOCAL_WORLD_SIZE) in the script",
}


#: Core sections that PyTorch-style configs leave to the training script, and what the script uses instead.
SCRIPT_SIDE = {
    "batch": "batch sizes belong to the script's DataLoader",
    "optimizer": "the script builds the optimizer (after sharding)",
    "scheduler": "the script builds the LR scheduler",
    "gradients": "the script clips (torch.nn.utils.clip_grad_norm_) and reduces gradients",
    "precision.loss_scaling": "the script creates the (Sharded)GradScaler",
    "activation_checkpointing": "the script applies activation checkpointing (checkpoint_wrapper)",
    "compression": "gradient compression is a communication hook the script registers",
    "ddp": "DistributedDataParallel arguments",
    "launch": "the launcher's settings (torchrun)",
    "data": "the script builds the DataLoader",
}


def explain_unsupported(ctx: WriteContext, where: Mapping[str, str], also: str = "") -> None:
    """Replace the driver's generic "has no setting" reason by where the setting goes instead."""
    notes = []
    for note in ctx.notes:
        if note.fidelity is Fidelity.UNSUPPORTED and note.reason.endswith("has no setting for this"):
            key = next((k for k in sorted(where, key=len, reverse=True)
                        if note.source_path == k or note.source_path.startswith(k + ".")), None)
            if key is not None or also:
                reason = f"no {ctx.dialect} key: " + (where[key] if key else "nothing to write it to") + also
                note = Note(note.source_path, note.target_path, note.value, note.fidelity, reason)
        notes.append(note)
    ctx.notes[:] = notes
