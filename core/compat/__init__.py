"""Compatibility packages: other frameworks' module trees, each a thin layer over torch and the torsh engine.

``torsh.compat.deepspeed`` mirrors the part of DeepSpeed 0.19.8 that training scripts import. ``torsh run``
(:mod:`torsh.run`) makes the name ``deepspeed`` resolve to it in every worker (:func:`install_deepspeed_alias`),
so a DeepSpeed script runs unchanged, and DeepSpeed itself is never imported. Nothing here imports torch.
"""

from __future__ import annotations

from ._alias import DeepSpeedAliasFinder, install_deepspeed_alias

__all__ = ["DeepSpeedAliasFinder", "install_deepspeed_alias"]
