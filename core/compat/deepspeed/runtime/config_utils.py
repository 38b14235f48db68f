"""``deepspeed.runtime.config_utils``: ``DeepSpeedConfigModel``, the pydantic base DeepSpeed's config sections
(and libraries that extend DeepSpeed's config) are written on, with DeepSpeed's rules: unknown keys are refused,
a field can be given by its name or its alias, ``"auto"`` values are dropped (the field keeps its default, as
Hugging Face's integration expects), and a field marked ``json_schema_extra={"deprecated": True, "new_param":
..., "new_param_fn": ...}`` is carried over to its replacement (giving both is an ``AssertionError``)."""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict

log = logging.getLogger("DeepSpeed")


class DeepSpeedConfigModel(BaseModel):
    """Base of DeepSpeed's config models (see the module docstring for the rules)."""

    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())  # fmt: skip

    def __init__(self, strict: bool = False, **data: Any):
        if not strict:  # DeepSpeed: "auto" means "not given" outside strict mode
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto")
                    or k == "replace_method"}  # fmt: skip
        super().__init__(**data)
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False) and name in self.model_fields_set:
                self._carry_deprecated(name, extra)

    def _carry_deprecated(self, name: str, extra: dict) -> None:
        new = extra.get("new_param", "")
        note = extra.get("deprecated_msg", "")
        log.warning("Config parameter %s is deprecated%s%s", name, f" use {new} instead" if new else "",
                    f". {note}" if note else "")  # fmt: skip
        if not new or not extra.get("set_new_param", True):
            return
        value = extra.get("new_param_fn", lambda x: x)(getattr(self, name))
        owner: Any = self
        *path, last = new.split(".")
        for part in path:
            owner = getattr(owner, part)
        assert last not in owner.model_fields_set, (
            f"Cannot provide deprecated parameter '{name}' and replacing parameter '{new}' together")
        setattr(owner, last, value)


def get_config_default(config, field_name: str):
    """The default of ``field_name`` in the config model (class or instance) ``config``."""
    fields = type(config).model_fields if isinstance(config, BaseModel) else config.model_fields
    assert field_name in fields, f"'{field_name}' is not a field in {config}"
    assert not fields[field_name].is_required(), f"'{field_name}' is a required field and has no default value"
    return fields[field_name].get_default(call_default_factory=True)


class pp_int(int):
    """An int that prints as a readable string (``1e9`` prints ``1,000,000,000``), as in DeepSpeed's docs."""

    def __new__(cls, val, custom_print_str=None):
        inst = super().__new__(cls, val)
        inst.custom_print_str = custom_print_str
        return inst

    def __repr__(self):
        return self.custom_print_str or f"{self.real:,}"


class DeepSpeedConfigObject:
    """DeepSpeed's plain config-section base: ``repr`` is its attributes as JSON."""

    def repr(self):
        return self.__dict__

    def __repr__(self):
        return json.dumps(self.__dict__, sort_keys=True, indent=4, default=repr)


def get_scalar_param(param_dict: dict, param_name: str, param_default_value):
    """``param_dict[param_name]``, or the default when the key is absent."""
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: dict, param_name: str, param_default_value):
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: dict, param_name: str, param_default_value):
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs):
    """``json.load(..., object_pairs_hook=...)``: a key given twice in one object is a ``ValueError``."""
    d = dict((k, v) for k, v in ordered_pairs)
    if len(d) != len(ordered_pairs):
        seen = set()
        dupes = sorted({k for k, _ in ordered_pairs if k in seen or seen.add(k)})
        raise ValueError(f"Duplicate keys in DeepSpeed config: {dupes}")
    return d
