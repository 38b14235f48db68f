"""``deepspeed.runtime.zero.parameter_offload``: the ZeRO-3 parameter dictionary (``ZeROOrderedDict``) and
``ensure_zero_ordered_dict``, from the torsh engine (:mod:`torsh.engine.zero.external_params`: at stage 3 each
module's ``_parameters`` is one, and a parameter read outside its own module's forward is gathered whole)."""

from __future__ import annotations

from torsh.engine.zero.external_params import ZeROOrderedDict, ensure_zero_ordered_dict

__all__ = ["ZeROOrderedDict", "ensure_zero_ordered_dict"]
