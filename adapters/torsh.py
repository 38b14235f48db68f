"""The native dialect: the core model as TOML, YAML or JSON, plus the seed layouts it grew from.

Two input layouts are read:

* the core layout (sections ``batch``, ``sharding``, ``precision``, ...) — validated as is;
* the ToRSh seed layout (``[distributed]``/``[ddp]``/``[training]`` TOML and the ``distributed``/``model``/
  ``training`` "PyTorch config" YAML of the migration guide) — mapped key by key through ``FIELD_MAP``.

Writing always produces the core layout.
"""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel

from torsh.config import SECTION_NAMES, TorshConfig, iter_leaves
from torsh.dialect import Dialect
from torsh.translate import Fidelity, Hook, Ignored, Note, ReadContext, To, Translation

from ._sniff import Shape, best

NAME = "torsh"
VERSIONS = ("1",)

_RANK_REASON = (
    "a process's rank comes from the launcher at run time (RANK); one file cannot fix it for every process"
)


def _gradient_compression(value: Any, ctx: ReadContext, path: str) -> None:
    if value is False:
        ctx.set("compression.method", "none", path)
    elif value is True:
        ctx.set("compression.method", "fp16", path, Fidelity.APPROXIMATE,
                "the seed layout does not name a method; fp16 compression is the closest common one")  # fmt: skip
    else:
        ctx.problem(path, value, "expected true or false")


#: The seed layout (source) -> core model. The core layout needs no map: it is the model itself.
FIELD_MAP = {
    "distributed.backend": "communication.backend",
    "distributed.init_method": "communication.init_method",
    "distributed.master_addr": "launch.master_addr",
    "distributed.master_port": "launch.master_port",
    "distributed.world_size": "launch.world_size",
    "distributed.rank": Ignored(_RANK_REASON, keep=False),
    "ddp.bucket_size_mb": "ddp.bucket_cap_mb",
    "ddp.overlap_communication": "ddp.overlap_comm",
    "ddp.gradient_compression": Hook(read=_gradient_compression),
    "training.epochs": "data.epochs",
    "training.batch_size": To("batch.micro_batch_size", reason="the seed's batch_size is per process"),
    "training.learning_rate": To("optimizer.lr", reason="applied to the optimizer the script passes"),
    "training.gradient_clipping": "gradients.clip_max_norm",
    "model.batch_size": To("batch.micro_batch_size", reason="the seed's batch_size is per process", write=False),
    "model.learning_rate": To("optimizer.lr", reason="applied to the optimizer the script passes", write=False),
}
VALUE_MAPS = {
    "distributed.backend": {"nccl": "nccl", "gloo": "gloo", "mpi": "mpi", "ccl": "ccl", "auto": "auto"},
}
ALIASES: dict[str, str] = {}

def _section_keys() -> set[str]:
    """The core layout's sections and the fields of each (a section that is a union, the scheduler, is opaque)."""
    keys = set(SECTION_NAMES)
    for name in SECTION_NAMES:
        annotation = TorshConfig.model_fields[name].annotation
        model = next((a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and
                      issubclass(a, BaseModel)), None)  # fmt: skip
        keys |= {f"{name}.{field}" for field in (model.model_fields if model else ())}
    return keys


_SEED_SECTIONS = {"distributed", "training", "model"}
#: The core layout (1: the model itself, above every dialect that shares a section name with it) and the seed layout
#: (0.9: below the frameworks whose files also have [training] and [model] sections).
CORE = Shape(1.0, (SECTION_NAMES,), _section_keys())
SEED = Shape(0.9, ({*_SEED_SECTIONS, *(f"ddp.{k}" for k in ("bucket_size_mb", "overlap_communication",
                                                             "gradient_compression"))},),
             {*FIELD_MAP, *_SEED_SECTIONS, "ddp"}, tables=_SEED_SECTIONS)  # fmt: skip
SHAPES = (CORE, SEED)


def _is_seed_layout(raw: Any) -> bool:
    return SEED.confidence(raw) > CORE.confidence(raw)


class Torsh(Dialect):
    """The core layout is the model itself (validated as is); the seed layout is walked through the map."""

    NAME = NAME
    VERSIONS = VERSIONS
    FIELD_MAP = FIELD_MAP
    VALUE_MAPS = VALUE_MAPS
    ALIASES = ALIASES

    def check_schema(self, raw: Any) -> None:
        """The core layout's schema is the model (checked at validation); the seed layout's keys are the map's."""

    def read(self, raw: Any, *, version: str | None = None, base_dir: Any = None) -> Translation[TorshConfig]:
        """Read the core layout or the seed layout into the core model."""
        if isinstance(raw, dict) and _is_seed_layout(raw):
            return super().read(raw, version=version)
        self.check_version(version)
        cfg = TorshConfig.from_dict(raw, source=NAME)
        return Translation(cfg, _identity_notes(cfg.model_dump(mode="json", exclude_unset=True)), NAME, NAME)

    def write(self, cfg: TorshConfig, *, version: str | None = None, full: bool = True) -> Translation[dict]:
        """The core layout as plain data (``"auto"`` for deferred values; None values omitted).

        ``full=False`` keeps only what differs from the defaults (what ``torsh-migrate convert --to torsh``
        writes): the file reads back to the same config, and a reader sees what the source chose rather than every
        default.
        """
        self.check_version(version)
        data = cfg.model_dump(mode="json", exclude_none=True)
        if not full:
            data = _differences(cfg, TorshConfig(), data)
        return Translation(data, _identity_notes(cfg.model_dump(mode="json", exclude_unset=True)), NAME, NAME)

    def sniff(self, raw: Any) -> float:
        """The core layout or the seed layout (``SHAPES``)."""
        return best(SHAPES, raw)


DIALECT = Torsh()
read, write, sniff = DIALECT.read, DIALECT.write, DIALECT.sniff


def _differences(model: BaseModel, default: BaseModel, data: dict) -> dict:
    """The part of ``data`` (``model`` dumped) that differs from ``default``, section by section.

    Only sub-models are compared field by field; any other value (a list, a free-form mapping) is written whole
    when it differs, since reading a part of it back would not give the same value.
    """
    out = {}
    for name, value in data.items():
        mine, theirs = getattr(model, name, None), getattr(default, name, None)
        if isinstance(mine, BaseModel) and type(mine) is type(theirs) and isinstance(value, dict):
            part = _differences(mine, theirs, value)
            if part:
                out[name] = part
        elif not isinstance(theirs, BaseModel) and _dumped(default, name) == value:
            continue
        else:
            out[name] = value
    return out


def _dumped(model: BaseModel, name: str) -> Any:
    return model.model_dump(mode="json", include={name}).get(name)


def _identity_notes(data: dict) -> list[Note]:
    return [Note(path, path, value, Fidelity.EXACT) for path, value in iter_leaves(data)]
