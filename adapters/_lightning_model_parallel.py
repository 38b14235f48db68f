"""Lightning's ``ModelParallelStrategy(...)`` (Lightning 2.4+, read as 2.6 runs it): a 2D device mesh of
``data_parallel_size`` x ``tensor_parallel_size`` ranks, on which the LightningModule's ``configure_model`` applies
FSDP2 (``fully_shard``) over the data-parallel dimension and tensor parallelism over the other.

The constructor keeps its arguments unchecked; the strategy's set-up resolves ``"auto"`` (data-parallel: the number of
nodes, tensor-parallel: the devices of a node) and refuses sizes whose product is not the world size. The Trainer
refuses a precision other than 32-true, bf16-mixed, bf16-true and 16-true with this strategy.
"""

from __future__ import annotations

import difflib
from typing import Any

from torsh.config import TorshConfig
from torsh.errors import ConfigError, Problem
from torsh.translate import Fidelity, Note, Translation

NAME = "lightning"
STRATEGY = "ModelParallelStrategy"
#: ModelParallelStrategy's keyword arguments (Lightning 2.6); any other name is a TypeError in Lightning. Fabric's
#: class (lightning.fabric.strategies) also requires ``parallelize_fn``, the function that applies the parallelisms.
ARGUMENTS = ("data_parallel_size", "tensor_parallel_size", "save_distributed_checkpoint", "process_group_backend",
             "timeout")  # fmt: skip
FABRIC_ARGUMENTS = ("parallelize_fn", *ARGUMENTS)
#: The precisions the Trainer accepts with ModelParallelStrategy: (parameter dtype, autocast).
PRECISIONS = {"32-true": ("fp32", False), "bf16-mixed": ("bf16", True), "bf16-true": ("bf16", False),
              "16-true": ("fp16", False)}  # fmt: skip
#: Lightning's short spellings, as its precision parser unifies them.
_UNIFIED = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
_KNOWN = ("16-mixed", "64-true", "transformer-engine", "transformer-engine-float16", *PRECISIONS)


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _precision(raw: dict, launch: tuple[str, ...], problems: list[Problem]) -> tuple[str, tuple[str, bool]] | None:
    """The Trainer's / Fabric's precision, when it names one Lightning knows: (where, (dtype, autocast))."""
    found = None
    for section in launch:
        if "precision" not in raw[section]:
            continue
        value = raw[section]["precision"]
        text = _UNIFIED.get(str(value), str(value))
        if text in PRECISIONS:
            found = (f"{section}.precision", PRECISIONS[text])
        elif text in _KNOWN:
            problems.append(Problem(f"{section}.precision", value, "Lightning refuses this precision with "
                                    f"ModelParallelStrategy; choose one of {', '.join(PRECISIONS)}"))  # fmt: skip
    return found


def _sizes(args: dict, devices: int | None, nodes: int, problems: list[Problem]) -> dict[str, int | None]:
    """Each size as the strategy's set-up resolves it (None: "auto" on devices the file does not count)."""
    sizes: dict[str, int | None] = {}
    for key, auto in (("data_parallel_size", nodes), ("tensor_parallel_size", devices)):
        value = args.get(key, "auto")
        if value == "auto":
            sizes[key] = auto
        elif _is_size(value):
            sizes[key] = value
        else:
            problems.append(Problem(f"{STRATEGY}.{key}", value, "a positive number of processes, or \"auto\" "
                                    "(Lightning multiplies the two sizes and builds its device mesh from them when "
                                    "the strategy sets up)"))  # fmt: skip
    dp, tp = sizes.get("data_parallel_size"), sizes.get("tensor_parallel_size")
    if dp is not None and tp is not None and devices is not None and dp * tp != devices * nodes:
        key = "tensor_parallel_size" if "tensor_parallel_size" in args else "data_parallel_size"
        problems.append(Problem(f"{STRATEGY}.{key}", args.get(key, "auto"), f"Lightning requires data_parallel_size "
                                f"({dp}) x tensor_parallel_size ({tp}) to equal the world size ({devices * nodes}: "
                                f"{devices} devices x {nodes} nodes)"))  # fmt: skip
    return sizes


def _unknown_arguments(args: dict, fabric: bool) -> list[Problem]:
    """Arguments the strategy does not have (a TypeError in Lightning); Fabric's needs ``parallelize_fn``."""
    known = FABRIC_ARGUMENTS if fabric else ARGUMENTS
    problems = [Problem(f"{STRATEGY}.{k}", args[k], f"{'Fabric' if fabric else 'the Trainer'}'s ModelParallelStrategy "
                        "has no such argument" + (f" (did you mean {close[0]!r}?)" if (
                            close := difflib.get_close_matches(str(k), known, 1)) else ""))
                for k in args if k not in known]  # fmt: skip
    if fabric and "parallelize_fn" not in args:
        problems.append(Problem(f"{STRATEGY}.parallelize_fn", None, "Fabric's ModelParallelStrategy requires the "
                                "function that parallelizes the model"))  # fmt: skip
    return problems


def _save_distributed(args: dict, problems: list[Problem]) -> bool:
    """save_distributed_checkpoint as Lightning tests it (for truth: a null is false, a text is refused here)."""
    save = args.get("save_distributed_checkpoint", True)
    if not isinstance(save, (bool, type(None))):
        problems.append(Problem(f"{STRATEGY}.save_distributed_checkpoint", save, "Lightning tests it for truth (the "
                                "text \"false\" saves a distributed checkpoint): write true or false"))  # fmt: skip
    return bool(save)


_AUTO_TP = "\"auto\": the devices of a node; "
_TP = ("the LightningModule's configure_model splits its layers over the tensor_parallel mesh dimension; torsh splits "
       "the model's linear layers with its default plan (DTensor)")  # fmt: skip


def _tp_note(args: dict, tp: int | None) -> Note:
    where = f"{STRATEGY}.tensor_parallel_size"
    if tp is None:
        return Note(where, "parallelism.tp", "auto", Fidelity.APPROXIMATE, "\"auto\": the devices of a node, which "
                    "the file does not count (Trainer devices): torsh reads no tensor parallelism; give the size or "
                    "the devices")  # fmt: skip
    given = "" if "tensor_parallel_size" in args else _AUTO_TP
    return Note(where, "parallelism.tp", args.get("tensor_parallel_size", "auto"), Fidelity.APPROXIMATE if tp > 1 else
                Fidelity.EXACT, given + (_TP if tp > 1 else "no tensor parallelism"))  # fmt: skip


def _dp_note(args: dict) -> Note:
    given = "" if "data_parallel_size" in args else "\"auto\": the number of nodes; "
    return Note(f"{STRATEGY}.data_parallel_size", "sharding.stage", args.get("data_parallel_size", "auto"),
                Fidelity.APPROXIMATE, given + "the LightningModule's configure_model shards over the data_parallel "
                "mesh dimension (FSDP2 fully_shard, ZeRO-3 as Lightning's examples apply it); torsh shards there "
                "itself")  # fmt: skip


def _save_note(args: dict, save: bool) -> Note:
    value = args.get("save_distributed_checkpoint", True)
    return Note(f"{STRATEGY}.save_distributed_checkpoint", "checkpoint.state_dict_type", value, Fidelity.EXACT if
                "save_distributed_checkpoint" in args else Fidelity.DEFAULTED, ("null: false to Lightning's truth "
                "test; " if value is None else "") + ("one file per rank" if save else "one full checkpoint gathered "
                "on rank 0"))  # fmt: skip


def _run_notes(args: dict) -> list[Note]:
    """Arguments about how Lightning runs, and the Fabric function that applies the parallelisms."""
    notes = [Note(f"{STRATEGY}.{key}", None, args[key], Fidelity.IGNORED, "how Lightning runs")
             for key in ("process_group_backend", "timeout") if key in args]  # fmt: skip
    if "parallelize_fn" in args:
        notes.append(Note(f"{STRATEGY}.parallelize_fn", None, args["parallelize_fn"], Fidelity.APPROXIMATE, "the "
                          "script's function applies the parallelisms to the mesh; torsh applies FSDP2 and its "
                          "default tensor-parallel plan itself"))  # fmt: skip
    return notes


def read(raw: dict, counts: dict[str, int], notes: list[Note]) -> Translation[TorshConfig]:
    """``ModelParallelStrategy`` with the Trainer's / Fabric's devices, nodes and precision (``counts``: the device
    and node counts the launch sections give, already checked; ``notes``: theirs)."""
    args = raw[STRATEGY]
    problems = _unknown_arguments(args, "Trainer" not in raw and ("Fabric" in raw or "parallelize_fn" in args))
    precision = _precision(raw, tuple(s for s in ("Trainer", "Fabric") if isinstance(raw.get(s), dict)), problems)
    sizes = _sizes(args, counts.get("nproc_per_node"), counts.get("nnodes", 1), problems)
    save = _save_distributed(args, problems)
    if problems:
        raise ConfigError(problems, source=NAME)
    tp = sizes["tensor_parallel_size"]
    update: dict[str, Any] = {"sharding": {"stage": 3}, "launch": {**counts, **_world_size(sizes)},
                              "parallelism": {"tp": tp or 1},
                              "checkpoint": {"state_dict_type": "sharded" if save else "full"}}  # fmt: skip
    notes += [_tp_note(args, tp), _dp_note(args), _save_note(args, save), *_run_notes(args)]
    if precision is not None:
        update["precision"] = _read_precision(raw, precision, notes)
    cfg = TorshConfig.model_validate(update)
    return Translation(cfg, notes, NAME, "torsh")


def _world_size(sizes: dict[str, int | None]) -> dict[str, int]:
    """The world size the two sizes make, when both are known."""
    dp, tp = sizes["data_parallel_size"], sizes["tensor_parallel_size"]
    return {} if dp is None or tp is None else {"world_size": dp * tp}


def _read_precision(raw: dict, precision: tuple[str, tuple[str, bool]], notes: list[Note]) -> dict[str, Any]:
    source, (dtype, autocast) = precision
    notes.append(Note(source, "precision.param_dtype", raw[source.split(".")[0]]["precision"], Fidelity.EXACT,
                      "fp32 parameters, the forward under autocast" if autocast else "parameters in this dtype"))
    return {"param_dtype": dtype, "autocast": autocast}
