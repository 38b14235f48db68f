"""``Deferred``: the Hugging Face ``"auto"`` convention as a first-class value.

A field that may be filled in later (by ``torsh.initialize`` from the world size, the model or the optimizer
it was given) holds ``AUTO`` instead of a number. It validates from the string ``"auto"``, serialises back to
``"auto"`` in JSON/TOML/YAML, and is never confused with a real value: code that needs the number must
resolve it first (``TorshConfig.resolve_deferred``), which fails loudly if it is still deferred.
"""

from __future__ import annotations

from typing import Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import SchemaSerializer, core_schema

AUTO_TEXT = "auto"


class Deferred:
    """A value that will be resolved later; written ``"auto"`` in every file format."""

    __slots__ = ()
    _instance: Deferred | None = None

    def __new__(cls) -> Deferred:
        # One instance: Deferred values compare equal and hash alike, like None.
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "AUTO"

    def __str__(self) -> str:
        return AUTO_TEXT

    def __reduce__(self) -> tuple[Any, ...]:
        return (Deferred, ())

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            _validate,
            serialization=core_schema.plain_serializer_function_ser_schema(lambda _: AUTO_TEXT, when_used="json"),
        )

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {"const": AUTO_TEXT, "description": "Resolved later by torsh.initialize (the \"auto\" convention)."}


# Where AUTO sits in a field typed ``Any`` (a torch scheduler's kwargs, kept extension keys), pydantic infers the
# serializer from the object: this one writes "auto" in JSON mode instead of failing on an unknown type.
Deferred.__pydantic_serializer__ = SchemaSerializer(  # type: ignore[attr-defined]
    core_schema.any_schema(serialization=core_schema.plain_serializer_function_ser_schema(
        lambda _: AUTO_TEXT, when_used="json")))

AUTO = Deferred()


def is_deferred(value: Any) -> bool:
    """True for ``AUTO`` and for the raw string ``"auto"``."""
    return isinstance(value, Deferred) or value == AUTO_TEXT


def _validate(value: Any) -> Deferred:
    if is_deferred(value):
        return AUTO
    raise ValueError(f"expected \"{AUTO_TEXT}\"")
