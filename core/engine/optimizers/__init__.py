"""The optimizers DeepSpeed 0.19.8 builds from a config that torch has no class for, written on torch ops:
``Lion`` (:mod:`.lion`), ``Lamb`` (:mod:`.lamb`), ``Muon`` with its auxiliary Adam (:mod:`.muon`), and the mup
package's ``MuAdam`` / ``MuAdamW`` / ``MuSGD`` (:mod:`.mup`).

:func:`build` makes the one a config names (``optimizer.name``, matched case-insensitively as DeepSpeed matches its
own names) over the tensors the step updates, checking each keyword against what DeepSpeed's class takes.
:data:`WHOLE_TENSOR` are the ones whose update of an element reads its whole parameter: on ZeRO-1/2's flat
partitions and FSDP2's shards they gather what they need (:mod:`.pieces`).
"""

from __future__ import annotations

import logging
from typing import Any

from torsh.errors import ConfigError, Problem, did_you_mean

from .lamb import Lamb
from .lion import Lion
from .muon import MuonWithAuxAdam, split_groups
from .pieces import expect_flat

__all__ = ["NAMES", "WHOLE_TENSOR", "Lamb", "Lion", "MuonWithAuxAdam", "build", "canonical", "expect_flat",
           "muon_settings", "split_groups"]  # fmt: skip

log = logging.getLogger("torsh.engine")

#: DeepSpeed's optimizer names built here (lower case -> its spelling).
NAMES = {"lion": "Lion", "lamb": "Lamb", "muon": "Muon", "muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD"}
#: Those whose update of an element reads its whole parameter (a norm, a matrix).
WHOLE_TENSOR = frozenset({"Lamb", "Muon"})

#: Each optimizer's keywords (DeepSpeed's constructor arguments; Muon: the config keys DeepSpeed reads).
_LION_KEYS = {"lr", "betas", "weight_decay"}
_LION_INERT = {"set_grad_none": "FusedLion's zero_grad mode", "fp32_optimizer_states": "DeepSpeedCPULion's state "
               "dtype (the state is fp32 here)"}  # fmt: skip
_LAMB_KEYS = {"lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_grad_norm",
              "max_coeff", "min_coeff", "amsgrad"}  # fmt: skip
_MUON_KEYS = {"lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "ns_method", "betas", "eps"}
_MUON_INERT = {"torch_adam": "the auxiliary Adam's implementation (same update)", "fp32_optimizer_states":
               "the auxiliary CPU Adam's state dtype (fp32 here)", "foreach": "the auxiliary Adam's kernels",
               "bias_correction": "the auxiliary Adam's (always corrected, as DeepSpeed's Muon config builds it)"}


def canonical(name: str) -> str | None:
    """DeepSpeed's spelling of an optimizer built here, or None."""
    return NAMES.get(name.lower())


def build(name: str, values: dict[str, tuple[str, Any]], params: Any) -> Any:
    """The optimizer ``name`` (:func:`canonical`) over ``params``; ``values``: keyword -> (dotted path, value)."""
    name = NAMES[name.lower()]
    if name == "Lion":
        return Lion(params, **_checked(name, values, _LION_KEYS, _LION_INERT))
    if name == "Lamb":
        return Lamb(params, **_checked(name, values, _LAMB_KEYS, {}))
    if name == "Muon":
        return _muon(values, params)
    from .mup import build_mup

    return build_mup(name, {k: v for k, (_, v) in values.items()}, params)


def _checked(name: str, values: dict[str, tuple[str, Any]], accepted: set[str], inert: dict[str, str]) -> dict:
    """The keyword values ``name`` takes; the inert ones dropped (logged); any other a ConfigError."""
    out, problems = {}, []
    for key, (path, value) in values.items():
        if key in accepted:
            out[key] = tuple(value) if key == "betas" else value
        elif key in inert:
            log.info("%s: %s=%r is %s; it changes nothing here", name, key, value, inert[key])
        else:
            problems.append(Problem(path, value, f"{name} has no argument '{key}'",
                                    did_you_mean(key, sorted(accepted | set(inert)))))  # fmt: skip
    if problems:
        raise ConfigError(problems)
    return out


def muon_settings(values: dict[str, tuple[str, Any]], *, warn: bool = True) -> dict:
    """The config's Muon values the split reads (:func:`split_groups`); DeepSpeed ignores keys it does not read
    (warned), refuses ``per_head_muon`` here."""
    out = {}
    for key, (path, value) in values.items():
        if key == "per_head_muon" and value:
            raise ConfigError([Problem(path, value, "per-head Newton-Schulz (Muon per attention head, from the "
                                       "model config's head counts) is not run by torsh: set per_head_muon to "
                                       "false (Muon then orthogonalises each projection whole)")])  # fmt: skip
        if key in _MUON_KEYS:
            out[key] = tuple(value) if key == "betas" else value
        elif warn and key not in _MUON_INERT and key not in ("adam_w_mode", "per_head_muon"):
            log.warning("Muon: %s=%r is not a key DeepSpeed's Muon reads; ignored, as DeepSpeed ignores it", path,
                        value)  # fmt: skip
    return out


def _muon(values: dict[str, tuple[str, Any]], params: Any) -> MuonWithAuxAdam:
    muon_settings(values, warn=False)  # its refusals (the split, which warned, has the values in the groups)
    groups = list(params)
    if not groups or not all(isinstance(g, dict) and "use_muon" in g for g in groups):
        raise ConfigError([Problem("optimizer.name", "Muon", "Muon needs its parameters split into Muon and Adam "
                                   "halves by name and shape before the engine shards them; this engine path "
                                   "(ZeRO-1/2 partitioning without the split) does not do it: use ZeRO stage 0 or "
                                   "3")])  # fmt: skip
    adam_w_mode = values.get("adam_w_mode", (None, True))[1]
    return MuonWithAuxAdam(groups, adam_w_mode=bool(adam_w_mode))
