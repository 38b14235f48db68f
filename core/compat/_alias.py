"""The import hook that makes ``deepspeed`` (and every ``deepspeed.<sub>``) resolve to ``torsh.compat.deepspeed``.

A meta-path finder placed first on ``sys.meta_path``: ``import deepspeed.comm as dist`` in the script, or in any
library it imports, gets ``torsh.compat.deepspeed.comm`` (the same module object under both names). A DeepSpeed
module the compatibility package does not provide is a ``ModuleNotFoundError`` that says so; the real
DeepSpeed is never searched, installed or not. Importing this module does not import torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys

ALIAS = "deepspeed"
TARGET = "torsh.compat.deepspeed"
#: The version libraries read from the package metadata (``importlib.metadata.version("deepspeed")``), as
#: ``deepspeed.__version__``: the DeepSpeed API version mirrored, labelled as torsh's.
VERSION = "0.19.8+torsh"


def _is_aliased(fullname: str) -> bool:
    return fullname == ALIAS or fullname.startswith(ALIAS + ".")


class _AliasLoader(importlib.abc.Loader):
    """Loads an aliased name as the already imported compatibility module (one module, two names)."""

    def __init__(self, module):
        self._module = module
        self._spec = module.__spec__

    def create_module(self, spec):
        return self._module

    def exec_module(self, module):
        # importlib stamped the alias spec on the module; it keeps its own identity under its own name.
        module.__spec__ = self._spec


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``deepspeed`` and ``deepspeed.<sub>`` to ``torsh.compat.deepspeed[.<sub>]``."""

    def find_spec(self, fullname, path=None, target=None):
        if not _is_aliased(fullname):
            return None
        target_name = TARGET + fullname[len(ALIAS):]
        try:
            module = importlib.import_module(target_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not target_name.startswith(exc.name):
                raise  # a dependency of the compatibility module is missing: report it as it is
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: DeepSpeed runs on torsh here (torsh run), and torsh's DeepSpeed "
                f"compatibility package does not provide {fullname!r}. Import it from real DeepSpeed under the "
                "deepspeed launcher, or use the torch equivalent (docs/torsh-run.md lists the covered API).",
                name=fullname) from None  # fmt: skip
        return importlib.util.spec_from_loader(fullname, _AliasLoader(module),
                                               is_package=hasattr(module, "__path__"))  # fmt: skip

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        """The ``deepspeed`` distribution (searched before any installed one: this finder is first)."""
        name = getattr(context, "name", None)
        if name is not None and name.lower().replace("_", "-") == ALIAS:
            return iter([_Distribution()])
        return iter(())


class _Distribution(importlib.metadata.Distribution):
    """Package metadata for ``deepspeed``: libraries that check it before importing DeepSpeed (Accelerate and the
    Hugging Face Trainer) find the compatibility package, also when DeepSpeed is not installed."""

    def read_text(self, filename):
        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {VERSION}\nSummary: torsh.compat.deepspeed\n"
        return None

    def locate_file(self, path):
        import pathlib

        return pathlib.Path(importlib.util.find_spec(TARGET).origin).parent / path


def install_deepspeed_alias() -> DeepSpeedAliasFinder:
    """Put the alias finder first on ``sys.meta_path`` (idempotent) and return it.

    A real DeepSpeed module imported before this call is removed from ``sys.modules`` so that later imports
    resolve to the compatibility package; objects already taken from it keep pointing at real DeepSpeed.
    """
    for finder in sys.meta_path:
        if isinstance(finder, DeepSpeedAliasFinder):
            return finder
    for name in [n for n in sys.modules if _is_aliased(n)]:
        del sys.modules[name]
    finder = DeepSpeedAliasFinder()
    sys.meta_path.insert(0, finder)
    return finder
