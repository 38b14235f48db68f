"""Reading the attribute docstrings of the config models in one pass over their module's text.

``use_attribute_docstrings`` makes pydantic (before Python 3.13) walk the stack and re-tokenize the source of every
model class, about a third of the config modules' import time, which every ``torsh-migrate`` call pays. Every field
of the config models is written the same way, a line ``name: annotation = default`` and a docstring in triple double
quotes starting on the next line, so one regular-expression pass over a module's text finds them all (a sixth of the
cost of parsing the classes with ``ast``). Each config module installs the reader for its own classes before it
builds them and restores the previous reader after (:func:`install`, :func:`restore`).
"""

import re
from typing import Any


def install(module_name: str, file: str) -> Any:
    """Make pydantic read ``module_name``'s attribute docstrings from one pass over ``file``.

    A class whose documented names are not exactly its annotated attributes, in order (a field written another way),
    is left to pydantic's own reader, as are classes of other modules and a pydantic without this internal. Returns
    what :func:`restore` needs (None when nothing was installed).
    """
    try:
        from pydantic._internal import _fields
        original = _fields.extract_docstrings_from_cls
        with open(file, encoding="utf-8") as handle:
            docs = _attribute_docstrings(handle.read())
    except (ImportError, AttributeError, OSError):
        return None

    def extract(cls: type, *args: Any, **kwargs: Any) -> dict[str, str]:
        found = docs.get(cls.__qualname__) if cls.__module__ == module_name else None
        if found is not None and list(found) == list(cls.__dict__.get("__annotations__", {})):
            return found
        return original(cls, *args, **kwargs)

    _fields.extract_docstrings_from_cls = extract
    return _fields, original


_CLASS_OR_DOCUMENTED_FIELD = re.compile(r'^class (\w+)|^    (\w+): [^\n]*\n    """(.*?)"""', re.MULTILINE | re.DOTALL)


def _attribute_docstrings(source: str) -> dict[str, dict[str, str]]:
    """Per top-level class of ``source``, its attributes' docstrings, cleaned as pydantic cleans them."""
    import inspect

    docs: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for match in _CLASS_OR_DOCUMENTED_FIELD.finditer(source):
        class_name, field, text = match.groups()
        if class_name:
            current = docs[class_name] = {}
            continue
        if "\\" in text:  # an escape sequence: the docstring is the literal's value, not its source text
            import ast

            text = ast.literal_eval(f'"""{text}"""')
        current[field] = inspect.cleandoc(text)
    return docs


def restore(installed: Any) -> None:
    """Put back the reader :func:`install` replaced."""
    if installed is not None:
        module, original = installed
        module.extract_docstrings_from_cls = original
