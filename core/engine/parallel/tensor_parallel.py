"""Tensor parallelism: the model's linear layers split over the tp ranks with DTensor, on the plan's device mesh.

The mesh has the dimensions of :attr:`torsh.plan.Degrees.dims` (torchtitan's order, tensor parallelism innermost).
:func:`apply_tensor_parallel` runs before FSDP2, as torchtitan composes them: ``parallelize_module`` splits the planned
linear layers (``ColwiseParallel``: by output features; ``RowwiseParallel``: by input features, its output summed over
the tp ranks), every other parameter is replicated over the tp ranks as a DTensor (so that every parameter lives on
the same 2-D mesh once FSDP2 shards it over the data-parallel dimension, and norms and clipping see one mesh), and
FSDP2 then shards over the data-parallel sub-mesh it returns.

Which layers: ``parallelism.tp_plan`` (module-name patterns -> colwise / rowwise), else the default plan for Hugging
Face-style names (:data:`torsh.plan.TP_COLWISE`, :data:`torsh.plan.TP_ROWWISE`, as DeepSpeed's AutoTP recognises
them): a module's linear children are split when every one of them has a known name and at least one is rowwise (so
each colwise output meets its rowwise partner); a module with another linear child keeps them all replicated.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from torsh.config import ParallelismConfig
from torsh.errors import ConfigError, Problem
from torsh.plan import TP_COLWISE, TP_ROWWISE, Degrees

from ..distributed import DistInfo

log = logging.getLogger("torsh.engine")

_KEY = "parallelism.tp_plan"


def build_mesh(degrees: Degrees, info: DistInfo) -> Any:
    """The device mesh of ``degrees`` (every dimension of :attr:`Degrees.dims`, named as there)."""
    from torch.distributed.device_mesh import init_device_mesh

    names, sizes = zip(*degrees.dims)
    return init_device_mesh(info.device.type, tuple(sizes), mesh_dim_names=tuple(names))


def data_parallel_mesh(mesh: Any, degrees: Degrees) -> Any:
    """The sub-mesh FSDP2 shards over: ``(dp_replicate, dp_shard)`` under HSDP, else ``dp_shard``; with context
    parallelism ``dp_shard`` and ``cp`` flattened into one dimension, ``dp_shard_cp`` (the context-parallel peers hold
    the same model: Accelerate's and torchtitan's layout)."""
    names = [n for n, _ in degrees.dims]
    shard = [n for n in ("dp_shard", "cp") if n in names]
    if len(shard) > 1:
        mesh[tuple(shard)]._flatten("dp_shard_cp")
        shard = ["dp_shard_cp"]
    picked = [n for n in ("dp_replicate",) if n in names] + shard
    return mesh[tuple(picked)] if len(picked) > 1 else mesh[picked[0]]


def data_parallel_group(dp_mesh: Any) -> Any:
    """The process group of the data-parallel sub-mesh (its two dimensions flattened into one under HSDP): the ranks
    that hold the same tensor-parallel slice. Collective the first time on a 2-D mesh: every rank asks for it."""
    if dp_mesh.ndim == 1:
        return dp_mesh.get_group()
    return dp_mesh._flatten("dp").get_group()


def _pattern(glob: str) -> re.Pattern:
    """A module-name pattern: ``*`` within one dotted name, ``**`` across names, anything else literal."""
    out = []
    for part in re.split(r"(\*\*|\*)", glob):
        out.append(".*" if part == "**" else "[^.]*" if part == "*" else re.escape(part))
    return re.compile("".join(out))


def resolve_plan(model: nn.Module, parallelism: ParallelismConfig, tp: int) -> dict[str, str]:
    """Module name -> "colwise" / "rowwise" for the linear layers to split; a configured pattern that matches no
    linear layer, or a layer whose split dimension ``tp`` does not divide, is a ConfigError naming the key."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    configured = parallelism.tp_plan
    chosen = _configured_plan(linears, configured) if configured else _default_plan(model)
    bad = _undivided(chosen, linears, tp)
    if bad:
        raise ConfigError([Problem("parallelism.tp", tp, "does not divide the split dimension of " + ", ".join(bad)
                                   + ": choose a tp degree that divides it, or leave the layer out of "
                                   "parallelism.tp_plan")])  # fmt: skip
    return chosen


def _undivided(chosen: dict[str, str], linears: dict[str, nn.Linear], tp: int) -> list[str]:
    """The layers whose split dimension (colwise: output features, rowwise: input features) ``tp`` does not
    divide, as ``name (n output features)``."""
    bad = []
    for name, style in chosen.items():
        layer = linears[name]
        features, side = (layer.out_features, "output") if style == "colwise" else (layer.in_features, "input")
        if features % tp:
            bad.append(f"{name} ({features} {side} features)")
    return bad


def _configured_plan(linears: dict[str, nn.Linear], configured: dict[str, str]) -> dict[str, str]:
    """``parallelism.tp_plan`` applied to the model's linear layers: the first pattern that matches a layer decides
    its style; a pattern that matches none is a ConfigError."""
    chosen: dict[str, str] = {}
    unmatched = []
    for glob, style in configured.items():
        found = [name for name in linears if _pattern(glob).fullmatch(name)]
        if not found:
            unmatched.append(glob)
        for name in found:
            chosen.setdefault(name, style)
    if unmatched:
        raise ConfigError([Problem(_KEY, unmatched, "no nn.Linear of the model has a matching name; its linear "
                                   f"layers are {sorted(linears)[:12]}{' ...' if len(linears) > 12 else ''}")])
    return chosen


def _default_style(name: str) -> str | None:
    return "colwise" if name in TP_COLWISE else "rowwise" if name in TP_ROWWISE else None


def _default_plan(model: nn.Module) -> dict[str, str]:
    """The default plan: the linear children of a module split when every one has a known name and both styles
    are among them."""
    chosen = {}
    for parent_name, parent in model.named_modules():
        styles = {n: _default_style(n) for n, c in parent.named_children() if isinstance(c, nn.Linear)}
        if set(styles.values()) != {"colwise", "rowwise"}:
            continue
        for n, style in styles.items():
            chosen[f"{parent_name}.{n}" if parent_name else n] = style
    return chosen


def _to_replicated(module: nn.Module, inputs: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return x

    return tuple(convert(x) for x in inputs)


def _to_local(module: nn.Module, outputs: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(outputs, DTensor):
        return outputs.to_local()
    if isinstance(outputs, tuple):
        return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
    return outputs


def apply_tensor_parallel(model: nn.Module, parallelism: ParallelismConfig, degrees: Degrees, info: DistInfo) -> Any:
    """Split ``model``'s planned linear layers (``parallelism.tp_plan``, else the default plan) over the tp ranks of
    the plan's ``degrees``, replicate its other parameters there, and return the data-parallel sub-mesh FSDP2
    shards over."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = build_mesh(degrees, info)
    tp_mesh = mesh["tp"]
    chosen = resolve_plan(model, parallelism, degrees.tp)
    key = _KEY if parallelism.tp_plan else "parallelism.tp"
    if not chosen:
        raise ConfigError([Problem(key, degrees.tp, "no linear "
                                   "layer of the model is split by the default plan (it needs Hugging Face-style "
                                   "names such as q_proj/o_proj, up_proj/down_proj): give parallelism.tp_plan, or "
                                   "set parallelism.tp to 1")])  # fmt: skip
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, tp_mesh, {name: styles[style]() for name, style in chosen.items()})
    rest = _replicate_rest(model, chosen, tp_mesh, key, degrees.tp)
    if info.rank == 0:
        split = ", ".join(f"{n} ({s})" for n, s in chosen.items())
        log.info("tensor parallelism over %d ranks: %s; replicated over the tp ranks: %s", degrees.tp, split,
                 ", ".join(rest) or "nothing else")  # fmt: skip
    return data_parallel_mesh(mesh, degrees)


def _replicate_rest(model: nn.Module, chosen: dict[str, str], tp_mesh: Any, key: str, tp: int) -> list[str]:
    """Every parameter not split: replicated over the tp ranks, on leaf modules whose inputs become replicated
    DTensors and whose outputs local tensors again (the model's own code between the modules sees plain tensors).
    A tied parameter (a Hugging Face lm_head sharing embed_tokens' weight) stays one parameter: every owner gets
    the same DTensor. Returns the names of the modules replicated."""
    split_ids = {id(p) for name in chosen for p in model.get_submodule(name).parameters()}
    replicated: dict[int, nn.Parameter] = {}  # id of the original parameter -> its DTensor
    rest = []
    for name, module in model.named_modules():
        own = {k: p for k, p in module._parameters.items() if p is not None}
        if not own or name in chosen:
            continue
        _check_replicable(name, module, own, split_ids, key, tp)
        _replicate_module(module, own, tp_mesh, replicated)
        rest.append(name)
    return rest


def _replicate_module(module: nn.Module, own: dict[str, nn.Parameter], tp_mesh: Any,
                      replicated: dict[int, nn.Parameter]) -> None:  # fmt: skip
    """One leaf module's parameters as DTensors replicated over the tp ranks; a parameter another owner already
    replicated (a tied weight) is given that owner's DTensor."""
    from torch.distributed.tensor import distribute_module

    for k, p in own.items():
        if id(p) in replicated:
            module._parameters[k] = replicated[id(p)]
    distribute_module(module, tp_mesh, input_fn=_to_replicated, output_fn=_to_local)
    for k, p in own.items():
        replicated.setdefault(id(p), module._parameters[k])


def _check_replicable(name: str, module: nn.Module, own: dict[str, nn.Parameter], split_ids: set[int], key: str,
                      tp: int) -> None:  # fmt: skip
    """A module replicated must share no parameter with a split layer and hold parameters only as a leaf."""
    if any(id(p) in split_ids for p in own.values()):
        raise ConfigError([Problem(key, tp, f"module "
                                   f"{name} shares a parameter with a layer tensor parallelism splits; leave the "
                                   "layer out of the plan (parallelism.tp_plan)")])  # fmt: skip
    if any(True for _ in module.children()):
        raise ConfigError([Problem("parallelism.tp", tp, f"module {name or '(root)'} holds parameters "
                                   "of its own beside child modules; tensor parallelism replicates parameters per "
                                   "leaf module: move them into a child module, or set parallelism.tp to 1")])
