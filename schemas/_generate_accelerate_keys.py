"""Regenerate ``keys/accelerate.json``: every key of an Accelerate config file, taken from Accelerate's own code.

A maintenance tool for an Accelerate version bump; it needs the pinned Accelerate installed:
``python -m torsh.schemas._generate_accelerate_keys [OUT]`` (default: ``keys/accelerate.json`` next to this file).

Where the keys come from:

- top level: the fields of ``ClusterConfig`` (with ``BaseConfig``'s) and of ``SageMakerConfig`` — Accelerate refuses
  any other top-level key — plus the legacy keys ``BaseConfig.process_config`` converts (``fp16``,
  ``dynamo_backend``); type and default from the dataclass, allowed values from Accelerate's enums;
- sections (``deepspeed_config``, ``fsdp_config``, ...): ``accelerate launch`` copies every key of these onto its
  arguments (``fsdp_config.x`` as ``fsdp_x``), so a section's keys are the launcher's arguments of that group (type,
  default and choices from its argument parser), the ones ``accelerate/utils/launch.py`` reads that have no flag
  (``fsdp_ignored_modules``), and the ones the ``accelerate config`` questionnaire writes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import json
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

#: Each dict section of the config file, the launcher's argument group its keys become, and the prefix
#: ``accelerate launch`` adds to a key written without it (None: the key is used as written).
SECTIONS = {
    "deepspeed_config": ("DeepSpeed Arguments", None),
    "fsdp_config": ("FSDP Arguments", "fsdp_"),
    "fp8_config": ("FP8 Arguments", "fp8_"),
    "dynamo_config": ("Resource Selection Arguments", "dynamo_"),
    "megatron_lm_config": ("Megatron-LM Arguments", None),
    "parallelism_config": ("ParallelismConfig Arguments", None),
    "mpirun_config": ("MPI Arguments", None),
}
_JSON = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object", list: "array",
         tuple: "array", type(None): "null"}  # fmt: skip


def _json_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


def _field_entry(field: dataclasses.Field) -> dict[str, Any]:
    """A dataclass field: its JSON types and default (``commands: list[str] = None`` also allows null)."""
    entry: dict[str, Any] = {"types": annotation_types(field.type)}
    if field.default is not dataclasses.MISSING:
        entry["default"] = _json_value(field.default)
        if field.default is None and "null" not in entry["types"]:
            entry["types"] = sorted([*entry["types"], "null"])
    return entry


def annotation_types(annotation: Any) -> list[str]:
    """The JSON types a dataclass field annotation allows (``Optional[str]``: string, null)."""
    if isinstance(annotation, str):  # a postponed annotation
        annotation = eval(annotation, vars(typing))  # noqa: S307 - Accelerate's own source, at development time
    if typing.get_origin(annotation) is typing.Union:
        return sorted({t for arg in typing.get_args(annotation) for t in annotation_types(arg)})
    origin = typing.get_origin(annotation) or annotation
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        return ["string"]
    return [_JSON.get(origin, "any")]


def _enum_values(*enums: type[enum.Enum]) -> list[str]:
    return sorted({member.value for e in enums for member in e})


def top_level() -> dict[str, dict]:
    """The top-level keys of a local-machine config (``ClusterConfig``)."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import ComputeEnvironment, DistributedType, PrecisionType, SageMakerDistributedType

    choices = {"compute_environment": _enum_values(ComputeEnvironment),
               "distributed_type": _enum_values(DistributedType, SageMakerDistributedType),
               "mixed_precision": _enum_values(PrecisionType)}  # fmt: skip
    filled, table = filled_defaults(), {}
    for field in dataclasses.fields(ClusterConfig):
        entry = _field_entry(field)
        if "default" not in entry and field.name in filled:  # process_config fills it in
            entry["default"] = filled[field.name]
            if filled[field.name] is None:
                entry["types"] = sorted({*entry["types"], "null"})
        elif "default" not in entry:
            entry["required"] = True
        if field.name in choices:
            entry["choices"] = choices[field.name]
        table[field.name] = entry
    for key, entry in legacy_keys().items():
        table.setdefault(key, entry)
    return dict(sorted(table.items()))


def _process_config() -> ast.AST:
    from accelerate.commands.config.config_args import BaseConfig

    return ast.parse(textwrap.dedent(inspect.getsource(BaseConfig.process_config)))


def _constant(node: ast.AST) -> Any:
    """A default written in ``process_config``: a literal, or an enum member (``ComputeEnvironment.LOCAL_MACHINE``)."""
    if isinstance(node, ast.Attribute):
        return node.attr
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None  # computed from another key (mixed_precision from the legacy fp16)


def filled_defaults() -> dict[str, Any]:
    """Keys ``BaseConfig.process_config`` fills in when the file leaves them out (``use_cpu: false``)."""
    found = {}
    for node in ast.walk(_process_config()):
        # if "use_cpu" not in config_dict: config_dict["use_cpu"] = False
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Constant)
                and isinstance(node.test.ops[0], ast.NotIn)):  # fmt: skip
            for stmt in node.body:
                if (isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Subscript)
                        and isinstance(stmt.targets[0].slice, ast.Constant)
                        and stmt.targets[0].slice.value == node.test.left.value):  # fmt: skip
                    found[node.test.left.value] = _constant(stmt.value)
    return found


def legacy_keys() -> dict[str, dict]:
    """Keys ``BaseConfig.process_config`` accepts and converts before the dataclass sees them (``fp16``)."""
    from accelerate.commands.config.config_args import ClusterConfig

    fields = {f.name for f in dataclasses.fields(ClusterConfig)}
    found = {}
    for node in ast.walk(_process_config()):
        # ``if "fp16" in config_dict:`` — a key the method looks for
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and isinstance(node.ops[0], ast.In):
            key = node.left.value
            if key not in fields:
                found[key] = {"types": ["any"], "legacy": "converted by BaseConfig.process_config"}
    return found


def sagemaker_keys() -> dict[str, dict]:
    """The keys only a SageMaker config (``compute_environment: AMAZON_SAGEMAKER``) has."""
    from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig

    local = {f.name for f in dataclasses.fields(ClusterConfig)}
    table = {}
    for field in dataclasses.fields(SageMakerConfig):
        if field.name in local:
            continue
        entry = _field_entry(field)
        if "default" not in entry:
            entry["required"] = True
        table[field.name] = entry
    return dict(sorted(table.items()))


def _action_entry(action: argparse.Action) -> dict[str, Any]:
    """A launcher argument: the type its flag converts to, its default and its choices. A config file's value is
    copied onto the arguments as written (no conversion); the launcher then passes it on as a string."""
    if action.nargs == 0 and isinstance(action.const, bool):  # a store_true flag (Accelerate has its own actions)
        cli_type = "boolean"
    else:
        name = getattr(action.type, "__name__", None)
        cli_type = {"int": "integer", "float": "number", "str": "string", "bool": "boolean",
                    "str_to_bool": "boolean"}.get(name, "any")  # fmt: skip
    entry: dict[str, Any] = {"cli_type": cli_type, "default": _json_value(action.default),
                             "read_by": ["launch argument"]}  # fmt: skip
    if action.choices:
        entry["cli_choices"] = list(action.choices)
    return entry


def _launch_reads() -> set[str]:
    """Argument names ``accelerate/utils/launch.py`` reads (``args.x`` and ``getattr(args, "x", ...)``)."""
    import accelerate.utils.launch as launch

    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(launch))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):  # fmt: skip
            names.add(node.args[1].value)
    return names


def _questionnaire_writes() -> dict[str, set[str]]:
    """Per section, the keys the ``accelerate config`` questionnaire writes (``fsdp_config["fsdp_x"] = ...``)."""
    import accelerate.commands.config.cluster as cluster

    writes: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(inspect.getsource(cluster))):
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                and isinstance(node.slice, ast.Constant) and node.value.id in SECTIONS):  # fmt: skip
            writes.setdefault(node.value.id, set()).add(node.slice.value)
    return writes


def sections() -> dict[str, dict]:
    """The keys of each dict section, as the launcher names them."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    groups = {group.title: group._group_actions for group in parser._action_groups}
    reads, writes = _launch_reads(), _questionnaire_writes()
    out = {}
    for section, (title, prefix) in SECTIONS.items():
        keys: dict[str, dict] = {}
        for action in groups[title]:
            if prefix is None or action.dest.startswith(prefix):
                keys[action.dest] = _action_entry(action)
        if prefix:  # keys launch.py reads under the section's prefix with no launcher flag
            for name in sorted(reads - set(keys)):
                if name.startswith(prefix):
                    keys[name] = {"cli_type": "any", "read_by": ["accelerate/utils/launch.py"]}
        for name in sorted(writes.get(section, ())):
            full = name if prefix is None or name.startswith(prefix) else prefix + name
            keys.setdefault(full, {"cli_type": "any", "read_by": []})["read_by"].append("accelerate config")
        out[section] = {"prefix_added_by_launcher": prefix, "keys": dict(sorted(keys.items()))}
    return out


def launch_options() -> dict[str, dict]:
    """Every option of ``accelerate launch``: its spellings, whether it takes a value, and its argument group."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    group_of = {id(action): group.title for group in parser._action_groups for action in group._group_actions}
    out: dict[str, dict] = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        entry = out.setdefault(action.dest, {"flags": [], "takes_value": action.nargs != 0,
                                             "group": group_of.get(id(action))})  # fmt: skip
        entry["flags"] += action.option_strings
    return dict(sorted(out.items()))


def build() -> dict:
    """The whole table."""
    import accelerate

    return {
        "framework": "accelerate",
        "version": accelerate.__version__,
        "description": "Keys of an Accelerate config file (accelerate launch --config_file), generated from "
        "Accelerate's own code by schemas/_generate_accelerate_keys.py. Accelerate refuses unknown top-level keys "
        "(types: the dataclass annotation; choices: the enum's values). A section's keys are copied onto the "
        "launcher's arguments as written (prefix_added_by_launcher is added to a key written without it) and "
        "passed on as strings: cli_type, default and cli_choices are those of the launcher's flag.",
        "top_level": top_level(),
        "sagemaker": sagemaker_keys(),
        "sections": sections(),
        "launch_options": launch_options(),
    }


def render(table: dict) -> str:
    """The canonical text of a key table file."""
    return json.dumps(table, indent=2) + "\n"


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("keys") / "accelerate.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(render(build()), encoding="utf-8")
    print(f"wrote {out}")
