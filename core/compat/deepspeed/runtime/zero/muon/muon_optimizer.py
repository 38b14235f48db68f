"""``deepspeed.runtime.zero.muon.muon_optimizer``: DeepSpeed's ``MuonWithAuxAdam`` (Muon for the groups with
``use_muon``, Adam for the others), the class ``optimizer.type: "Muon"`` builds, on torsh's implementation."""

from __future__ import annotations

from torsh.engine.optimizers.muon import MuonWithAuxAdam as _Muon


class MuonWithAuxAdam(_Muon):
    """``MuonWithAuxAdam(param_groups, adam_optimizer=None, adam_optimizer_kwargs=None, adam_w_mode=True,
    fallback_to_inline=False)``. DeepSpeed steps the Adam half with ``adam_optimizer`` (FusedAdam, CPU Adam or
    torch's) when given; each computes the same Adam update, which torsh computes inline."""

    def __init__(self, param_groups, adam_optimizer=None, adam_optimizer_kwargs=None, adam_w_mode=True,
                 fallback_to_inline=False):  # fmt: skip
        super().__init__(param_groups, adam_w_mode=adam_w_mode)
