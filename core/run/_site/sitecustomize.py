"""Installed first on PYTHONPATH by ``torsh run --no-python``: every Python process of the job resolves
``deepspeed`` to torsh's compatibility package; then any other ``sitecustomize`` on the path runs as usual."""

import importlib.machinery
import importlib.util
import os
import sys

from torsh.compat import install_deepspeed_alias

install_deepspeed_alias()

_here = os.path.dirname(os.path.abspath(__file__))
_others = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _others)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
