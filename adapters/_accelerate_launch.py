"""The launch keys of an ``accelerate config`` YAML as ``accelerate launch`` (1.15) reads them: the kind of job
(``distributed_type``), the process and machine counts, the GPU ids, and which nulls mean "not set".

ClusterConfig checks no types; ``accelerate launch`` compares the counts with 1, hands num_processes to torchrun's
--nproc_per_node, and writes section keys into the environment of the training process. What it runs is read here
(with a note where a flag must be passed at launch); what it fails on is refused, naming the key.
"""

from __future__ import annotations

from typing import Any

from torsh.errors import ConfigError, Problem
from torsh.translate import Fidelity, Note, ReadContext

NAME = "accelerate"
_LAUNCHER = "a launcher or environment setting, not a training setting"

_DDP_TYPES = {"MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_HPU",
              "MULTI_NEURON"}  # fmt: skip
_OTHER_TYPES = {"NO", "FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"}
#: SageMakerDistributedType: the kinds of a compute_environment AMAZON_SAGEMAKER file (SageMaker launches them).
_SAGEMAKER_TYPES = {"NO", "DATA_PARALLEL", "MODEL_PARALLEL"}
#: The kinds ``accelerate launch`` starts through torchrun (its multi-GPU and single-machine DeepSpeed launchers):
#: the only ones where a num_processes that is not an int reaches a launcher that reads it (torchrun's
#: --nproc_per_node takes "auto" and a number as text). The others compare num_processes with 1 first and fail.
_TORCHRUN_TYPES = (_DDP_TYPES - {"MULTI_CPU"}) | {"FSDP", "DEEPSPEED", "MEGATRON_LM"}


def _kind_of(value: Any) -> str:
    """The distributed_type as Accelerate's launcher acts on it: YAML reads an unquoted ``NO``/``no`` as false (and
    ``yes`` as true); ClusterConfig keeps the boolean, and ``accelerate launch`` then picks none of its multi-process
    launchers: a single process, as NO."""
    return "NO" if isinstance(value, bool) else str(value).upper()


def _kind(ctx: Any) -> str:
    return _kind_of(ctx.raw.get("distributed_type", "NO"))


def _read_distributed_type(value: Any, ctx: ReadContext, path: str) -> None:
    """Accelerate's enums match the exact spelling (DistributedType("multi_gpu") raises); a YAML boolean is kept by
    its loader and launched as a single process (see :func:`_kind_of`)."""
    sagemaker = str(ctx.raw.get("compute_environment", "")).upper() == "AMAZON_SAGEMAKER"
    known = sorted(_SAGEMAKER_TYPES if sagemaker else _DDP_TYPES | _OTHER_TYPES)
    if isinstance(value, bool):
        ask = "" if "num_processes" in ctx.raw else ("; with no num_processes, accelerate launch asks for "
                                                      "--num_processes (Accelerate gives 1 only to the string 'NO')")
        ctx.note(path, Fidelity.EXACT, f"{str(value).lower()}: YAML reads an unquoted no/yes as a boolean; "
                 f"accelerate launch runs it as NO, a single process (write 'NO', quoted){ask}", value)
        ctx.keep(path, "NO")
        ctx.set("sharding.stage", 0, path, Fidelity.EXACT, "a single process", note=False)
        return
    kind = str(value).upper()
    if value not in known:
        from torsh.errors import did_you_mean

        why = (f"Accelerate spells it {kind} (its enum matches capitals only)" if kind in known else
               f"unknown distributed_type; expected one of {', '.join(known)}")  # fmt: skip
        ctx.problem(path, value, why, did_you_mean(kind, known))
        return
    ctx.keep(path, kind)
    if kind in _SAGEMAKER_TYPES - {"NO"}:
        ctx.note(path, Fidelity.UNSUPPORTED, f"{kind}: SageMaker's own distributed library; torsh runs "
                 "torch.distributed jobs", value)  # fmt: skip
        return
    if kind in ("NO",) or kind in _DDP_TYPES:
        ctx.set("sharding.stage", 0, path, Fidelity.EXACT, "DDP" if kind != "NO" else "a single process")
    elif kind in ("MEGATRON_LM", "XLA"):
        ctx.note(path, Fidelity.UNSUPPORTED, f"{kind}: tensor/model parallel or TPU training; torsh runs data "
                 "parallel jobs", value)  # fmt: skip
    else:
        ctx.note(path, Fidelity.EXACT, f"{kind}: read from {kind.lower()}_config", value)


#: num_processes as accelerate launch reads it: kind -> (read as the world size?, fidelity, why).
_NUM_PROCESSES = {
    "auto": (False, Fidelity.DEFERRED, "one process per visible accelerator: accelerate launch passes it to torchrun "
             "--nproc_per_node auto"),
    "text": (True, Fidelity.EXACT, "a number as text: torchrun reads it as one"),
    "count": (True, Fidelity.EXACT, "processes over all machines"),
    "unstated": (False, Fidelity.EXACT, "-1 is Accelerate's 'not stated': accelerate launch refuses this file unless "
                 "--num_processes N is passed"),
    "null_to_torchrun": (False, Fidelity.DEFERRED, "null: accelerate launch hands it to torchrun, which fails on it, "
                         "unless --num_processes N is passed"),
    "null": (False, Fidelity.EXACT, "every visible accelerator (decided at launch)"),
}  # fmt: skip


#: How each kind of num_processes is told, in order (the first that matches).
_NUM_PROCESSES_KINDS = (
    ("auto", lambda v: v == "auto"),
    ("text", lambda v: isinstance(v, str) and v.strip().isdigit() and int(v) > 0),
    ("count", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0),
    ("unstated", lambda v: v == -1 and not isinstance(v, bool)),
    ("null", lambda v: v is None),
)


def _num_processes_kind(value: Any, kind: str) -> str | None:
    """Which of ``_NUM_PROCESSES`` a value is (None: none, refused), for a job of this distributed_type."""
    found = next((name for name, test in _NUM_PROCESSES_KINDS if test(value)), None)
    return "null_to_torchrun" if found == "null" and kind in _TORCHRUN_TYPES else found


def _read_num_processes(value: Any, ctx: ReadContext, path: str) -> None:
    """num_processes: a positive count; -1 is Accelerate's own "not stated" default (``accelerate launch`` then
    demands --num_processes); null lets the launcher count the visible accelerators. "auto" and a number as text
    reach torchrun's --nproc_per_node as they are, for the kinds launched through torchrun on one machine (the
    other launchers compare the value with 1 and fail). Anything else is refused."""
    if isinstance(value, str) and ctx.raw.get("use_cpu"):
        raise ConfigError([Problem(path, value, "with use_cpu set (to anything but false or empty), accelerate launch "
                                   "compares num_processes with 1 and fails on text: write the number of processes")],
                          source=NAME)  # fmt: skip
    found = _num_processes_kind(value, _kind(ctx))
    if found is None:
        raise ConfigError([Problem(path, value, "num_processes must be a positive process count (or -1 for 'pass "
                                   "--num_processes at launch'); set it to the number of processes over all "
                                   "machines")], source=NAME)  # fmt: skip
    if found in ("auto", "text"):
        _check_torchrun_reads(value, ctx, path)
    world, fidelity, why = _NUM_PROCESSES[found]
    if world:
        ctx.set("launch.world_size", int(value), path, fidelity, why)
    else:
        ctx.note(path, fidelity, why, value)


def _check_torchrun_reads(value: Any, ctx: ReadContext, path: str) -> None:
    """Text reaches torchrun's --nproc_per_node only for the kinds launched through torchrun on one machine."""
    kind, machines = _kind(ctx), ctx.raw.get("num_machines", 1)
    one_machine = isinstance(machines, int) and machines <= 1 or machines is None
    if kind in _TORCHRUN_TYPES and one_machine:
        return
    where = (f"distributed_type {kind}" if kind not in _TORCHRUN_TYPES else
             f"num_machines {machines} (it divides num_processes by it)")  # fmt: skip
    raise ConfigError([Problem(path, value, f"accelerate launch fails on a num_processes that is not a number with "
                               f"{where}; give the number of processes over all machines")], source=NAME)  # fmt: skip


def _read_gpu_ids(value: Any, ctx: ReadContext, path: str) -> None:
    """CUDA_VISIBLE_DEVICES; accelerate launch refuses fewer than two ids for a multi-GPU job on one machine."""
    machines = ctx.raw.get("num_machines", 1)
    multi = _kind(ctx) in _TORCHRUN_TYPES - {"DEEPSPEED", "FSDP", "MEGATRON_LM"} and not (
        isinstance(machines, int) and machines > 1)  # fmt: skip
    if multi and isinstance(value, str) and value != "all" and len(value.split(",")) < 2:
        ctx.problem(path, value, "accelerate launch refuses fewer than two GPU ids for a multi-GPU job: give two or "
                    "more, comma-separated, or all")  # fmt: skip
        return
    ctx.note(path, Fidelity.IGNORED, "CUDA_VISIBLE_DEVICES: " + _LAUNCHER, value)
    ctx.keep(path, value)


def _read_nullable(core_path: str):
    def hook(value: Any, ctx: ReadContext, path: str) -> None:
        if value is None:
            ctx.note(path, Fidelity.EXACT, "not set", None)
        else:
            ctx.set(core_path, value, path)

    return hook


#: Top-level keys whose null is Accelerate's "not set": ClusterConfig makes an empty section of a null one, and the
#: launcher reads a null mixed_precision as "no". (num_processes, main_process_ip/port and dynamo_config give null a
#: meaning of their own: their rules read it.)
_NULL_IS_DEFAULT = ("mixed_precision", "deepspeed_config", "fsdp_config", "parallelism_config", "fp8_config",
                    "megatron_lm_config", "mpirun_config", "tpu_vm")  # fmt: skip
#: Top-level keys whose null ClusterConfig loads but ``accelerate launch`` cannot use without a flag: left to the
#: launch (DEFERRED), with what to do.
_NULL_IS_LEFT_TO_LAUNCH = {
    "num_machines": "null: accelerate launch fails on it (it compares it with 1) unless --num_machines N is passed; "
                    "write 1 for one machine. torsh reads one machine",
}
_SECTIONS = ("deepspeed_config", "fsdp_config")
#: fsdp_config keys accelerate launch always writes into the FSDP plugin's environment (``str(value)``): a null
#: becomes the text "None", which the plugin refuses. It tests the others with ``is not None`` (null: the default).
_FSDP_NULL_REFUSED = tuple(f"fsdp_{k}" for k in (
    "version", "sharding_strategy", "reshard_after_forward", "offload_params", "min_num_params", "forward_prefetch",
    "use_orig_params", "cpu_ram_efficient_loading", "sync_module_states", "activation_checkpointing"))


#: fsdp_config keys Accelerate's FSDP plugin does not read for an fsdp_version: accelerate launch writes them into
#: the environment and the plugin passes them over (FSDP1 takes its strategy from fsdp_sharding_strategy alone; FSDP2
#: always uses the original parameters and has no forward prefetch), so any value runs.
FSDP_UNREAD = {1: ("fsdp_reshard_after_forward",),
               2: ("fsdp_sharding_strategy", "fsdp_use_orig_params", "fsdp_forward_prefetch",
                   "fsdp_sync_module_states")}  # fmt: skip


def fsdp_version_of(raw: dict) -> int | None:
    """The fsdp_version a file's FSDP plugin runs (1 when unset); None for a value that is not 1 or 2."""
    section = raw.get("fsdp_config")
    value = section.get("fsdp_version", 1) if isinstance(section, dict) else 1
    try:
        version = float(str(value))  # YAML may give 2, "2" or 2.0; Accelerate reads an int
    except ValueError:
        return None
    return int(version) if version in (1.0, 2.0) else None


def fsdp_unread(raw: dict) -> tuple[str, ...]:
    """The fsdp_config keys the FSDP plugin does not read for this file: by fsdp_version, and fsdp_min_num_params
    without SIZE_BASED_WRAP. (A null fsdp_sync_module_states is still refused: accelerate launch tests it against
    fsdp_cpu_ram_efficient_loading.)"""
    section = raw.get("fsdp_config")
    if _kind_of(raw.get("distributed_type")) != "FSDP" or not isinstance(section, dict):
        return ()
    unread = FSDP_UNREAD.get(fsdp_version_of(raw) or 0, ())
    if str(section.get("fsdp_auto_wrap_policy", "")).upper() != "SIZE_BASED_WRAP":
        unread += ("fsdp_min_num_params",)
    return unread


def _null_use_cpu(raw: dict) -> Note:
    """use_cpu: the one-process and CPU launchers read it as a truth value (the text 'None' fails there); the
    torchrun and DeepSpeed launchers pass it over."""
    if _kind_of(raw.get("distributed_type", "NO")) not in _TORCHRUN_TYPES:
        raise ConfigError([Problem("use_cpu", None, "null: accelerate launch's one-process and CPU launchers read it "
                                   "as a truth value and fail ('invalid truth value none'); write true or false, or "
                                   "remove the key")], source=NAME)  # fmt: skip
    return Note("use_cpu", None, None, Fidelity.EXACT, "null: not set (this launcher does not read it)")


#: What a top-level null means to accelerate launch, where it means "not set": key -> (fidelity, why).
_TOP_NULLS = {**dict.fromkeys(_NULL_IS_DEFAULT, (Fidelity.EXACT, "null: not set, Accelerate's default applies")),
              **{k: (Fidelity.DEFERRED, why) for k, why in _NULL_IS_LEFT_TO_LAUNCH.items()}}  # fmt: skip
#: A section every key of which was a null: taken out whole.
_EMPTIED = object()


def _without_nulls(raw: dict) -> tuple[dict, list[Note]]:
    """Nulls that mean "not set" to Accelerate (the launcher tests section keys with ``is not None``), taken out
    with a note so the defaults apply as they do in Accelerate."""
    notes, clean = [], {}
    for key, value in raw.items():
        note = _top_null(key, raw) if value is None else None
        if note is not None:
            notes.append(note)
            continue
        value = _section_without_nulls(key, value, raw, notes)
        if value is not _EMPTIED:
            clean[key] = value
    return clean, notes


def _top_null(key: str, raw: dict) -> Note | None:
    """The note of a top-level null that means "not set" (None: the null stays, for the key's own rule)."""
    if key == "use_cpu":
        return _null_use_cpu(raw)
    return Note(key, None, None, *_TOP_NULLS[key]) if key in _TOP_NULLS else None


def _section_without_nulls(key: str, value: Any, raw: dict, notes: list[Note]) -> Any:
    """A section without its nulls, each noted (``_EMPTIED`` when nothing else was in it)."""
    if not isinstance(value, dict):
        return value
    if key == "fsdp_config":
        value = _fsdp_without_nulls(value, raw, notes)
    if key not in _SECTIONS or None not in value.values():
        return value
    notes += [Note(f"{key}.{k}", None, None, Fidelity.EXACT, "null: not set, Accelerate's default applies")
              for k, v in value.items() if v is None]  # fmt: skip
    return {k: v for k, v in value.items() if v is not None} or _EMPTIED


def _fsdp_without_nulls(section: dict, raw: dict, notes: list[Note]) -> dict:
    """fsdp_config without the nulls of keys the plugin does not read here; a null the launcher passes on as the
    text 'None' to a key the plugin reads is refused."""
    nulls = [k for k in fsdp_unread(raw) if k != "fsdp_sync_module_states" and section.get(k, 0) is None]
    notes += [Note(f"fsdp_config.{k}", None, None, Fidelity.IGNORED, "null: Accelerate's FSDP plugin does not read "
                   "this key here") for k in nulls]  # fmt: skip
    section = {k: v for k, v in section.items() if k not in nulls}
    if _kind_of(raw.get("distributed_type")) == "FSDP":  # another kind does not read fsdp_config
        _refuse_passed_nulls(section)
    return section


def _refuse_passed_nulls(section: dict) -> None:
    refused = [k for k in _FSDP_NULL_REFUSED if k in section and section[k] is None]
    if refused:
        raise ConfigError([Problem(f"fsdp_config.{k}", None, "null: accelerate launch passes it on as the text 'None', "
                                   "which Accelerate's FSDP plugin refuses; remove the key for its default")
                           for k in sorted(refused, key=list(section).index)], source=NAME)  # fmt: skip
