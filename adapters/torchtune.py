"""torchtune: the distributed and precision keys of a recipe config YAML (``tune run ... --config X``), torchtune 0.6.1.

A recipe reads the keys it knows and ignores the rest, so no key is refused for being unknown: the keys that bear on
distributed training are read into the core model (``fsdp_cpu_offload``, ``fsdp_reshard_after_forward``,
``enable_activation_checkpointing`` / ``_offloading``, ``dtype``, batch size and accumulation, ``clip_grad_norm``,
the ``optimizer`` component, ``compile``, ``optimizer_in_bwd``, the HSDP and tensor-parallel dims); every other key
(model, tokenizer, dataset, checkpointer, ...) is "not a distributed setting", kept verbatim - ``_component_``
references and OmegaConf interpolations (``${output_dir}``) included - and written back. ``schemas/keys/torchtune.json``
lists what each 0.6.1 recipe reads (generated from the recipes' source).
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Any

from torsh.concepts import sharding
from torsh.concepts.offload import fsdp_cpu_offload
from torsh.concepts.optim import TORCH_OPTIMIZERS
from torsh.config import AUTO, TorshConfig
from torsh.dialect import Dialect, Prepared
from torsh.translate import Fidelity, FieldMap, Group, Hook, Note, Seen, To, Unsupported, WriteContext, settle_auto

from ._sniff import Shape, best

NAME = "torchtune"
_DTYPES = {"fp32": "fp32", "bf16": "bf16"}
_OPTIMIZER_FIELDS = ("lr", "weight_decay", "betas", "eps", "momentum")
#: The keyword arguments of the torch.optim classes recipes name (torch 2.x signatures): torchtune's instantiate
#: passes every key of the component to the class, which refuses one it does not take.
TORCH_OPTIMIZER_ARGUMENTS = {
    "torch.optim.AdamW": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                          "differentiable", "fused"),
    "torch.optim.Adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "maximize", "capturable",
                         "differentiable", "fused", "decoupled_weight_decay"),
    "torch.optim.SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach",
                        "differentiable", "fused"),
}  # fmt: skip


@cache
def recipe_keys() -> frozenset[str]:
    """The top-level keys some torchtune 0.6.1 distributed recipe reads (from the generated key table)."""
    from torsh import schemas

    table = json.loads((Path(schemas.__file__).parent / "keys" / "torchtune.json").read_text("utf-8"))
    return frozenset(k.split(".")[0] for recipe in table["recipes"].values() for k in recipe)


def _interpolation(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("${")


def _bool(seen: Seen, key: str, default: bool) -> Any:
    value = seen.value(key, default)
    if not isinstance(value, bool):
        seen.ctx.problem(key, value, "expected true or false")
        return None
    return value


# ---- sharding: the FSDP keys and the HSDP dims decide it together --------------------------------------------------


def _read_sharding(seen: Seen) -> None:
    reshard = _bool(seen, "fsdp_reshard_after_forward", True)
    if reshard is None:
        return
    stage = sharding.stage_of_reshard(reshard)
    seen.set("fsdp_reshard_after_forward", "sharding.stage", stage, reason=f"fully_shard(reshard_after_forward="
             f"{reshard}): ZeRO-{stage}", default=stage)  # fmt: skip
    _read_dims(seen)
    _read_offload(seen)


def _read_dims(seen: Seen) -> None:
    """The data-parallel dims (as torchtitan's degrees): HSDP when both are numbers and the replicas more than one."""
    shard, replicate = seen.value("data_parallel_shard_dim", -1), seen.value("data_parallel_replicate_dim", 1)
    layout = sharding.hybrid_degrees(replicate, shard)
    if layout == "hybrid":
        seen.set("data_parallel_shard_dim", "sharding.hybrid_shard_size", shard, reason=f"HSDP: {replicate} "
                 f"replicas of {shard}-rank shard groups")  # fmt: skip
        seen.drop("data_parallel_replicate_dim", "with data_parallel_shard_dim: HSDP", Fidelity.EXACT)
    elif layout == "replicate_rest":
        seen.set("data_parallel_replicate_dim", "parallelism.dp_replicate", replicate, reason=f"HSDP: {replicate} "
                 "replicas of shard groups of the remaining ranks")  # fmt: skip
        seen.drop("data_parallel_shard_dim", "-1: the remaining ranks", Fidelity.EXACT)
    else:
        for key in ("data_parallel_shard_dim", "data_parallel_replicate_dim"):
            default = seen.value(key) in (1, -1)
            seen.drop(key, "the default data-parallel layout" if default else "HSDP over the remaining ranks: the "
                      "group size depends on the world size; give both dims as numbers",
                      Fidelity.EXACT if default else Fidelity.APPROXIMATE)  # fmt: skip


def _read_offload(seen: Seen) -> None:
    offload = _bool(seen, "fsdp_cpu_offload", False)
    if offload:
        seen.set("fsdp_cpu_offload", "offload.params", "cpu", reason="CPUOffloadPolicy: parameters, gradients and "
                 "optimizer state on the CPU")  # fmt: skip
        seen.ctx.set("offload.optimizer", "cpu", "fsdp_cpu_offload", note=False)
    elif offload is False:
        seen.drop("fsdp_cpu_offload", "no offload", Fidelity.EXACT)


def _write_sharding(cfg: TorshConfig, ctx: WriteContext) -> None:
    s, o = cfg.sharding, cfg.offload
    if s.stage < 2:
        ctx.note("sharding.stage", Fidelity.APPROXIMATE, "torchtune's distributed recipes always shard with FSDP2: "
                 "written as ZeRO-2 (same numerics)", s.stage)  # fmt: skip
    ctx.put("fsdp_reshard_after_forward", s.stage >= 3 and s.reshard_after_forward is not False, "sharding.stage")
    if cfg.parallelism.dp_replicate is not None:
        ctx.put("data_parallel_replicate_dim", cfg.parallelism.dp_replicate, "parallelism.dp_replicate")
    if s.hybrid_shard_size is not None:
        _write_dims(cfg, ctx)
    switch, why = fsdp_cpu_offload(o.params, o.optimizer, "torchtune")
    if switch is None:
        ctx.note("offload", Fidelity.UNSUPPORTED, why, f"{o.params}/{o.optimizer}")
    else:
        ctx.put("fsdp_cpu_offload", switch, "offload.params", Fidelity.APPROXIMATE if why else Fidelity.EXACT, why)


def _write_dims(cfg: TorshConfig, ctx: WriteContext) -> None:
    size = cfg.sharding.hybrid_shard_size
    mesh = sharding.hybrid_mesh(size, sharding.data_parallel_ranks(cfg.launch.world_size, cfg.parallelism.tp))
    if mesh is None:
        ctx.note("sharding.hybrid_shard_size", Fidelity.UNSUPPORTED, "torchtune's HSDP dims are numbers: needs a "
                 "known group size dividing a known world size", size)  # fmt: skip
        return
    ctx.put("data_parallel_shard_dim", mesh[1], "sharding.hybrid_shard_size")
    ctx.put("data_parallel_replicate_dim", mesh[0], "sharding.hybrid_shard_size")


# ---- precision: one dtype for everything ---------------------------------------------------------------------------


def _read_dtype(seen: Seen) -> None:
    value = seen.value("dtype", "fp32")
    dtype = _DTYPES.get(str(value).lower())
    if dtype is None:
        seen.ctx.problem("dtype", value, "torchtune's distributed recipes train in bf16 or fp32 (they refuse fp16)")
        return
    seen.set("dtype", "precision.param_dtype", dtype, reason="torchtune trains in this dtype throughout: parameters, "
             "gradients and optimizer state", default=dtype)  # fmt: skip
    for core in ("precision.master_dtype", "precision.optimizer_state_dtype"):
        seen.ctx.set(core, dtype, "dtype", note=False)


def _write_dtype(cfg: TorshConfig, ctx: WriteContext) -> None:
    p = cfg.precision
    if p.param_dtype not in _DTYPES:
        ctx.note("precision.param_dtype", Fidelity.UNSUPPORTED, "torchtune trains in bf16 or fp32" + (
            ": the source leaves the dtype to the training arguments; set dtype" if p.param_dtype is AUTO else ""),
            p.param_dtype)  # fmt: skip
        return
    if p.master_dtype != p.param_dtype:
        ctx.note("precision.master_dtype", Fidelity.APPROXIMATE, f"torchtune keeps no {p.master_dtype} master "
                 f"weights: everything is {p.param_dtype}", p.master_dtype)  # fmt: skip
    ctx.put("dtype", p.param_dtype, "precision.param_dtype")


# ---- the optimizer component ---------------------------------------------------------------------------------------


def _read_optimizer(seen: Seen) -> None:
    fields = seen.section("optimizer")
    if not fields:
        return
    component = seen.value("optimizer._component_")
    name = str(component).rsplit(".", 1)[-1] if component else None
    seen.ctx.keep("optimizer._component_", component)
    seen.set("optimizer._component_", "optimizer.name", name, reason="the class the component names")
    for key in list(fields):
        problem = _optimizer_argument_problem(component, key, seen.value(f"optimizer.{key}"))
        if problem:
            seen.ctx.problem(f"optimizer.{key}", seen.value(f"optimizer.{key}"), problem[0], problem[1])
            continue
        if key in _OPTIMIZER_FIELDS:
            value = seen.value(f"optimizer.{key}")
            seen.set(f"optimizer.{key}", f"optimizer.{key}", tuple(value) if key == "betas" and isinstance(
                value, list) else value)  # fmt: skip
        elif key != "_component_":
            seen.set(f"optimizer.{key}", f"optimizer.kwargs.{key}", seen.value(f"optimizer.{key}"),
                     reason="a keyword argument of the optimizer class")  # fmt: skip


def _optimizer_argument_problem(component: Any, key: str, value: Any) -> tuple[str, str | None] | None:
    """Why torch.optim refuses the argument when torchtune builds the optimizer (None: it takes it). torchtune has
    no "auto": a number that is text, null or "auto" reaches torch.optim as it is."""
    from torsh.errors import did_you_mean

    known = TORCH_OPTIMIZER_ARGUMENTS.get(str(component))
    if known is not None and key != "_component_" and key not in known:
        return f"{component} takes no argument {key!r} (torchtune passes it on and torch.optim refuses it)", \
            did_you_mean(key, list(known))  # fmt: skip
    numbers = value if key == "betas" and isinstance(value, list) else [value]
    if key in _OPTIMIZER_FIELDS and not _interpolation(value) and not all(map(_number_as_omegaconf_reads, numbers)):
        return "a number (torch.optim refuses anything else when torchtune builds the optimizer)", None
    return None


def _number_as_omegaconf_reads(value: Any) -> bool:
    """A number, or the text of one: OmegaConf's YAML loader reads ``1e-4`` as a float where YAML 1.1 (PyYAML, which
    parsed the file here) gives the text."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    try:
        return isinstance(value, str) and math.isfinite(float(value))
    except ValueError:
        return False


def _write_optimizer(cfg: TorshConfig, ctx: WriteContext) -> None:
    o = cfg.optimizer
    if o is None:
        return
    kept = cfg.extensions.get(NAME, {}).get("optimizer._component_")
    if kept and str(kept).rsplit(".", 1)[-1] == o.name:
        component = kept
    elif o.name in TORCH_OPTIMIZERS:
        component = f"torch.optim.{o.name}"
    else:
        ctx.note("optimizer.name", Fidelity.UNSUPPORTED, "not a torch.optim class: name the optimizer's _component_ "
                 "in the recipe config", o.name)  # fmt: skip
        return
    ctx.put("optimizer._component_", component, "optimizer.name")
    for key in _OPTIMIZER_FIELDS:
        value = getattr(o, key)
        if value is not None:
            ctx.put(f"optimizer.{key}", list(value) if isinstance(value, tuple) else value, f"optimizer.{key}")
    for key, value in o.kwargs.items():
        ctx.put(f"optimizer.{key}", value, f"optimizer.kwargs.{key}")


# ---- the map ---------------------------------------------------------------------------------------------------------


def _read_flag(what: str):
    def hook(value: Any, ctx: Any, path: str) -> None:
        if value is False or value is None:
            ctx.note(path, Fidelity.EXACT, "off", value)
        else:
            ctx.keep(path, value)
            ctx.note(path, Fidelity.UNSUPPORTED, what, value)

    return hook


def _read_tensor_parallel(value: Any, ctx: Any, path: str) -> None:
    if value == 1:
        ctx.note(path, Fidelity.EXACT, "1: no tensor parallelism", value)
    elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
        ctx.problem(path, value, "the tensor-parallel degree is a positive number of ranks")
    else:
        ctx.set("parallelism.tp", value, path, Fidelity.APPROXIMATE, "DTensor tensor parallelism; torchtune splits "
                "the layers of its tensor_parallel_plan, torsh's default plan the same names (q/k/v_proj, w1/w3 "
                "colwise; output_proj, w2 rowwise), not the embedding or output head")  # fmt: skip


def _read_tensor_parallel_plan(value: Any, ctx: Any, path: str) -> None:
    ctx.keep(path, value)
    ctx.note(path, Fidelity.APPROXIMATE, "torchtune's plan is a function of its model; the default plan splits the "
             "same attention and feed-forward projections (give parallelism.tp_plan for another split)", value)


def _write_tensor_parallel(cfg: TorshConfig, ctx: WriteContext) -> None:
    par = cfg.parallelism
    if par.tp > 1:
        ctx.put("tensor_parallel_dim", par.tp, "parallelism.tp")
    if par.tp_plan:
        ctx.note("parallelism.tp_plan", Fidelity.UNSUPPORTED, "torchtune's tensor_parallel_plan is a component (a "
                 "function of its model), not a list of names", par.tp_plan)  # fmt: skip
    for key in ("pp", "cp"):
        if getattr(par, key) != 1:
            ctx.note(f"parallelism.{key}", Fidelity.UNSUPPORTED, "torchtune's distributed recipes have no such "
                     "degree", getattr(par, key))  # fmt: skip


_GROUPS = (
    Group("sharding", ("fsdp_reshard_after_forward", "fsdp_cpu_offload", "data_parallel_shard_dim",
                       "data_parallel_replicate_dim"), ("sharding.stage", "sharding.hybrid_shard_size", "offload",
                                                        "parallelism.dp_replicate"),
          _read_sharding, _write_sharding),
    Group("precision", ("dtype",), ("precision",), _read_dtype, _write_dtype),
    Group("optimizer", ("optimizer.*",), ("optimizer",), _read_optimizer, _write_optimizer),
)  # fmt: skip
_FIELDS = {
    "enable_activation_checkpointing": To("activation_checkpointing.enabled"),
    "enable_activation_offloading": To("activation_checkpointing.cpu_offload"),
    "batch_size": To("batch.micro_batch_size", reason="per rank"),
    "gradient_accumulation_steps": To("batch.gradient_accumulation_steps"),
    "clip_grad_norm": To("gradients.clip_max_norm"),
    "epochs": To("data.epochs"),
    "compile": Hook(read=_read_flag("torch.compile; torsh does not compile the model")),
    "optimizer_in_bwd": Hook(read=_read_flag("the optimizer steps each parameter during backward; torsh steps once "
                                             "per step")),
    "tensor_parallel_dim": Hook(read=_read_tensor_parallel, write=_write_tensor_parallel, claims=("parallelism.tp",
                                "parallelism.tp_plan", "parallelism.pp", "parallelism.cp")),
    "tensor_parallel_plan": Hook(read=_read_tensor_parallel_plan),
    "lr_scheduler": Unsupported("torchtune's scheduler component; build the schedule in the training script"),
}


#: A recipe config: ``_component_`` sections next to torchtune's training keys, among the keys its recipes read (a
#: recipe ignores the others); above the fsdp dialect's torchtune excerpts (0.95).
SHAPES = (Shape(0.97, ({"fsdp_cpu_offload", "enable_activation_checkpointing", "dtype", "checkpointer", "tokenizer"},),
                recipe_keys(), where=lambda raw: any(isinstance(v, dict) and "_component_" in v for v in raw.values()),
                lenient=True),)


class Torchtune(Dialect):
    NAME = NAME
    DEFAULT_FORMAT = "yaml"
    FIELD_MAP = _FIELDS
    GROUPS = _GROUPS
    def normalise(self, raw: Any, prepared: Prepared) -> Prepared:
        """Keys with no distributed meaning go around the map: noted as ignored and kept verbatim."""
        known = set(self.FIELD_MAP) | {k.split(".")[0] for g in self.GROUPS for k in g.keys}
        data = {}
        for key, value in raw.items():
            if key in known and not _interpolation(value):
                data[key] = value
                if not isinstance(value, dict):  # written back as spelt, a default included
                    prepared.kept[str(key)] = value
                continue
            fidelity, reason = Fidelity.IGNORED, ("not a distributed setting" if key in recipe_keys() else
                                                  "no torchtune 0.6.1 recipe reads it (torchtune ignores it)")
            if key in known:
                fidelity, reason = Fidelity.DROPPED, "an OmegaConf interpolation, resolved when torchtune loads the " \
                    "file: kept as written, not read"
            prepared.notes.append(Note(str(key), None, value, fidelity, reason))
            prepared.kept[str(key)] = value
        prepared.data = data
        return prepared

    def write_map(self, version: str | None) -> FieldMap:
        return FieldMap({k: v for k, v in _FIELDS.items() if isinstance(v, To) or (isinstance(v, Hook) and v.write)},
                        groups=_GROUPS)  # fmt: skip

    def finish_write(self, ctx: WriteContext, version: str | None) -> None:
        from ._torch_names import AUTO_SETTERS

        settle_auto(ctx, AUTO_SETTERS)

    def sniff(self, raw: Any) -> float:
        """A recipe config: ``_component_`` sections next to torchtune's training keys (``SHAPES``)."""
        return best(SHAPES, raw)


DIALECT = Torchtune()
globals().update(DIALECT.exports())
