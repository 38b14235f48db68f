"""Names of DeepSpeed features torsh does not run: they import (so a script's import lines work) and fail with a
clear message when used."""

from __future__ import annotations


class NotSupportedByTorsh(NotImplementedError):
    """A DeepSpeed feature the torsh engine does not run; the message says what to use instead."""


def message(name: str, instead: str) -> str:
    return f"deepspeed.{name} is not supported by torsh: {instead}"


def unsupported_class(name: str, instead: str) -> type:
    """A class that can be imported and subclassed; constructing it raises :class:`NotSupportedByTorsh`."""

    def __init__(self, *args, **kwargs):
        raise NotSupportedByTorsh(message(name, instead))

    return type(name.rsplit(".", 1)[-1], (), {"__init__": __init__, "__doc__": message(name, instead)})


def unsupported_function(name: str, instead: str):
    """A function that raises :class:`NotSupportedByTorsh` when called."""

    def function(*args, **kwargs):
        raise NotSupportedByTorsh(message(name, instead))

    function.__name__ = name.rsplit(".", 1)[-1]
    function.__doc__ = message(name, instead)
    return function
