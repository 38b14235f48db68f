"""FSDP plugin settings as fine-tuning toolkits ship them: the JSON of Hugging Face ``TrainingArguments(fsdp_config=...)``
(``--fsdp_config file.json``), read as transformers 5.x reads it, alone or beside the Trainer's ``fsdp`` option string.

transformers strips Accelerate's ``fsdp_`` prefix from every key, applies the ``fsdp`` options (``full_shard``,
``shard_grad_op``, ``offload``, ``auto_wrap``), fills its own defaults (FSDP2, ``FULL_STATE_DICT``, no CPU-RAM-efficient
loading) and hands the settings to Accelerate's FSDP plugin. This dialect does the same, then reads the result through
the Accelerate dialect (one meaning of every FSDP plugin key, in one place) and reports each key under the spelling
of the file. Keys transformers does not read (documentation keys starting with ``_``, a toolkit's own settings) are
ignored and kept; the XLA (TPU) FSDP path is unsupported.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torsh import schemas
from torsh.concepts import sharding
from torsh.config import TorshConfig, set_path
from torsh.errors import ConfigError, Problem
from torsh.translate import Fidelity, Note, Translation

from . import accelerate, fsdp
from ._sniff import Shape, best, top_keys

NAME = "fsdp_plugin"
DEFAULT_FORMAT = "json"
FIELD_MAP = {k.split(".", 1)[1].removeprefix("fsdp_"): v for k, v in accelerate.FSDP_MAP.items()}
VALUE_MAPS: dict[str, dict] = {}
ALIASES: dict[str, str] = {}
#: transformers' key (prefix stripped) -> Accelerate's fsdp_config key, where they differ.
_RENAMED = {"version": "fsdp_version", "cpu_offload": "fsdp_offload_params"}
#: What transformers 5.x fills in when the file leaves a key out (training_args.py, _process_fsdp_args).
_DEFAULTS = {"version": 2, "state_dict_type": "FULL_STATE_DICT", "cpu_ram_efficient_loading": False,
             "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}  # fmt: skip
_V1_DEFAULTS = {"backward_prefetch": "NO_PREFETCH", "forward_prefetch": False, "use_orig_params": True,
                "sync_module_states": True}  # fmt: skip
_V2_ONLY = frozenset({"reshard_after_forward", "cpu_ram_efficient_loading", "activation_checkpointing"})
_XLA = frozenset({"xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings"})
#: How transformers 5.x reads each boolean setting it passes on (training_args.py, _process_fsdp_args): "text" is
#: ``str_to_bool(str(value).lower())`` (true/false, yes/no, on/off, t/f, y/n, 1/0; anything else raises), "truth" is
#: ``if fsdp_config.get(key)`` (any non-empty text is true, the text "false" too).
#: Each key with the FSDP versions for which transformers reads it.
_BOOLEANS = {**dict.fromkeys(("cpu_ram_efficient_loading", "activation_checkpointing"), ("text", (1, 2))),
             "reshard_after_forward": ("text", (2,)),
             **dict.fromkeys(("forward_prefetch", "use_orig_params", "sync_module_states", "limit_all_gathers"),
                             ("text", (1,))),
             **dict.fromkeys(("cpu_offload", *_XLA - {"xla_fsdp_settings"}), ("truth", (1, 2)))}  # fmt: skip
#: Keys transformers reads with ``fsdp_config.get(key)`` and passes on, where a null is the plugin's default.
_NULL_IS_UNSET = frozenset({"state_dict_type", "transformer_layer_cls_to_wrap"})
_STR_TO_BOOL = {"y": True, "yes": True, "t": True, "true": True, "on": True, "1": True,
                "n": False, "no": False, "f": False, "false": False, "off": False, "0": False}  # fmt: skip


def _plain_keys(config: dict, notes: list[Note]) -> dict:
    """The keys as transformers reads them: the ``fsdp_`` prefix stripped; ``_`` keys are documentation."""
    out = {}
    for key, value in config.items():
        if str(key).startswith("_"):
            notes.append(Note(str(key), None, value, Fidelity.IGNORED, "a documentation key: transformers reads no key "
                              "starting with _"))  # fmt: skip
        else:
            out[str(key).removeprefix("fsdp_")] = (key, value)
    return out


def _apply_options(options: Any, config: dict, notes: list[Note]) -> None:
    """The Trainer's ``fsdp`` option string or list, as transformers applies it to the settings."""
    items = options.split() if isinstance(options, str) else options if isinstance(options, list) else []
    fsdp1 = int(config.get("version", (None, 2))[1]) == 1
    # FSDP1 takes every strategy (Accelerate reads the name); FSDP2 only the reshard decision.
    strategies = sharding.TRAINER_OPTIONS if fsdp1 else sharding.TRAINER_FSDP2_OPTIONS
    for item in items:
        if item == "offload":
            config.setdefault("cpu_offload", ("fsdp", True))
        elif item in strategies:
            config.setdefault("reshard_after_forward", ("fsdp", item.upper() if fsdp1 else strategies[item]))
        elif item != "auto_wrap":
            raise ConfigError([Problem("fsdp", options, f"transformers refuses the fsdp option {item!r} (FSDP"
                                       f"{1 if fsdp1 else 2}); it takes full_shard, shard_grad_op, offload, auto_wrap"
                                       + ("" if fsdp1 else " (the others need version 1)"))], source=NAME)
    notes.append(Note("fsdp", None, options, Fidelity.EXACT, "the Trainer's fsdp options, applied to the settings as "
                      "transformers applies them"))  # fmt: skip


def _as_transformers_reads(key: str, value: Any, fsdp_version: int, source: str, notes: list[Note]) -> Any:
    """A boolean setting as transformers reads it (see ``_BOOLEANS``); a value it raises on is refused here too."""
    how, versions = _BOOLEANS.get(key, (None, ()))
    if fsdp_version not in versions or isinstance(value, bool):
        return value
    if how == "truth":
        if isinstance(value, str) and value.strip().lower() in _STR_TO_BOOL and bool(value) != _STR_TO_BOOL[
                value.strip().lower()]:  # fmt: skip
            notes.append(Note(source, None, value, Fidelity.APPROXIMATE, f"transformers tests this key for truth: "
                              f"the text {value!r} is true; write true or false"))  # fmt: skip
        return bool(value)
    text = str(value).lower()
    if text not in _STR_TO_BOOL:
        raise ConfigError([Problem(source, value, "transformers raises on it (invalid truth value); write true or "
                                   "false")], source=NAME)  # fmt: skip
    return _STR_TO_BOOL[text]


def _unread_reason(key: str, value: Any, fsdp_version: int) -> tuple[Fidelity, str] | None:
    """Why transformers does not pass a key on to the plugin (None: it does)."""
    if key in _XLA:
        return (Fidelity.UNSUPPORTED, "the XLA (TPU) FSDP path") if value else (Fidelity.EXACT, "off")
    if key == "offload_params":
        return Fidelity.IGNORED, ("transformers 5.x does not read it: it offloads with cpu_offload or the fsdp option "
                                  "'offload' (fsdp_offload_params is an accelerate config YAML key)")
    if key == "limit_all_gathers":
        return Fidelity.IGNORED, "no effect on the training (FSDP1's rate limiter)"
    if fsdp_version == 2 and key in (*_V1_DEFAULTS, "sharding_strategy"):
        return Fidelity.IGNORED, "transformers reads it only with FSDP1 (version 1)"
    if fsdp_version == 1 and key in _V2_ONLY - {"reshard_after_forward"}:
        return Fidelity.IGNORED, "transformers reads it only with FSDP2"
    if f"fsdp_config.fsdp_{key}" in accelerate.FSDP_MAP or key in _RENAMED or key == "min_num_params":
        return None
    return Fidelity.IGNORED, "transformers reads no such FSDP key (it ignores it)"


def _settings(raw: dict, notes: list[Note]) -> tuple[dict, Any]:
    """The fsdp_config keys as transformers reads them, and how to spell a key's place in the file."""
    nested = isinstance(raw.get("fsdp_config"), dict)
    config = _plain_keys(raw["fsdp_config"] if nested else raw, notes)
    if nested:
        notes += [Note(str(k), None, v, Fidelity.IGNORED, "a documentation key" if str(k).startswith("_") else
                       "a training argument, not an FSDP setting") for k, v in raw.items()
                  if k not in ("fsdp", "fsdp_config")]  # fmt: skip
        if "fsdp" in raw:
            _apply_options(raw["fsdp"], config, notes)
    return config, (lambda key: f"fsdp_config.{key}") if nested else (lambda key: key)


def _without_unread_xla_settings(raw: dict) -> dict:
    """The file as the schema judges it: without xla_fsdp_settings when xla is off (TrainingArguments reads the
    settings only for the XLA path, so any value passes there)."""
    nested = isinstance(raw.get("fsdp_config"), dict)
    config = raw["fsdp_config"] if nested else raw
    if "xla_fsdp_settings" not in config or config.get("xla"):
        return raw
    config = {k: v for k, v in config.items() if k != "xla_fsdp_settings"}
    return {**raw, "fsdp_config": config} if nested else config


def read(raw: Any, *, version: str | None = None) -> Translation[TorshConfig]:
    """Read an ``fsdp_config`` JSON (or the Trainer's ``fsdp`` + ``fsdp_config``) as transformers does."""
    if not isinstance(raw, dict):
        raise ConfigError([Problem("", raw, "an fsdp_config must be a mapping of keys to values")], source=NAME)
    problems = schemas.check(_without_unread_xla_settings(raw), NAME)
    if problems:
        raise ConfigError(problems, source=NAME)
    notes: list[Note] = []
    config, where = _settings(raw, notes)
    fsdp_version = int(config.get("version", (None, 2))[1])
    section, spelling = _plugin_section(config, where, fsdp_version, notes)
    filled = _fill_defaults(section, fsdp_version, where)
    read_as = accelerate.read({"distributed_type": "FSDP", "fsdp_config": section})
    renamed = [_respelt(n, filled, spelling, where) for n in read_as.notes if n.source_path != "distributed_type"]
    kept = {n.source_path: n.value for n in notes if n.fidelity in (Fidelity.IGNORED, Fidelity.UNSUPPORTED)}
    kept.update({"fsdp": raw["fsdp"]} if isinstance(raw.get("fsdp_config"), dict) and "fsdp" in raw else {})
    cfg = read_as.result.model_copy(update={"extensions": {NAME: kept} if kept else {}})
    return Translation(cfg, notes + renamed, NAME, "torsh")


def _accelerate_key(key: str) -> str:
    """Accelerate's fsdp_config key for transformers' (prefix stripped) one."""
    return _RENAMED.get(key, f"fsdp_{key}")


def _plugin_section(config: dict, where: Any, fsdp_version: int, notes: list[Note]) -> tuple[dict, dict]:
    """Accelerate's fsdp_config as transformers hands it on, and where each of its keys came from in the file."""
    section, spelling = {}, {}
    for key, (written, value) in config.items():
        source = written if written == "fsdp" else where(written)
        if value is None and key in _NULL_IS_UNSET:
            notes.append(Note(source, None, None, Fidelity.EXACT, "null: not set, the default applies"))
            continue
        value = _as_transformers_reads(key, value, fsdp_version, source, notes)
        unread = _unread_reason(key, value, fsdp_version)
        if unread:
            notes.append(Note(source, None, value, *unread))
            continue
        section[_accelerate_key(key)] = ",".join(value) if isinstance(value, list) else value  # classes, joined
        spelling[f"fsdp_config.{_accelerate_key(key)}"] = source
    return section, spelling


def _fill_defaults(section: dict, fsdp_version: int, where: Any) -> dict[str, str]:
    """transformers' defaults for the keys the file leaves out, put in ``section``: Accelerate's key -> the file's."""
    defaults = {**_DEFAULTS, **(_V1_DEFAULTS if fsdp_version == 1 else {"reshard_after_forward": True})}
    missing = {k: v for k, v in defaults.items() if _accelerate_key(k) not in section}
    section.update({_accelerate_key(k): v for k, v in missing.items()})
    return {f"fsdp_config.{_accelerate_key(k)}": where(k) for k in missing}


def _respelt(note: Note, filled: dict, spelling: dict, where: Any) -> Note:
    """An Accelerate note under the file's own spelling of its key (a default filled in: transformers')."""
    if note.source_path in filled:
        return replace(note, source_path=filled[note.source_path], fidelity=Fidelity.DEFAULTED,
                       reason="not set; transformers' default")  # fmt: skip
    if note.source_path in spelling:
        return replace(note, source_path=spelling[note.source_path])
    if note.source_path.startswith("fsdp_config."):  # a default of Accelerate's plugin, left to it
        return replace(note, source_path=where(_plain(note.source_path.split(".", 1)[1])))
    return note


def write(cfg: TorshConfig, *, version: str | None = None) -> Translation[dict]:
    """Write the ``fsdp_config`` JSON transformers reads (FSDP2 unless ``version="fsdp1"``): the Accelerate FSDP
    settings without their prefix; a file read from this dialect gets its own keys back."""
    backend = version or "fsdp2"
    if backend not in ("fsdp2", "fsdp1"):
        raise ConfigError([Problem("version", version, "expected fsdp2 or fsdp1")], source=NAME)
    own = cfg.extensions.get(NAME, {})
    written = accelerate.write(cfg.model_copy(update={"extensions": {}}), version=backend)
    out: dict[str, Any] = {}
    notes = []
    if cfg.sharding.stage < 2:
        notes.append(Note("sharding.stage", None, cfg.sharding.stage, Fidelity.APPROXIMATE, "an fsdp_config always "
                          "shards: written as FSDP (same numerics, less memory); for DDP run the Trainer without "
                          "--fsdp"))  # fmt: skip
    notes += [n for n in (_as_plugin_note(n, written.result) for n in written.notes) if n is not None]
    for key, value in written.result.get("fsdp_config", {}).items():
        out[_plain(key)] = value.split(",") if key == "fsdp_transformer_layer_cls_to_wrap" else value
    out["version"] = out.pop("version", 2 if backend == "fsdp2" else 1)
    if any(key == "fsdp" or key.startswith("fsdp_config.") for key in own):  # the Trainer-arguments form
        out = {"fsdp": own.get("fsdp", True), "fsdp_config": out}
    for key, value in own.items():  # what transformers does not read, back in the file as it was
        if key != "fsdp":
            set_path(out, key, value)
            notes.append(Note(f"extensions.{NAME}.{key}", key, value, Fidelity.EXACT, "kept from the source file"))
    for dialect, keys in cfg.extensions.items():
        notes += [Note(f"extensions.{dialect}.{k}", None, v, Fidelity.DROPPED, f"a {dialect} setting with no "
                       f"{NAME} meaning") for k, v in keys.items() if dialect != NAME]  # fmt: skip
    return Translation(out, notes, "torsh", NAME)


def _as_plugin_note(note: Note, written: dict) -> Note | None:
    """An Accelerate write note as it reads for an fsdp_config (None: about what the launcher decides)."""
    target = note.target_path or ""
    if target in ("distributed_type", "compute_environment") or (note.source_path.startswith("launch.") and
                                                                 note.value is None):  # fmt: skip
        return None  # the file is FSDP settings only; the launcher decides the processes
    note = replace(note, reason=note.reason.replace("no accelerate key", "not an fsdp_config key").replace(
        "accelerate has no setting", "fsdp_config has no setting"))  # fmt: skip
    if target.startswith("fsdp_config."):
        return replace(note, target_path=_plain(target.split(".", 1)[1]))
    if target == "mixed_precision":
        full = written.get("mixed_precision") == "no"
        return replace(note, target_path=None, fidelity=Fidelity.EXACT if full else Fidelity.DROPPED,
                       reason="full precision, the Trainer's default" if full else "set with the Trainer's --bf16 / "
                       "--fp16 argument, not in fsdp_config")  # fmt: skip
    if target:
        return replace(note, target_path=None, fidelity=Fidelity.DROPPED, reason=f"a launcher setting ({target}): "
                       "pass it to the launcher")  # fmt: skip
    return note


def _plain(key: str) -> str:
    return {v: k for k, v in _RENAMED.items()}.get(key, key.removeprefix("fsdp_"))


def _plugin_keys() -> set[str]:
    """The plugin's keys as an fsdp_config holds them, with and without the ``fsdp_`` prefix."""
    plain = {k.split(".", 1)[1].removeprefix("fsdp_") for k in accelerate.FSDP_MAP} | set(_RENAMED) | _XLA
    plain |= {"min_num_params", "limit_all_gathers", "activation_cpu_offload"}
    return plain | {f"fsdp_{k}" for k in plain}


#: An fsdp_config: plugin keys, alone (one not also an FSDP keyword argument) or in an ``fsdp_config`` section
#: (``_``-keys are comments), and nothing of an Accelerate YAML's top level.
_ACCELERATE_TOP = ("distributed_type", "compute_environment")
SHAPES = (Shape(0.96, (_plugin_keys() - top_keys(fsdp.FIELD_MAP),), {*_plugin_keys(), "_*"}, excludes=_ACCELERATE_TOP),
          Shape(0.96, ({"fsdp_config"},), {"fsdp", "_*", "fsdp_config._*", *(f"fsdp_config.{k}" for k in
                                                                            _plugin_keys())},
                tables={"fsdp_config"}, excludes=_ACCELERATE_TOP))  # fmt: skip


def sniff(raw: Any) -> float:
    """An fsdp_config (``SHAPES``)."""
    return best(SHAPES, raw)
