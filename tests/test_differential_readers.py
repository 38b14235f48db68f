"""torsh's readers accept what each framework accepts: the framework's own parser and torsh's reader run on the same
inputs and must agree.

Agreement, per input:
* the framework accepts -> torsh reads it (notes may say what the framework does with the value);
* the framework refuses -> torsh refuses with a located error, or reads it with a lossy note on that key (so
  ``--strict`` fails): torsh is a migration tool and reads keys a framework version removed, to say what replaces them.
Where torsh refuses what a framework accepts on purpose, the case is listed in the dialect's ``DELIBERATE`` table with
the reason, and asserted to stay refused.

Inputs: every corpus file of the dialect, plus deterministic mutations of them driven by their keys (drop a key, add
an unknown one, null, "auto", booleans and numbers as text, a wrong type). The real frameworks are the installed ones
(DeepSpeed 0.19.8, accelerate 1.15, transformers 5.x, torchtitan 0.2.2); Horovod 0.28.1 does not build here, so its
config parser is loaded alone from the sdist in ``.venv/sdist``.
"""

from __future__ import annotations

import copy
import json
import os
import random
import tarfile
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from torsh import adapters
from torsh.errors import ConfigError
from torsh.formats import load_file
from torsh.translate import Fidelity, Translation

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "fixtures" / "corpus"
HOROVOD_SDIST = ROOT / ".venv" / "sdist" / "horovod-0.28.1.tar.gz"
#: Mutated inputs per dialect in this (fast) run; tests/fuzz_long.py may raise it.
MUTATIONS = int(os.environ.get("TORSH_DIFFERENTIAL_MUTATIONS", "120"))


def _budget(factor: float) -> int:
    """A dialect's share: in the fast run, weighted by what its comparison costs; in a long run (1,000 or more),
    MUTATIONS for every dialect."""
    return MUTATIONS if MUTATIONS >= 1000 else int(MUTATIONS * factor)


def torsh_reads(raw: Any, dialect: str, **kw: Any) -> Translation | ConfigError:
    try:
        return adapters.read(copy.deepcopy(raw), dialect, **kw)
    except ConfigError as exc:
        return exc


def lossy_at(result: Translation, key: str) -> bool:
    """A lossy note on ``key``, inside it or on a section holding it (what ``--strict`` fails on)."""
    return any(n.lossy and (n.source_path == key or n.source_path.startswith(key + ".") or
                            key.startswith(n.source_path + ".")) for n in result.notes)  # fmt: skip


def notes_at(result: Translation, key: str) -> list:
    return [n for n in result.notes if n.source_path == key]


# ---- the listed cases ---------------------------------------------------------------------------------------------


def test_deepspeed_steps_per_print_auto_is_read_as_deepspeed_accepts_it():
    """DeepSpeedConfig keeps "auto" as it is; Accelerate's DeepSpeed plugin (also under the HF Trainer) replaces
    it with inf. torsh reads it with a deferred note that says so, and what plain DeepSpeed would do."""
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": "auto"}
    assert DeepSpeedConfig(dict(raw)).steps_per_print == "auto"
    t = torsh_reads(raw, "deepspeed")
    assert isinstance(t, Translation)
    (note,) = notes_at(t, "steps_per_print")
    assert note.fidelity is Fidelity.DEFERRED and "inf" in note.reason and "first step()" in note.reason
    assert t.result.monitoring.steps_per_print is None


@pytest.mark.parametrize("value", [1, 0])
def test_deepspeed_top_level_switches_written_as_0_or_1_are_read_as_deepspeed_tests_them(value):
    """DeepSpeed reads its top-level switches with dict.get and tests them for truth; its own ZeRO tests write
    ``"zero_allow_untested_optimizer": 1``. torsh reads 0 and 1 as false and true; other numbers stay refused."""
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is the parser compared with")
    raw = {"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": value,
           "wall_clock_breakdown": value, "prescale_gradients": value}  # fmt: skip
    assert _deepspeed_accepts(raw) is True
    t = torsh_reads(raw, "deepspeed")
    assert isinstance(t, Translation), t
    assert t.result.gradients.prescale is bool(value) and t.result.monitoring.wall_clock_breakdown is bool(value)
    refused = torsh_reads({**raw, "prescale_gradients": 2}, "deepspeed")
    assert isinstance(refused, ConfigError) and "prescale_gradients" in str(refused)


def _accelerate_launch_accepts(path: Path) -> bool | str:
    """``accelerate launch --config_file path train.py`` up to the launcher's command: its loader, its argument
    checks, and the arguments its launcher builds (torchrun's own parsing of them for the torchrun launchers)."""
    import torch.distributed.run as distrib_run
    from accelerate.commands.launch import _filter_args, _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as helpers

    try:
        args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
        args, _, _ = _validate_launch_command(args)
        torchrun = not args.cpu and (args.use_fsdp or args.multi_gpu or args.use_megatron_lm)
        if args.use_deepspeed and not args.cpu:
            args.deepspeed_fields_from_accelerate_config = ""
            helpers.prepare_deepspeed_cmd_env(args)
            torchrun = args.num_machines <= 1
        elif torchrun:
            helpers.prepare_multi_gpu_env(args)
        else:
            helpers.prepare_simple_launcher_cmd_env(args)
        if torchrun:
            distrib_run.config_from_args(_filter_args(args, distrib_run.get_args_parser(), [
                "--training_script", args.training_script, "--training_script_args", args.training_script_args]))
    except RuntimeError as exc:
        return f"{'machine: ' if _MACHINE.search(str(exc)) else ''}{type(exc).__name__}: {exc}"
    except Exception as exc:  # accelerate's own checks raise ValueError; unchecked values fail as they are used
        return f"{type(exc).__name__}: {exc}"
    return True


#: Refusals about this machine (no accelerator, no fp8 library), not about the file: such inputs are not compared.
_MACHINE = __import__("re").compile(r"not available on this machine|no available devices|is not available")


def _accelerate_loads(path: Path) -> bool | str:
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        load_config_from_file(str(path))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return True


@pytest.fixture
def accelerate_file(tmp_path: Path, monkeypatch) -> Callable[[str], Path]:
    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(key)

    def write(text: str) -> Path:
        path = tmp_path / f"accelerate_{abs(hash(text))}.yaml"
        path.write_text(text, encoding="utf-8")
        return path

    return write


def test_accelerate_num_processes_auto_is_read_where_accelerate_launch_runs_it(accelerate_file):
    """``accelerate launch`` hands "auto" to torchrun's --nproc_per_node (one process per device) for the kinds it
    launches through torchrun on one machine; its single-process and CPU launchers compare it with 1 and fail."""
    for kind, launches in (("MULTI_GPU", True), ("FSDP", True), ("DEEPSPEED", True), ("'NO'", False),
                           ("MULTI_CPU", False)):  # fmt: skip
        path = accelerate_file(f"distributed_type: {kind}\nnum_processes: auto\n")
        assert (_accelerate_launch_accepts(path) is True) is launches, kind
        t = adapters.load(path) if launches else None
        if launches:
            (note,) = notes_at(t, "num_processes")
            assert note.fidelity is Fidelity.DEFERRED and "nproc_per_node auto" in note.reason
        else:
            with pytest.raises(ConfigError) as exc:
                adapters.load(path)
            assert exc.value.problems[0].path == "num_processes"
    path = accelerate_file("distributed_type: MULTI_GPU\nnum_processes: auto\nnum_machines: 2\n")
    assert _accelerate_launch_accepts(path) is not True
    with pytest.raises(ConfigError, match="num_machines 2"):
        adapters.load(path)


def test_accelerate_distributed_type_no_unquoted_is_a_single_process(accelerate_file):
    """YAML reads an unquoted ``no``/``NO`` as false; Accelerate's loader keeps it and its launcher runs one process.
    Without num_processes, Accelerate does not give it the 1 it gives the string 'NO', so the launch asks for one."""
    path = accelerate_file("distributed_type: no\nnum_processes: 1\nmixed_precision: 'no'\n")
    assert _accelerate_loads(path) is True and _accelerate_launch_accepts(path) is True
    t = adapters.load(path)
    (note,) = notes_at(t, "distributed_type")
    assert "single process" in note.reason and t.result.sharding.stage == 0
    bare = accelerate_file("distributed_type: NO\n")
    assert "num_processes" in str(_accelerate_launch_accepts(bare))
    assert "--num_processes" in notes_at(adapters.load(bare), "distributed_type")[0].reason


def test_accelerate_distributed_type_is_matched_in_capitals_as_accelerate_does(accelerate_file):
    path = accelerate_file("distributed_type: multi_gpu\nnum_processes: 2\n")
    assert "not a valid DistributedType" in str(_accelerate_loads(path))
    with pytest.raises(ConfigError) as exc:
        adapters.load(path)
    assert exc.value.problems[0].path == "distributed_type" and exc.value.problems[0].suggestion == "MULTI_GPU"


def test_accelerate_num_machines_null_loads_and_is_left_to_the_launch(accelerate_file):
    """ClusterConfig loads a null num_machines; accelerate launch then compares it with 1 and fails unless
    --num_machines is passed: torsh reads it (one machine) with a deferred note naming the flag."""
    path = accelerate_file("distributed_type: MULTI_GPU\nnum_processes: 2\nnum_machines:\n")
    assert _accelerate_loads(path) is True
    assert "NoneType" in str(_accelerate_launch_accepts(path))
    t = adapters.load(path)
    (note,) = notes_at(t, "num_machines")
    assert note.fidelity is Fidelity.DEFERRED and "--num_machines" in note.reason
    assert t.result.launch.world_size == 2


_FSDP2_TP = "distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n  fsdp_version: 2\nparallelism_config:\n"


@pytest.mark.parametrize("size, value, runs", [
    ("tp_size", "'2'", True), ("tp_size", "'1'", True), ("dp_shard_size", "'2'", True),
    ("tp_size", "[1]", False), ("tp_size", "-2", False), ("tp_size", "auto", False), ("tp_size", "null", False),
    ("dp_shard_size", "-2", False), ("dp_shard_size", "null", False), ("cp_size", "'2'", False),
])  # fmt: skip
def test_accelerate_parallelism_sizes_are_judged_as_parallelismconfig_reads_them(size, value, runs, accelerate_file):
    """accelerate launch writes dp_replicate/dp_shard/tp sizes into the training process's environment unlooked-at
    (cp_size and sp_size it compares with 1 first); Accelerator() then builds ParallelismConfig, which reads each back
    with int() and refuses a size below 1. A number as text is that number; a list, "auto", null or -2 fail there,
    and torsh refuses them naming the key."""
    path = accelerate_file(f"{_FSDP2_TP}  parallelism_config_{size}: {value}\n")
    import yaml

    verdict = _accelerate_verdict(yaml.safe_load(path.read_text()), path.parent)
    assert (verdict is True) is runs, verdict
    if runs:
        t = adapters.load(path)
        assert notes_at(t, f"parallelism_config.parallelism_config_{size}")
        if size == "tp_size":
            assert t.result.parallelism.tp == int(value.strip("'"))
    else:
        with pytest.raises(ConfigError) as exc:
            adapters.load(path)
        assert exc.value.problems[0].path == f"parallelism_config.parallelism_config_{size}"


@pytest.mark.parametrize("kind, runs", [("NO", False), ("MULTI_CPU", False), ("MULTI_GPU", True), ("FSDP", True),
                                        ("DEEPSPEED", True)])  # fmt: skip
def test_accelerate_use_cpu_null_is_refused_where_the_launcher_reads_it(kind, runs, accelerate_file):
    """The one-process and CPU launchers read use_cpu with str_to_bool ("invalid truth value none"); the torchrun and
    DeepSpeed launchers pass it over."""
    path = accelerate_file(f"distributed_type: {kind}\nnum_processes: 2\nuse_cpu: null\n")
    assert (_accelerate_verdict({"distributed_type": kind, "num_processes": 2, "use_cpu": None}, path.parent)
            is True) is runs  # fmt: skip
    if runs:
        assert notes_at(adapters.load(path), "use_cpu")
    else:
        with pytest.raises(ConfigError, match="use_cpu"):
            adapters.load(path)


@pytest.mark.parametrize("version, key, value, runs", [
    (1, "fsdp_use_orig_params", "auto", False), (1, "fsdp_use_orig_params", None, False),
    (1, "fsdp_use_orig_params", "yes", True), (2, "fsdp_use_orig_params", "auto", True),
    (2, "fsdp_use_orig_params", [True], True),
    (1, "fsdp_reshard_after_forward", None, True), (1, "fsdp_reshard_after_forward", ["FULL_SHARD"], True),
    (2, "fsdp_reshard_after_forward", None, False), (2, "fsdp_reshard_after_forward", ["FULL_SHARD"], False),
    (2, "fsdp_forward_prefetch", True, True), (2, "fsdp_sharding_strategy", [True], True),
    (1, "fsdp_min_num_params", None, True), (2, "fsdp_sync_module_states", [True], True),
    (2, "fsdp_sync_module_states", None, False),
])  # fmt: skip
def test_accelerate_fsdp_keys_the_plugin_does_not_read_for_its_version_take_any_value(version, key, value, runs,
                                                                                       tmp_path, monkeypatch):
    """FSDP1's plugin takes its strategy from fsdp_sharding_strategy alone (fsdp_reshard_after_forward is passed
    over); FSDP2's does not read use_orig_params, forward_prefetch, sharding_strategy or sync_module_states;
    min_num_params is read only with SIZE_BASED_WRAP. accelerate launch runs such a key whatever it holds, and torsh
    reads it with a note; a key the plugin reads with str_to_bool refuses what that refuses."""
    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    for name in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(name)
    data = {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {"fsdp_version": version, key: value}}
    assert (_accelerate_verdict(data, tmp_path) is True) is runs
    result = torsh_reads(data, "accelerate")
    assert isinstance(result, Translation) is runs, result
    if runs:
        assert notes_at(result, f"fsdp_config.{key}")
    else:
        assert result.problems[0].path == f"fsdp_config.{key}"


@pytest.mark.parametrize("data, where", [
    # tp_hsdp.yaml without dp_shard_size: tensor parallelism over pure replication, which ParallelismConfig refuses
    ({"distributed_type": "FSDP", "num_processes": 4, "fsdp_config": {"fsdp_version": 2},
      "parallelism_config": {"parallelism_config_dp_replicate_size": 2, "parallelism_config_tp_size": 2}},
     "parallelism_config.parallelism_config_dp_shard_size"),
    # use_cpu set (the text "false" is set too) and num_processes as text: accelerate launch compares it with 1
    ({"distributed_type": "MULTI_GPU", "num_processes": "8", "use_cpu": "false"}, "num_processes"),
    ({"distributed_type": "FSDP", "num_processes": "auto", "use_cpu": "off"}, "num_processes"),
])  # fmt: skip
def test_accelerate_combinations_accelerate_refuses_are_refused(data, where, tmp_path, monkeypatch):
    """Found by pairs of mutations: each key alone runs, the two together fail in accelerate launch or in the
    training process's ParallelismConfig; torsh refuses naming the key to change."""
    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    for name in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(name)
    assert _accelerate_verdict(data, tmp_path) is not True
    result = torsh_reads(data, "accelerate")
    assert isinstance(result, ConfigError) and result.problems[0].path == where, result


def test_accelerate_fsdp_config_nulls_are_judged_only_where_fsdp_config_is_read(tmp_path, monkeypatch):
    """A null in fsdp_config is refused for distributed_type FSDP (the plugin reads the text 'None'); for another
    kind the section is not read, and the file is judged by its distributed_type."""
    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    for name in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(name)
    section = {"fsdp_version": None, "fsdp_offload_params": None}
    fsdp = torsh_reads({"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": section}, "accelerate")
    assert isinstance(fsdp, ConfigError) and fsdp.problems[0].path.startswith("fsdp_config.")
    ddp = {"distributed_type": "MULTI_GPU", "num_processes": 2, "fsdp_config": section}
    assert _accelerate_verdict(ddp, tmp_path) is True and isinstance(torsh_reads(ddp, "accelerate"), Translation)
    listed = torsh_reads({**ddp, "distributed_type": ["FSDP"]}, "accelerate")
    assert isinstance(listed, ConfigError) and listed.problems[0].path == "distributed_type"


def test_accelerate_fsdp_version_other_than_1_or_2_is_refused_on_purpose(tmp_path, monkeypatch):
    """accelerate launch and the FSDP plugin take fsdp_version -2 (the plugin tests == 1 / == 2 and matches
    neither); torsh refuses it naming the key, and the refusal is listed in ACCELERATE_DELIBERATE."""
    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    for name in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(name)
    data = {"distributed_type": "FSDP", "num_processes": 2,
            "fsdp_config": {"fsdp_version": -2, "fsdp_reshard_after_forward": "FULL_SHARD"}}  # trl's fsdp1.yaml
    assert _accelerate_verdict(data, tmp_path) is True
    found = disagreements("accelerate", [("fsdp_version -2", data, "out of range", ("fsdp_config", "fsdp_version"), 1)],
                          lambda d: _accelerate_verdict(d, tmp_path), ACCELERATE_DELIBERATE)  # fmt: skip
    assert not found["disagree"] and "neither 1 nor 2" in found["deliberate"][0][2]


def _transformers_plugin_args(config: dict, tmp_path: Path, options: Any = True) -> dict | str | None:
    transformers = pytest.importorskip("transformers")
    try:
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), fsdp=options,
                                              fsdp_config=copy.deepcopy(config), use_cpu=True, report_to=[])
    except Exception as exc:  # its own checks raise ValueError; unchecked values fail as they are used
        return f"{type(exc).__name__}: {exc}"
    return args.fsdp_plugin_args


#: transformers 5.x's boolean fsdp_config keys, with the version (1/2) under which it reads each.
_TRANSFORMERS_BOOLEANS = {"cpu_ram_efficient_loading": 2, "activation_checkpointing": 2, "reshard_after_forward": 2,
                          "forward_prefetch": 1, "use_orig_params": 1, "sync_module_states": 1,
                          "limit_all_gathers": 1}  # fmt: skip


@pytest.mark.parametrize("key", sorted(_TRANSFORMERS_BOOLEANS))
def test_fsdp_config_string_booleans_are_read_as_the_trainer_reads_them(key, tmp_path, monkeypatch):
    for name in [k for k in os.environ if k.startswith("FSDP_")]:
        monkeypatch.delenv(name)
    version = _TRANSFORMERS_BOOLEANS[key]
    for text, meaning in (("true", True), ("False", False), ("yes", True), ("0", False)):
        config = {"version": version, f"fsdp_{key}": text}
        args = _transformers_plugin_args(config, tmp_path)
        assert isinstance(args, dict), args
        t = torsh_reads(config, "fsdp_plugin")
        assert isinstance(t, Translation), (config, t)
        if key in args and key != "limit_all_gathers":
            assert args[key] is meaning
    bad = {"version": version, f"fsdp_{key}": "maybe"}
    assert "invalid truth value" in str(_transformers_plugin_args(bad, tmp_path))
    result = torsh_reads(bad, "fsdp_plugin")
    assert isinstance(result, ConfigError) and result.problems[0].path == f"fsdp_{key}"


def test_fsdp_config_offload_params_is_not_read_by_the_trainer(tmp_path):
    """transformers 5.x offloads with cpu_offload (or the fsdp option "offload"); fsdp_offload_params, the accelerate
    YAML's key, is passed over whatever its value, so it is an ignored note, not an offload."""
    for value in (True, "true", "nonsense"):
        args = _transformers_plugin_args({"fsdp_offload_params": value}, tmp_path)
        assert isinstance(args, dict) and "cpu_offload" not in args
        t = torsh_reads({"fsdp_offload_params": value}, "fsdp_plugin")
        assert isinstance(t, Translation) and t.result.offload.params == "none"
        assert notes_at(t, "fsdp_offload_params")[0].fidelity is Fidelity.IGNORED
    args = _transformers_plugin_args({"cpu_offload": "false"}, tmp_path)  # a truth test: the text "false" is true
    t = torsh_reads({"cpu_offload": "false"}, "fsdp_plugin")
    assert args["cpu_offload"] is True and t.result.offload.params == "cpu" and lossy_at(t, "cpu_offload")


@pytest.fixture(scope="module")
def titan_parse():
    """torchtitan 0.2.2's ConfigManager, without torchtitan's package __init__ (it imports GPU kernels)."""
    pytest.importorskip("tyro")
    from consumers import without_package_init

    without_package_init("torchtitan", "0.2.2")
    import contextlib
    import io

    from torchtitan.config.manager import ConfigManager

    def parse(path: Path, fast: bool = False, extra: tuple[str, ...] = ()) -> bool | str:
        """``fast``: parse_args without its tyro step, which only lays command-line overrides (none here) over
        the TOML's dataclass and takes most of the time. ``extra``: more command-line arguments."""
        args = ["--job.config_file", str(path), *extra]
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                if not fast:
                    ConfigManager().parse_args(args)
                    return True
                manager = ConfigManager()
                toml = manager._maybe_load_toml(args)
                manager.config = manager._dict_to_dataclass(manager._maybe_add_custom_config(args, toml), toml)
                manager._validate_config()
        except (Exception, SystemExit) as exc:
            return f"{type(exc).__name__}: {exc}"
        return True

    return parse


def _titan_dropped(t: Translation) -> dict[str, str]:
    """The keys torchtitan 0.2.2 does not define, as the torchtitan reader notes them -> the spelling it suggests."""
    import re

    found = {n.source_path: re.search(r"did you mean '([^']+)'\?$", n.reason) for n in t.notes if n.refused}
    assert all(n.lossy for n in t.notes if n.refused)
    return {path: match.group(1) if match else "" for path, match in found.items()}


@pytest.mark.parametrize("path", sorted(CORPUS.glob("torchtitan/*__2024__*.toml")), ids=lambda p: p.stem)
def test_torchtitan_files_from_before_0_2_are_torchtitan_and_name_each_renamed_key(path, titan_parse):
    """torchtitan 0.2.2 refuses its 2024 job configs naming the first old section; torsh recognises them as
    torchtitan (no --from), reads them, and notes every renamed key with its current spelling (--strict fails)."""
    assert "Invalid field names" in str(titan_parse(path))
    raw, _ = load_file(path)
    assert adapters.sniff(raw) == "torchtitan"
    t = adapters.load(path)
    dropped = {n.source_path: n for n in t.notes if n.refused}
    assert all("torchtitan 0.2" in n.reason for n in dropped.values())
    assert _titan_dropped(t)["training.data_parallel_shard_degree"] == "parallelism.data_parallel_shard_degree"
    assert "quantize.linear.float8" in dropped["float8"].reason
    assert _titan_dropped(t)["checkpoint.enable_checkpoint"] == "checkpoint.enable"


def test_torchtitan_renamed_keys_applied_give_a_file_torchtitan_reads(titan_parse, tmp_path):
    """Each suggestion is torchtitan 0.2.2's spelling: a 2024 file with every suggestion applied (and the removed
    keys deleted) is read by torchtitan, and by torsh with no key dropped."""
    from torsh.formats import dump_text

    raw, _ = load_file(CORPUS / "torchtitan" / "pytorch__torchtitan__2024__llama3_8b.toml")
    fixed = copy.deepcopy(raw)
    for path, suggestion in _titan_dropped(adapters.read(raw, "torchtitan")).items():
        section, _, key = path.partition(".")
        if section not in fixed:  # inside a section already removed
            continue
        value = fixed[section].pop(key) if key else fixed.pop(section)
        if suggestion:
            new_section, new_key = suggestion.split(".")
            fixed.setdefault(new_section, {})[new_key] = value
    path = tmp_path / "upgraded.toml"
    path.write_text(dump_text(fixed, "toml"), encoding="utf-8")
    assert titan_parse(path) is True
    upgraded = adapters.load(path)
    assert upgraded.result.sharding.stage == 3 and not _titan_dropped(upgraded)


def test_convert_world_size_makes_an_accelerate_yaml_accelerate_launch_runs(accelerate_file, tmp_path, capsys):
    """A DeepSpeed JSON says nothing of the process count: converted without --world-size, the YAML has no
    num_processes and accelerate launch refuses it (the report names the flag); with it, the YAML launches."""
    from torsh.cli import main

    source = tmp_path / "ds.json"
    source.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}))
    bare, sized, nodes = tmp_path / "bare.yaml", tmp_path / "sized.yaml", tmp_path / "nodes.yaml"
    assert main(["convert", str(source), "--to", "accelerate", "-o", str(bare)]) == 0
    assert "--world-size N" in capsys.readouterr().out
    assert "--num_processes" in str(_accelerate_launch_accepts(bare))
    assert main(["convert", str(source), "--to", "accelerate", "--world-size", "4", "-o", str(sized)]) == 0
    assert "num_processes: 4" in sized.read_text() and _accelerate_launch_accepts(sized) is True
    assert main(["convert", str(source), "--to", "accelerate", "--nnodes", "1", "--nproc-per-node", "2",
                 "-o", str(nodes)]) == 0  # fmt: skip
    assert "num_processes: 2" in nodes.read_text() and _accelerate_launch_accepts(nodes) is True


@pytest.mark.parametrize("flags, source, message", [
    (["--world-size", "3"], {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                             "gradient_accumulation_steps": 2}, "implies 4"),
    (["--nnodes", "2", "--nproc-per-node", "4", "--world-size", "5"], {"train_micro_batch_size_per_gpu": 2},
     "is not --nnodes 2 x --nproc-per-node 4"),
    (["--world-size", "0"], {"train_micro_batch_size_per_gpu": 2}, "at least 1"),
])  # fmt: skip
def test_convert_launch_flags_that_contradict_the_source_are_refused(flags, source, message, tmp_path, capsys):
    from torsh.cli import main

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(source))
    assert main(["convert", str(path), "--to", "accelerate", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# ---- the differential engine ---------------------------------------------------------------------------------------

AUTO_TEXT = "auto"
UNKNOWN_KEY = "zz_not_a_key"


def _leaves(raw: dict, depth: int = 2, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    for key, value in raw.items():
        if not isinstance(key, str):
            continue
        yield (*prefix, key), value
        if isinstance(value, dict) and depth > 1:
            yield from _leaves(value, depth - 1, (*prefix, key))


def _as_text(value: Any) -> Any:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return str(value)
    return None


def _candidates(raw: dict) -> Iterator[tuple[str, tuple, Any]]:
    """Every mutation of one input this suite knows: (kind, key path, new value); a value of ``_DROP`` drops it."""
    sections = [()] + [path for path, value in _leaves(raw) if isinstance(value, dict)]
    for section in sections:
        yield "unknown key", (*section, UNKNOWN_KEY), 1
    for path, value in _leaves(raw):
        yield "drop", path, _DROP
        yield "null", path, None
        yield "auto", path, AUTO_TEXT
        if _as_text(value) is not None:
            yield "as text", path, _as_text(value)
        if not isinstance(value, (dict, list)):
            yield "wrong type", path, [value]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield "out of range", path, -1 - abs(value)
        if isinstance(value, bool) or value in ("true", "false"):
            yield "yaml boolean", path, "yes" if value in (True, "true") else "off"


_DROP = object()


def _apply(raw: dict, path: tuple, value: Any) -> dict:
    out = copy.deepcopy(raw)
    node = out
    for part in path[:-1]:
        node = node[part]
    if value is _DROP:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    return out


def inputs(files: list[Path], count: int, framework: Callable[[dict], bool | str], seed: int = 0,
           keys: Callable[[tuple], bool] = lambda path: True,
           exclude: Callable[[str, tuple], bool] = lambda kind, path: False) -> list[tuple]:  # fmt: skip
    """Every file as it is, then ``count`` mutations of the files the framework accepts (a mutation of a file it
    refuses anyway says nothing): (label, data, kind, key path, original value, parts). Past the single mutations
    the files give, pairs of them on one file (keys none of which is inside another; triples and more once the pairs
    run out): ``parts`` lists each mutation as (kind, key path, original value). ``exclude``: mutations not to make
    (kind, key path)."""
    rnd = random.Random(seed)
    seeds = [(p.name, _parsed(p)) for p in files]
    seeds = [(name, data) for name, data in seeds if data is not None]
    out: list[tuple] = [(name, data, "corpus", (), None, []) for name, data in seeds]
    pool = [(name, data, kind, path, value) for name, data in seeds
            if isinstance(data, dict) and framework(copy.deepcopy(data)) is True
            for kind, path, value in _candidates(data) if keys(path) and not exclude(kind, path)]  # fmt: skip
    for name, data, kind, path, value in rnd.sample(pool, min(count, len(pool))):
        out.append((f"{name}: {kind} at {'.'.join(path)}", _apply(data, path, value), kind, path, _at(data, path),
                    [(kind, path, _at(data, path))]))  # fmt: skip
    by_file: dict[str, list] = {}
    for item in pool:
        by_file.setdefault(item[0], []).append(item)
    seen: set = set()
    for size in (2, 3, 4):  # pairs first; triples and more once a small corpus has no new pair to give
        files_with_room = [name for name, items in by_file.items() if len(items) >= size]
        for _ in range(max(0, count - len(out) + len(seeds)) * 10):
            if len(out) - len(seeds) >= count or not files_with_room:
                break
            drawn = rnd.sample(by_file[rnd.choice(files_with_room)], size)
            paths = [d[3] for d in drawn]
            if any(a[:len(b)] == b for a in paths for b in paths if a is not b):
                continue
            signature = frozenset((d[2], d[3]) for d in drawn)
            if signature in seen:
                continue
            seen.add(signature)
            name, data = drawn[0][0], drawn[0][1]
            mutated = data
            for _, _, kind, path, value in drawn:
                mutated = _apply(mutated, path, value)
            parts = [(kind, path, _at(data, path)) for _, _, kind, path, _ in drawn]
            out.append((f"{name}: " + " + ".join(f"{k} at {'.'.join(p)}" for k, p, _ in parts), mutated,
                        "+".join(k for k, _, _ in parts), parts[0][1], parts[0][2], parts))  # fmt: skip
    return out


def _parsed(path: Path) -> Any:
    """The file as torsh parses it; None for a file torsh's parser refuses on purpose: a key set twice (PyYAML
    keeps the last one silently; torsh names the key: tests/test_input_limits.py)."""
    try:
        return load_file(path)[0]
    except ConfigError as exc:
        assert "duplicate key" in str(exc), exc
        return None


def disagreements(dialect: str, cases: list, framework: Callable[[dict], bool | str],
                  deliberate: dict[str, Callable[..., bool]], read: Callable[[dict], Any] | None = None) -> dict:
    """Each input through the framework and through torsh; returns the disagreements that are not deliberate, and
    counts every outcome. A framework refusal agrees with a torsh refusal or with a lossy note at the key (for a
    corpus file: anywhere)."""
    read = read or (lambda data: torsh_reads(data, dialect))
    found: dict[str, list] = {"disagree": [], "deliberate": [], "agree": [], "machine": []}
    for label, data, kind, path, original, *rest in cases:
        parts = rest[0] if rest else ([(kind, path, original)] if path else [])
        verdict = framework(copy.deepcopy(data))
        result = read(copy.deepcopy(data))
        accepted = isinstance(result, Translation)
        if isinstance(verdict, str) and verdict.startswith(("machine:", "skip:")):  # not about the file alone
            found["machine"].append(label)
        elif verdict is True and accepted:
            found["agree"].append(label)
        elif isinstance(verdict, str) and verdict.startswith("flag:") and accepted:  # runs once the flag is given
            flag = verdict.split(":", 1)[1]
            says = any(flag in n.reason for n in result.notes)
            found["agree" if says else "disagree"].append(label if says else (label, f"{verdict}; torsh: {result}"))
        elif verdict is not True and (not accepted or (any(lossy_at(result, ".".join(p)) for _, p, _ in parts)
                                                       if parts else result.lossy)):  # fmt: skip
            found["agree"].append(label)
        else:
            located = [(k, p, o) for k, p, o in parts if isinstance(result, ConfigError) and any(
                q.path == ".".join(p) or q.path.startswith(".".join(p) + ".") or ".".join(p).startswith(q.path + ".")
                for q in result.problems)]  # fmt: skip
            why = next((name for name, rule in deliberate.items() for k, p, o in located
                        if rule(o, k, p, verdict, result)), None)  # fmt: skip
            entry = (label, verdict if verdict is not True else str(result)[:300])
            found["deliberate" if why else "disagree"].append((*entry, why) if why else entry)
    _tally(dialect, cases, found)
    return found


def _tally(dialect: str, cases: list, found: dict) -> None:
    """With TORSH_DIFFERENTIAL_TALLY set to a file, one JSON line per comparison: the inputs (corpus files and
    mutations), each outcome's count and the disagreements (what the long run reports per dialect)."""
    target = os.environ.get("TORSH_DIFFERENTIAL_TALLY")
    if not target:
        return
    line = {"dialect": dialect, "corpus": sum(1 for c in cases if c[2] == "corpus"),
            "mutations": sum(1 for c in cases if c[2] != "corpus"),
            "pairs": sum(1 for c in cases if "+" in c[2]),
            **{k: len(v) for k, v in found.items()}, "disagreements": [list(map(str, d)) for d in found["disagree"]]}
    with open(target, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def _report(found: dict) -> str:
    return "\n".join(f"{label}\n    {detail}" for label, detail, *_ in found["disagree"][:25])


# ---- DeepSpeed ---------------------------------------------------------------------------------------------------


def _deepspeed_accepts(raw: dict) -> bool | str:
    """DeepSpeedConfig on the file after the Hugging Face "auto" fill (the HF Trainer and Accelerate fill it before
    DeepSpeed sees it; torsh.parity.resolve_auto is that fill). Built without a job: it falls back to one rank."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from torsh import parity

    try:
        filled, _ = parity.resolve_auto(raw, nproc=1, steps=10)
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as exc:
        return f"the HF fill fails: {type(exc).__name__}: {exc}"
    try:
        DeepSpeedConfig(filled)
    except Exception as exc:  # DeepSpeed raises assertion, pydantic, its own and plain errors alike
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return True


def _read_with_dict_get(path: tuple) -> bool:
    """A key DeepSpeed reads with plain ``dict.get`` (a top-level scalar, a section that is no pydantic model): it
    keeps whatever value it finds, unconverted and unchecked."""
    from torsh.adapters._deepspeed_rules import STRICT_SECTIONS

    return path[0] not in STRICT_SECTIONS


#: Where torsh refuses what DeepSpeedConfig accepts, on purpose (each refusal names the key). DeepSpeedConfig parses
#: these and stores them as they are; deepspeed.initialize or the training step then fails or misreads them, so a
#: migration tool that read them would translate a meaning DeepSpeed does not have. Each rule: (original, mutation
#: kind, key path, DeepSpeed's verdict, torsh's result) -> True when it applies; ``original`` is the value the
#: mutation replaced.
DEEPSPEED_DELIBERATE: dict[str, Callable[..., bool]] = {
    # get_scalar_param keeps the text: "false" is then true to DeepSpeed's `if`, "2000" fails `step % every`.
    "text, a YAML boolean or a list where DeepSpeed reads the value with dict.get and uses it unconverted":
        lambda original, kind, path, *_: kind in ("as text", "yaml boolean", "wrong type")
        and _read_with_dict_get(path),
    # A null section or value is stored as None; the engine then calls methods on it, compares it or tests it.
    "null where DeepSpeed expects a value or a section (it stores None; delete the key for the default)":
        lambda original, kind, *_: kind == "null",
    # The Hugging Face convention fills "auto" only in numbers (sizes, rates, clipping) and in fp16/bf16.enabled.
    "\"auto\" where neither the HF Trainer nor Accelerate fills it (a section, a boolean, a name)":
        lambda original, kind, *_: kind == "auto" and not _is_number(original),
    # DeepSpeed leaves these bounds to its loss scaler and schedulers, which then never back off or divide by 0.
    "a negative count or scale DeepSpeed does not bound (loss-scale window, hysteresis, minimum scale, steps)":
        lambda original, kind, *_: kind == "out of range",
    # The optimizer and scheduler are built in deepspeed.initialize: without a type or the params a scheduler
    # needs, DeepSpeed fails there (or silently keeps the client's optimizer), not in DeepSpeedConfig.
    "an optimizer or scheduler section without what deepspeed.initialize needs to build it":
        lambda original, kind, path, *_: kind == "drop" and path[0] in ("optimizer", "scheduler"),
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _at(data: dict, path: tuple) -> Any:
    node = data
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return node


@pytest.fixture(scope="module")
def deepspeed_ready():
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is the parser compared with")
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def test_deepspeed_reader_agrees_with_deepspeedconfig(deepspeed_ready):
    files = sorted((CORPUS / "deepspeed").glob("*.json")) + sorted((CORPUS / "deepspeed_config_templates").glob("*"))
    cases = inputs([p for p in files if p.suffix == ".json"], _budget(3), _deepspeed_accepts)
    found = disagreements("deepspeed", cases, _deepspeed_accepts, DEEPSPEED_DELIBERATE)
    assert not found["disagree"], _report(found)


# ---- Accelerate ----------------------------------------------------------------------------------------------------

def _launch_flag(data: dict, verdict: str) -> str | None:
    """The flag with which ``accelerate launch`` runs a file it refused: what the file leaves out or null."""
    if data.get("num_machines", 1) is None and "NoneType" in verdict:
        return "--num_machines"
    if data.get("num_processes", -1) in (None, -1) and ("--num_processes" in verdict or "None" in verdict):
        return "--num_processes"
    return None


def _accelerate_verdict(data: dict, tmp: Path) -> bool | str:
    """``accelerate launch``'s verdict on a config file: True, ``"flag:--x"`` when it runs only with that flag
    passed, else the error. Past the launch, the training process builds its FSDP / DeepSpeed plugin from the
    environment the launcher set; that is run too (the plugin refuses what the launcher passes on unchecked)."""
    import yaml

    path = tmp / "accelerate_config.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    loaded = _accelerate_loads(path)
    if loaded is not True:
        return loaded
    verdict = _accelerate_launch_accepts(path)
    if verdict is not True:
        flag = _launch_flag(data, str(verdict))
        return f"flag:{flag}" if flag else verdict
    return _plugin_from_launch_env(path)


def _plugin_from_launch_env(path: Path) -> bool | str:
    """What the training process builds from the environment accelerate launch gives it: the FSDP plugin, and
    Accelerate's ParallelismConfig when the file has a parallelism_config (``Accelerator()`` builds it from
    ACCELERATE_USE_PARALLELISM_CONFIG and the PARALLELISM_CONFIG_* sizes, read back with int())."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin, patch_environment
    from accelerate.utils import launch as helpers

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    if args.use_deepspeed and not args.cpu:
        args.deepspeed_fields_from_accelerate_config = ""
        env = helpers.prepare_deepspeed_cmd_env(args)[1]
    elif not args.cpu and (args.use_fsdp or args.multi_gpu or args.use_megatron_lm):
        env = helpers.prepare_multi_gpu_env(args)
    else:
        return True  # the one-process and CPU launchers pass neither on
    env = {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_"))}
    from unittest import mock

    try:  # the plugin asks for the current accelerator with sync_module_states: this machine has none
        with patch_environment(**env), mock.patch("accelerate.utils.dataclasses.is_cuda_available", lambda: True), \
                mock.patch("torch.cuda.current_device", lambda: 0):  # fmt: skip
            if env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true":
                try:
                    ParallelismConfig()
                except (ValueError, TypeError) as exc:
                    return f"ParallelismConfig refuses it: {type(exc).__name__}: {exc}"
            if args.use_fsdp:
                FullyShardedDataParallelPlugin()
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return f"the FSDP plugin refuses it: {type(exc).__name__}: {exc}"
    return True


#: Launch values accelerate launch reads only for a job on several machines (it passes them over on one).
_MULTI_NODE_ONLY = ("machine_rank", "rdzv_backend", "main_process_ip", "main_process_port", "same_network")


#: Where torsh refuses what accelerate launch runs, on purpose (each refusal names the key).
ACCELERATE_DELIBERATE: dict[str, Callable[..., bool]] = {
    # They are wrong whatever the machine count; accelerate launch fails on them once num_machines > 1.
    "a bad value of a launch key accelerate launch uses only on several machines (machine_rank, rdzv_backend, ...)":
        lambda original, kind, path, *_: path[0] in _MULTI_NODE_ONLY,
    # ClusterConfig keeps any value; accelerate launch then starts one process, whatever was meant.
    "a distributed_type that names no kind (a list, null, text that is not a DistributedType)":
        lambda original, kind, path, *_: path == ("distributed_type",),
    # accelerate launch runs them as one process / one machine (it only asks `> 1`); torsh asks for a real count.
    "a process or machine count below 1 (other than num_processes -1, Accelerate's 'not stated')":
        lambda original, kind, path, *_: path in (("num_processes",), ("num_machines",)) and kind != "null",
    # Read with str_to_bool by the one-process launcher (which fails on it); the multi-GPU launchers pass it over.
    "a use_cpu that is neither a boolean nor its text":
        lambda original, kind, path, *_: path == ("use_cpu",),
    # The FSDP plugin keeps any integer as fsdp_version and tests it with == 1 / == 2 piecemeal: a -2 or a 3 runs
    # neither generation's settings, silently. torsh asks for 1 or 2.
    "an fsdp_version that is neither 1 nor 2 (the plugin keeps the number and runs neither FSDP generation)":
        lambda original, kind, path, *_: path == ("fsdp_config", "fsdp_version") and kind == "out of range",
    # accelerate launch copies only mapping sections into its arguments; any other value is passed over.
    "a section (fsdp_config, deepspeed_config, ...) that is not a mapping":
        lambda original, kind, path, *_: len(path) == 1 and isinstance(original, dict),
}


def _mutable_in_accelerate(path: tuple) -> bool:
    """Keys whose mutations are compared with accelerate launch: not deepspeed_config, which the launcher passes on
    unchecked to DeepSpeed (the DeepSpeed reader is compared with DeepSpeed itself above)."""
    return path[0] != "deepspeed_config"


def test_accelerate_reader_agrees_with_accelerate_launch(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(key)
    files = [p for p in sorted((CORPUS / "accelerate").glob("*.yaml")) if "deepspeed_config_file" not in p.read_text()]
    framework = lambda data: _accelerate_verdict(data, tmp_path)  # noqa: E731
    cases = inputs(files, MUTATIONS, framework, keys=_mutable_in_accelerate)
    found = disagreements("accelerate", cases, framework, ACCELERATE_DELIBERATE)
    assert not found["disagree"], _report(found)


# ---- transformers' fsdp_config -------------------------------------------------------------------------------------


def _trainer_verdict(data: dict, tmp: Path) -> bool | str:
    """``TrainingArguments(fsdp=..., fsdp_config=...)``, then Accelerate's FSDP plugin from the arguments it builds
    (as the Trainer does)."""
    from unittest import mock

    from accelerate.utils import FullyShardedDataParallelPlugin

    options, config = (data.get("fsdp", True), data["fsdp_config"]) if isinstance(data.get("fsdp_config"), dict) \
        else (True, data)  # fmt: skip
    args = _transformers_plugin_args(config, tmp, options)
    if not isinstance(args, dict):
        return args if args is not None else True  # None: the XLA path, which builds no plugin
    try:
        with mock.patch("accelerate.utils.dataclasses.is_cuda_available", lambda: True), \
                mock.patch("torch.cuda.current_device", lambda: 0):  # fmt: skip
            FullyShardedDataParallelPlugin(**args)
    except Exception as exc:  # the plugin's own checks raise ValueError; others fail as they use the value
        return f"the FSDP plugin refuses it: {type(exc).__name__}: {exc}"
    return True


#: Where torsh refuses what the Trainer accepts, on purpose.
TRAINER_DELIBERATE: dict[str, Callable[..., bool]] = {
    # As for accelerate launch: the FSDP plugin keeps any integer version and runs neither FSDP generation.
    "an fsdp_version that is neither 1 nor 2 (the plugin keeps the number and runs neither FSDP generation)":
        lambda original, kind, path, *_: path[-1] in ("fsdp_version", "version") and kind == "out of range",
    # transformers and the plugin keep such a value unconverted (a list where a name is read): nothing then uses it
    # as meant, so torsh asks for the value's own type.
    "a value of the wrong type (a list) that the plugin keeps unconverted":
        lambda original, kind, *_: kind == "wrong type",
    # Off, or given as a path on the command line: the file then holds no FSDP settings to translate.
    "the Trainer-arguments form with fsdp null (FSDP off) or an fsdp_config that is no mapping":
        lambda original, kind, path, *_: path in (("fsdp",), ("fsdp_config",)),
}


@pytest.mark.parametrize("settings", [None, "auto", {"compute_dtype": "bfloat16"}])
def test_fsdp_config_xla_settings_are_not_judged_with_xla_off(settings, tmp_path, monkeypatch):
    """TrainingArguments reads xla_fsdp_settings only for the XLA path: with xla off (or absent) any value passes."""
    for name in [k for k in os.environ if k.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(name)
    for xla in (False, None):
        config = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "xla_fsdp_settings": settings}
        if xla is not None:
            config["xla"] = xla
        assert _trainer_verdict(config, tmp_path) is True
        assert isinstance(torsh_reads(config, "fsdp_plugin"), Translation)


def test_fsdp_plugin_reader_agrees_with_trainingarguments(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    for name in [k for k in os.environ if k.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(name)
    files = sorted((CORPUS / "fsdp_plugin_json").glob("*.json"))
    framework = lambda data: _trainer_verdict(data, tmp_path)  # noqa: E731
    found = disagreements("fsdp_plugin", inputs(files, MUTATIONS, framework), framework, TRAINER_DELIBERATE)
    assert not found["disagree"], _report(found)


# ---- Horovod's --config-file ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def horovod_config_parser() -> types.ModuleType:
    """horovodrun's config parser (horovod/runner/common/util/config_parser.py), loaded alone from the 0.28.1 sdist:
    Horovod does not build here, and the module imports nothing of Horovod."""
    if not HOROVOD_SDIST.is_file():
        pytest.skip(f"the Horovod sdist is not in .venv/sdist (make venv downloads it): {HOROVOD_SDIST.name}")
    with tarfile.open(HOROVOD_SDIST) as sdist:
        member = sdist.extractfile("horovod-0.28.1/horovod/runner/common/util/config_parser.py")
        source = member.read().decode("utf-8")
    module = types.ModuleType("horovod_config_parser")
    exec(compile(source, "config_parser.py", "exec"), module.__dict__)  # noqa: S102 - Horovod's own module
    return module


class _HorovodrunArgs:
    """horovodrun's parsed arguments with no flag given: every option None, every switch False (argparse's
    defaults), as the config parser finds them."""

    use_gloo = use_mpi = autotune = no_stall_check = False

    def __getattr__(self, name: str) -> None:
        return None


def _horovodrun_verdict(config: dict, parser: types.ModuleType) -> bool | str:
    """What horovodrun does with ``--config-file``: set the arguments from it, validate them, build the
    environment of the workers from them."""
    args = _HorovodrunArgs()
    try:
        parser.set_args_from_config(args, config, set())
        parser.validate_config_args(args)
        parser.set_env_from_args({}, args)
    except Exception as exc:  # ValueError from its checks; unchecked values fail as they are used
        return f"{type(exc).__name__}: {exc}"
    return True


#: Where torsh refuses what horovodrun accepts, on purpose.
HOROVOD_DELIBERATE: dict[str, Callable[..., bool]] = {
    # horovodrun sets the argument to the value as it is and exports `1 if value else 0`: the text "false" (or
    # "off", a list [False]) turns the feature on. torsh asks for a boolean rather than translate that.
    "text, a list or \"auto\" where horovodrun only tests the value for truth, or puts it in the environment as is":
        lambda original, kind, *_: kind in ("as text", "yaml boolean", "auto", "wrong type"),
}


def test_horovod_reader_agrees_with_horovodruns_config_parser(horovod_config_parser):
    files = sorted((CORPUS / "horovod").glob("*.yaml"))
    framework = lambda data: _horovodrun_verdict(data, horovod_config_parser)  # noqa: E731
    found = disagreements("horovod", inputs(files, MUTATIONS, framework), framework, HOROVOD_DELIBERATE)
    assert not found["disagree"], _report(found)


# ---- torchtitan ----------------------------------------------------------------------------------------------------


def _torchtitan_verdict(data: dict, parse: Callable[[Path], bool | str], tmp: Path) -> bool | str:
    from torsh.formats import dump_text

    path = tmp / "job.toml"
    path.write_text(dump_text(data, "toml"), encoding="utf-8")
    verdict = parse(path, fast=True)
    if "Invalid field names" in str(verdict):  # runs with the extension module named on the command line?
        module = _titan_extension_of(data)
        if module and parse(path, fast=True, extra=("--job.custom_config_module", module)) is True:
            return "flag:--job.custom_config_module"
    return f"machine: {verdict}" if "ModuleNotFoundError" in str(verdict) else verdict


def _titan_extension_of(data: dict) -> str | None:
    """The extension module that defines the file's keys torchtitan's base JobConfig lacks (None: not one)."""
    from torsh.adapters.torchtitan import key_table

    table = key_table()
    owners = {module for section, keys in data.items() if isinstance(keys, dict) for key in keys
              if key not in table["sections"].get(section, {})
              for module, extra in table["extensions"].items() if key in extra.get(section, ())}  # fmt: skip
    return owners.pop() if len(owners) == 1 else None


_TITAN_CHECKED_LATER = (("training", "local_batch_size"), ("training", "global_batch_size"), ("training", "max_norm"))
#: Where torsh refuses what torchtitan 0.2.2 accepts, on purpose.
TORCHTITAN_DELIBERATE: dict[str, Callable[..., bool]] = {
    # ConfigManager builds its dataclasses from the TOML without checking a type (only a few __post_init__ bounds):
    # "false" is then true to an `if`, "2" fails in arithmetic, a list fails where a number is used.
    "a value of another type than the JobConfig field's (text, a list, \"auto\"): torchtitan keeps it unchecked":
        lambda original, kind, *_: kind in ("as text", "yaml boolean", "wrong type", "auto"),
    # torchtitan checks the degrees when it builds its device mesh (ParallelDims) and uses the batch size and the
    # clipping norm unchecked (its dataloader fails on a negative batch; clip_grad_norm_ on a negative norm).
    # ... and torch.optim checks lr / eps / betas / weight_decay when torchtitan builds the optimizer.
    "a negative parallelism degree (other than -1), batch size, clipping norm or optimizer setting, checked after "
    "parsing":
        lambda original, kind, path, *_: kind == "out of range" and (path[0] in ("parallelism", "optimizer") or path
                                                                     in _TITAN_CHECKED_LATER),
}


def test_torchtitan_extension_keys_without_their_module_need_it_on_the_command_line(titan_parse, tmp_path):
    """The fault-tolerance debug config without its [job] section: torchtitan defines fault_tolerance.sync_steps and
    num_fragments only in torchtitan.components.ft.config, which [job] custom_config_module names. ConfigManager
    refuses the file alone and runs it with --job.custom_config_module; torsh reads it with a deferred note naming
    that flag (not lossy), and with a lossy note where the file names another extension."""
    from torsh.formats import dump_text

    raw, _ = load_file(CORPUS / "torchtitan" / "pytorch__torchtitan__llama3_ft__debug_model.toml")
    module = raw["job"]["custom_config_module"]
    bare = {k: v for k, v in raw.items() if k != "job"}
    path = tmp_path / "ft_without_job.toml"
    path.write_text(dump_text(bare, "toml"), encoding="utf-8")
    assert "Invalid field names" in str(titan_parse(path, fast=True))
    assert titan_parse(path, fast=True, extra=("--job.custom_config_module", module)) is True
    t = adapters.read(copy.deepcopy(bare), "torchtitan")
    for key in ("fault_tolerance.sync_steps", "fault_tolerance.num_fragments"):
        (note,) = notes_at(t, key)
        assert note.fidelity is Fidelity.DEFERRED and f"--job.custom_config_module {module}" in note.reason
    assert not lossy_at(t, "fault_tolerance.sync_steps")
    assert notes_at(adapters.read(copy.deepcopy(raw), "torchtitan"), "fault_tolerance.sync_steps")[0].fidelity is \
        Fidelity.IGNORED  # fmt: skip
    other = {**bare, "job": {"custom_config_module": "torchtitan.experiments.simple_fsdp.job_config"}}
    path.write_text(dump_text(other, "toml"), encoding="utf-8")
    assert "Invalid field names" in str(titan_parse(path, fast=True))
    assert lossy_at(adapters.read(copy.deepcopy(other), "torchtitan"), "fault_tolerance.sync_steps")


def test_torchtitan_reader_agrees_with_configmanager(titan_parse, tmp_path):
    files = sorted((CORPUS / "torchtitan").glob("*.toml"))
    framework = lambda data: _torchtitan_verdict(data, titan_parse, tmp_path)  # noqa: E731
    # TOML has no null: that mutation cannot reach torchtitan
    cases = inputs(files, _budget(0.5), framework, exclude=lambda kind, path: kind == "null")
    found = disagreements("torchtitan", cases, framework, TORCHTITAN_DELIBERATE)
    assert not found["disagree"], _report(found)


# ---- torchtune -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tune_load():
    """What ``tune run`` does with a recipe config before the recipe runs: OmegaConf loads it and resolves its
    interpolations, and torchtune's ``config.instantiate`` builds its optimizer component (torchtune's package
    __init__ needs torchao, so only the modules used are imported)."""
    omegaconf = pytest.importorskip("omegaconf")
    from consumers import without_package_init

    without_package_init("torchtune", "0.6.1")
    import torch
    from torchtune.config._instantiate import instantiate

    def verdict(data: dict, tmp: Path) -> bool | str:
        import yaml

        path = tmp / "recipe.yaml"
        path.write_text(yaml.safe_dump(data), encoding="utf-8")
        try:
            cfg = omegaconf.OmegaConf.load(path)
            omegaconf.OmegaConf.to_container(cfg, resolve=True)
            if cfg.get("optimizer") is not None:
                instantiate(cfg.optimizer, torch.nn.Linear(2, 2).parameters())
        except Exception as exc:  # OmegaConf's and torch.optim's errors alike
            text = f"{type(exc).__name__}: {exc}"
            # A resolver the recipe registers itself, or a key given on the command line (tune run ... key=value):
            # not about the file alone.
            return f"skip: {text}" if "Unsupported interpolation type" in text or "InterpolationKey" in text else text
        return True

    return verdict


#: The keys of a recipe config torsh reads for their distributed meaning (every other key is kept as it is).
_TUNE_READ = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "enable_activation_checkpointing",
              "enable_activation_offloading", "dtype", "batch_size", "gradient_accumulation_steps", "clip_grad_norm",
              "optimizer", "compile", "optimizer_in_bwd", "data_parallel_shard_dim", "data_parallel_replicate_dim",
              "tensor_parallel_dim")  # fmt: skip
#: Where torsh refuses what ``tune run`` loads, on purpose: the recipe reads these keys without a check.
TORCHTUNE_DELIBERATE: dict[str, Callable[..., bool]] = {
    # `if cfg.get("fsdp_cpu_offload", False)`: the text "false" is true; `batch_size: "4"` fails in the DataLoader;
    # a dtype torchtune has no name for fails in training.get_dtype when the recipe starts.
    "a value of another type than the recipe uses, or a name it does not know (it reads them unchecked)":
        lambda original, kind, path, *_: kind == "null" or path[0] != "optimizer" and kind in (
            "as text", "yaml boolean", "wrong type", "auto", "out of range"),
}


def test_torchtune_reader_agrees_with_omegaconf_and_instantiate(tune_load, tmp_path):
    files = sorted((CORPUS / "torchtune").glob("*.yaml"))
    framework = lambda data: tune_load(data, tmp_path)  # noqa: E731
    # A number as text is not compared in the optimizer: PyYAML (YAML 1.1, which torsh parses with) gives the text
    # "1e-4" where OmegaConf reads a float, so the reader reads numeric text as the number - and a quoted one, which
    # OmegaConf keeps as text, looks the same to it.
    cases = inputs(files, _budget(0.5), framework, keys=lambda path: path[0] in _TUNE_READ,
                   exclude=lambda kind, path: kind == "as text" and path[0] == "optimizer")
    found = disagreements("torchtune", cases, framework, TORCHTUNE_DELIBERATE)
    assert not found["disagree"], _report(found)


# ---- horovodrun's argument parser ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def horovodrun(horovod_config_parser) -> types.SimpleNamespace:
    """horovodrun's ``parse_args`` (horovod/runner/launch.py of the 0.28.1 sdist, its argument actions and its call of
    the config parser), loaded without the rest of Horovod: the functions are taken from the file as they are and run
    against the standard library, PyYAML and the config parser above; ``horovod.__version__`` and the LSF probe are
    the only stand-ins (not on LSF: ``-np`` required)."""
    import argparse
    import ast
    import sys
    import warnings

    import yaml

    with tarfile.open(HOROVOD_SDIST) as sdist:
        source = sdist.extractfile("horovod-0.28.1/horovod/runner/launch.py").read().decode("utf-8")
    tree = ast.parse(source)
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)
                 and (node.name.startswith("make_") or node.name == "parse_args")]  # fmt: skip
    built: list = []

    class Parser(argparse.ArgumentParser):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    namespace = {"argparse": types.SimpleNamespace(**{**vars(argparse), "ArgumentParser": Parser}),
                 "warnings": warnings, "yaml": yaml, "os": os, "sys": sys, "textwrap": None,
                 "horovod": types.SimpleNamespace(__version__="0.28.1"),
                 "lsf": types.SimpleNamespace(LSFUtils=types.SimpleNamespace(using_lsf=lambda: False)),
                 "config_parser": horovod_config_parser, "check_build": lambda verbose: None}  # fmt: skip
    exec(compile(ast.Module(body=functions, type_ignores=[]), "launch.py", "exec"), namespace)  # noqa: S102

    def parse(argv: list[str]):
        """``horovodrun argv...`` parsed: the arguments, or the error text (argparse exits with status 2)."""
        import contextlib
        import io

        saved, sys.argv = sys.argv, ["horovodrun", *argv]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return namespace["parse_args"]()
        except SystemExit:
            return "argparse: " + err.getvalue().strip().splitlines()[-1]
        except Exception as exc:  # noqa: BLE001 - validate_config_args's ValueError
            return f"{type(exc).__name__}: {exc}"
        finally:
            sys.argv = saved

    with tarfile.open(HOROVOD_SDIST) as sdist:
        source = sdist.extractfile("horovod-0.28.1/horovod/runner/common/util/hosts.py").read().decode("utf-8")
    hosts = {"re": __import__("re")}
    exec(compile(ast.Module(body=[n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and  # noqa: S102
                                  n.name == "parse_hosts_and_slots"], type_ignores=[]), "hosts.py", "exec"), hosts)
    parse(["-np", "1"])
    return types.SimpleNamespace(parse=parse, actions=built[-1]._actions, hosts=hosts["parse_hosts_and_slots"])


def _horovodrun_argv(section: dict, actions: list) -> list[str] | str:
    """The command line that gives ``section`` (horovodrun's argument dests and their values), option by option from
    horovodrun's own parser; a refusal text where no command line can give it."""
    import shlex

    argv: list[str] = [] if section.get("num_proc") is not None else ["-np", "1"]  # a count given elsewhere
    for dest, value in section.items():
        if dest == "command":
            continue
        options = [a for a in actions if a.dest == dest and a.option_strings]
        if not options:
            return f"unknown: horovodrun has no argument {dest!r}"
        if value is None:
            continue  # not given
        switches = [a for a in options if a.nargs == 0]
        if switches:
            if not isinstance(value, bool):
                return f"switch: {dest} takes no value on the command line (true or false only)"
            chosen = next((a for a in switches if a.const is value), None)
            if chosen is not None:
                argv.append(chosen.option_strings[-1])
            continue
        action = options[0]
        many = action.nargs == 2 or dest == "nics"
        if isinstance(value, (list, tuple, set, dict)) != many:
            return f"shape: a command line gives {dest} {'a list' if many else 'one word'}"
        values = value if many else [value]
        if action.nargs == 2:
            argv += [action.option_strings[-1], *map(str, values)]
        else:
            for one in values:
                argv += [action.option_strings[-1], str(one)]
    command = section.get("command") or ["python", "train.py"]
    return argv + ["--", *(shlex.split(command) if isinstance(command, str) else map(str, command))]


def _horovodrun_section_verdict(section: dict, horovodrun: types.SimpleNamespace) -> bool | str:
    if not isinstance(section, dict):
        return "not a mapping"
    argv = _horovodrun_argv(section, horovodrun.actions)
    if isinstance(argv, str):
        return argv
    parsed = horovodrun.parse(argv)
    if isinstance(parsed, str):
        return parsed
    if not parsed.host_discovery_script and not parsed.hostfile:  # _run: the hosts, or localhost:<num_proc>
        try:
            horovodrun.hosts(parsed.hosts or f"localhost:{parsed.num_proc}")
        except ValueError as exc:
            return f"hosts: {exc}"
    return True


def _horovodrun_sections(horovodrun: types.SimpleNamespace) -> list[tuple[str, dict]]:
    """The horovodrun command lines of the launch corpus, as horovodrun parses them: the arguments they set."""
    import shlex

    lines = json.loads((CORPUS / "launch" / "script_lines.json").read_text())
    lines += json.loads((CORPUS / "launch" / "lines.json").read_text())
    out = []
    for line in lines:
        words = shlex.split(line["command"]) if line["command"].startswith("horovodrun ") else []
        parsed = horovodrun.parse(words[1:]) if words else None
        if parsed is None or isinstance(parsed, str):
            continue
        section = {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(parsed).items()
                   if v not in (None, False, []) and k not in ("run_func", "executable", "check_build")}  # fmt: skip
        out.append((line.get("id", words[2] if len(words) > 2 else "line"), section))
    return out


#: Where torsh refuses a horovodrun argument value that horovodrun's parser accepts, on purpose.
HOROVODRUN_DELIBERATE: dict[str, Callable[..., bool]] = {
    # argparse takes any integer; without hosts horovodrun then refuses it (localhost:<n>), with a host discovery
    # script the elastic driver waits for a count of processes that never comes. torsh names the key.
    "a process count below 1": lambda original, kind, path, *_: kind == "out of range" and path[-1] in (
        "num_proc", "min_num_proc", "max_num_proc", "slots"),
    # "auto" is the deferred value of every torsh reader: a program of that name is not taken for the command.
    "\"auto\" as the training command": lambda original, kind, path, *_: kind == "auto" and path[-1] == "command",
}


def test_horovod_reader_agrees_with_horovodruns_argument_parser(horovodrun, tmp_path):
    seeds = _horovodrun_sections(horovodrun)
    assert len(seeds) >= 10
    files = []
    for i, (name, section) in enumerate(seeds):
        path = tmp_path / f"{i:02d}_{name}.json"
        path.write_text(json.dumps({"horovodrun": section}))
        files.append(path)
    framework = lambda data: _horovodrun_section_verdict(data.get("horovodrun"), horovodrun)  # noqa: E731
    found = disagreements("horovod", inputs(files, MUTATIONS, framework, keys=lambda p: len(p) > 1),
                          framework, HOROVODRUN_DELIBERATE)  # fmt: skip
    assert len(found["agree"]) > len(seeds), found
    assert not found["disagree"], _report(found)


# ---- Lightning's strategy constructors -----------------------------------------------------------------------------

LIGHTNING_STRATEGIES = ("DeepSpeedStrategy", "FSDPStrategy", "ModelParallelStrategy")


def _lightning_classes(value: Any) -> Any:
    """A class set written as code in the file (``"{Block}"``) as the classes the script would pass."""
    import re

    import torch

    if isinstance(value, str) and re.fullmatch(r"\{\s*[\w.]+(\s*,\s*[\w.]+)*\s*,?\s*\}", value):
        return {type(name.strip().rsplit(".", 1)[-1], (torch.nn.Module,), {}) for name in value.strip("{} ").split(",")
                if name.strip()}  # fmt: skip
    return value


def _lightning_verdict(data: dict) -> bool | str:
    """Lightning 2.6's own checks on the call: the Trainer/Fabric precision (its precision parser), the strategy's
    constructor, then what the strategy hands on at setup: DeepSpeedStrategy's config (with the micro batch and the
    precision section Lightning adds) to DeepSpeedConfig, FSDPStrategy's keyword arguments to FSDP1's constructor."""
    import inspect
    import warnings

    from lightning.fabric.connector import _convert_precision_to_unified_args
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    strategies = [k for k in LIGHTNING_STRATEGIES if k in data]
    if len(strategies) != 1 or set(data) - {strategies[0], "Trainer", "Fabric"}:
        return "not one strategy call"
    name, args = strategies[0], data[strategies[0]]
    if not isinstance(args, dict):
        return "the strategy's arguments are not keyword arguments"
    precision = None
    for section in ("Trainer", "Fabric"):
        launch = data.get(section)
        if launch is None:
            continue
        if not isinstance(launch, dict):
            return f"{section}: not keyword arguments"
        if "precision" in launch:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    precision = _convert_precision_to_unified_args(launch["precision"])
            except (ValueError, TypeError) as exc:
                return f"precision: {exc}"
    kwargs = {k: _lightning_classes(v) for k, v in args.items()}
    try:
        if name == "ModelParallelStrategy":
            _model_parallel_setup(data, kwargs, precision)
        elif name == "DeepSpeedStrategy":
            strategy = DeepSpeedStrategy(**kwargs)
            config = copy.deepcopy(strategy.config)
            config.setdefault("train_micro_batch_size_per_gpu", kwargs.get("logging_batch_size_per_gpu", "auto")
                              if kwargs.get("logging_batch_size_per_gpu", "auto") != "auto" else 1)  # fmt: skip
            if precision in ("16-mixed", "bf16-mixed", "16-true", "bf16-true") and "fp16" not in config and \
                    "bf16" not in config:  # fmt: skip
                config["bf16" if precision.startswith("bf16") else "fp16"] = {"enabled": True}
            from deepspeed.runtime.config import DeepSpeedConfig

            DeepSpeedConfig(config)
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel

            strategy = FSDPStrategy(**kwargs)
            inspect.signature(FullyShardedDataParallel.__init__).bind(None, None, **strategy.kwargs)
    except Exception as exc:  # noqa: BLE001 - Lightning's and DeepSpeed's checks raise all kinds
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return True


def _model_parallel_setup(data: dict, kwargs: dict, precision: str | None) -> None:
    """ModelParallelStrategy as Lightning 2.6 runs it: the Trainer's or Fabric's class and constructor, the precisions
    the Trainer allows with it, then the strategy's set-up: "auto" sizes resolved (data-parallel: the nodes,
    tensor-parallel: the devices of a node) and Lightning's _setup_device_mesh on the world size the call gives,
    with torch's init_device_mesh replaced by its shape check (no process group here)."""
    from unittest import mock

    import torch
    from lightning.fabric.strategies import ModelParallelStrategy as FabricStrategy
    from lightning.fabric.strategies.model_parallel import _setup_device_mesh
    from lightning.pytorch.strategies import ModelParallelStrategy

    launch = data.get("Trainer", data.get("Fabric")) or {}
    fabric = "Trainer" not in data and ("Fabric" in data or "parallelize_fn" in kwargs)
    strategy = (FabricStrategy if fabric else ModelParallelStrategy)(**kwargs)
    if precision is not None and precision not in ("32-true", "bf16-mixed", "bf16-true", "16-true"):
        raise ValueError(f"The `ModelParallelStrategy` does not support precision={precision!r}")
    devices, nodes = launch.get("devices", "auto"), launch.get("num_nodes", 1)
    devices = devices if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0 else None
    dp, tp = strategy._data_parallel_size, strategy._tensor_parallel_size
    counted = not (tp == "auto" and devices is None)
    dp, tp = nodes if dp == "auto" else dp, devices if tp == "auto" else tp

    def shape_check(device_type: str, mesh_shape: tuple, mesh_dim_names: tuple) -> None:
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in mesh_shape):
            raise ValueError(f"init_device_mesh: a mesh dimension is not a positive size: {mesh_shape}")

    if not counted:  # the devices are counted when the script runs: only the data-parallel size can be judged
        shape_check("cpu", (dp,), ())
        return
    both = all(isinstance(n, int) and not isinstance(n, bool) for n in (dp, tp))
    world = devices * nodes if devices is not None else (dp * tp if both else -1)
    with mock.patch("torch.distributed.device_mesh.init_device_mesh", shape_check):
        _setup_device_mesh(dp, tp, world, torch.device("cpu"))


#: Where torsh refuses what Lightning accepts, on purpose: a whole DeepSpeed config given to DeepSpeedStrategy is
#: judged as the deepspeed dialect judges it (DEEPSPEED_DELIBERATE, on the key inside the config).
_LIGHTNING_TO_CONFIG = {
    **{k: ("zero_optimization", k) for k in ("stage", "contiguous_gradients", "overlap_comm", "allgather_partitions",
                                             "reduce_scatter", "allgather_bucket_size", "reduce_bucket_size",
                                             "sub_group_size")},
    **{k: ("activation_checkpointing", k) for k in ("partition_activations", "cpu_checkpointing",
                                                    "contiguous_memory_optimization",
                                                    "synchronize_checkpoint_boundary")},
    "zero_allow_untested_optimizer": ("zero_allow_untested_optimizer",),
    "offload_optimizer_device": ("zero_optimization", "offload_optimizer", "device"),
    "offload_params_device": ("zero_optimization", "offload_param", "device"),
    "pin_memory": ("zero_optimization", "offload_optimizer", "pin_memory"),
    "nvme_path": ("zero_optimization", "offload_optimizer", "nvme_path"),
}  # fmt: skip


def _config_path(path: tuple) -> tuple | None:
    """Where a DeepSpeedStrategy argument lands in the DeepSpeed config Lightning builds (None: not in it)."""
    if path[:2] == ("DeepSpeedStrategy", "config") and len(path) > 2:
        return path[2:]
    return _LIGHTNING_TO_CONFIG.get(path[1]) if path[:1] == ("DeepSpeedStrategy",) and len(path) == 2 else None


#: Where torsh refuses what Lightning accepts, on purpose. What DeepSpeedStrategy puts in the DeepSpeed config is
#: judged as the deepspeed dialect judges it (DEEPSPEED_DELIBERATE, on the key of the config it lands on).
LIGHTNING_DELIBERATE: dict[str, Callable[..., bool]] = {
    **{f"in the DeepSpeed config: {why}": (lambda rule: lambda original, kind, path, *rest: _config_path(path) is
                                           not None and rule(original, kind, _config_path(path), *rest))(rule)
       for why, rule in DEEPSPEED_DELIBERATE.items()},
    # `if offload_optimizer:`: the text "false" (or "off", a list [False]) turns the offload on. torsh asks for a
    # boolean rather than translate that.
    "text, a list or \"auto\" for a DeepSpeedStrategy switch Lightning only tests for truth":
        lambda original, kind, path, *_: isinstance(original, bool) and kind in ("as text", "yaml boolean", "auto",
                                                                                 "wrong type"),
}  # fmt: skip


def test_lightning_reader_agrees_with_lightnings_strategy_constructors(deepspeed_ready):
    pytest.importorskip("lightning", reason="Lightning is installed by requirements-dev.txt")
    files = sorted((CORPUS / "lightning").glob("*.json"))
    cases = inputs(files, _budget(2), _lightning_verdict, keys=lambda path: path[0] in LIGHTNING_STRATEGIES)
    found = disagreements("lightning", cases, _lightning_verdict, LIGHTNING_DELIBERATE)
    assert len(found["agree"]) > len(files), found
    assert not found["disagree"], _report(found)


@pytest.mark.parametrize("call, runs", [
    ({"Trainer": {"devices": 4, "num_nodes": 2, "precision": "bf16-mixed"},
      "ModelParallelStrategy": {"data_parallel_size": 2, "tensor_parallel_size": 4}}, True),
    ({"Trainer": {"devices": 4}, "ModelParallelStrategy": {}}, True),  # auto: 1 node x 4 devices
    ({"Trainer": {"devices": 4}, "ModelParallelStrategy": {"tensor_parallel_size": 2}}, False),  # auto dp = 1 node
    ({"Trainer": {"devices": 4, "precision": "16-mixed"}, "ModelParallelStrategy": {}}, False),
    ({"Trainer": {"devices": 4}, "ModelParallelStrategy": {"data_parallel_sise": 2}}, False),
    ({"Trainer": {"devices": 4}, "ModelParallelStrategy": {"tensor_parallel_size": "4"}}, False),
    ({"ModelParallelStrategy": {"data_parallel_size": -2, "tensor_parallel_size": -2}}, False),
    ({"Fabric": {"devices": 4}, "ModelParallelStrategy": {"data_parallel_size": 4, "tensor_parallel_size": 1}}, False),
    ({"Fabric": {"devices": 4}, "ModelParallelStrategy": {"parallelize_fn": "parallelize", "data_parallel_size": 4,
                                                          "tensor_parallel_size": 1}}, True),
    ({"Trainer": {"devices": 2}, "ModelParallelStrategy": {"save_distributed_checkpoint": None}}, True),
])  # fmt: skip
def test_lightning_modelparallelstrategy_is_read_as_lightning_sets_it_up(call, runs, deepspeed_ready):
    """ModelParallelStrategy (Lightning 2.6) keeps its arguments unchecked; its set-up resolves "auto" (data-parallel:
    the nodes, tensor-parallel: the devices of a node) and refuses sizes whose product is not the world size, and the
    Trainer allows it four precisions. torsh reads the sizes into the parallelism section (tp; the world size their
    product) with FSDP2 over the data-parallel dimension, and refuses what Lightning refuses naming the argument."""
    pytest.importorskip("lightning", reason="Lightning is installed by requirements-dev.txt")
    assert (_lightning_verdict(copy.deepcopy(call)) is True) is runs, _lightning_verdict(copy.deepcopy(call))
    result = torsh_reads(call, "lightning")
    assert isinstance(result, Translation) is runs, result
    if not runs:
        assert all(p.path.startswith(("ModelParallelStrategy.", "Trainer.")) for p in result.problems), result
        return
    cfg, args = result.result, call["ModelParallelStrategy"]
    assert cfg.sharding.stage == 3
    assert cfg.parallelism.tp == args.get("tensor_parallel_size", call.get("Trainer", {}).get("devices"))
    if "data_parallel_size" in args:
        assert cfg.launch.world_size == args["data_parallel_size"] * cfg.parallelism.tp
    assert cfg.checkpoint.state_dict_type == ("full" if "save_distributed_checkpoint" in args else "sharded")


def test_lightning_nvme_path_reaches_deepspeed_in_every_offload_section(deepspeed_ready):
    """DeepSpeedStrategy writes nvme_path into each offload section it builds, whatever the device: DeepSpeed then
    checks it as a path (found by a triple of mutations: offload to cpu with a list for nvme_path)."""
    pytest.importorskip("lightning", reason="Lightning is installed by requirements-dev.txt")
    call = {"DeepSpeedStrategy": {"stage": 3, "offload_optimizer": True, "nvme_path": ["/local_nvme"]}}
    assert "nvme_path" in str(_lightning_verdict(copy.deepcopy(call)))
    result = torsh_reads(call, "lightning")
    assert isinstance(result, ConfigError) and result.problems[0].path == "DeepSpeedStrategy.nvme_path"
    call["DeepSpeedStrategy"]["nvme_path"] = "/local_nvme"
    assert _lightning_verdict(copy.deepcopy(call)) is True
    assert notes_at(torsh_reads(call, "lightning"), "DeepSpeedStrategy.nvme_path")[0].fidelity is Fidelity.IGNORED


def test_lightning_deepspeedstrategy_disagreements_found_are_fixed():
    """What the comparison with Lightning found: an argument DeepSpeedStrategy does not have is refused (Lightning:
    TypeError), a config given as text is refused (Lightning reads a file of that path); a null is Lightning's
    default; numbers written as text reach DeepSpeed's reader as Lightning hands them on; the fp16 loss-scaling
    arguments go into the fp16 section under 16-bit precision (they were dropped without a note)."""
    with pytest.raises(ConfigError, match="did you mean 'reduce_bucket_size'"):
        adapters.read({"DeepSpeedStrategy": {"reduce_bucket_sizes": 5}}, "lightning")
    with pytest.raises(ConfigError, match="DeepSpeedStrategy.config"):
        adapters.read({"DeepSpeedStrategy": {"config": "ds_config.json"}}, "lightning")
    t = adapters.read({"DeepSpeedStrategy": {"offload_optimizer": None, "config": None, "stage": "3"}}, "lightning")
    assert t.result.sharding.stage == 3 and t.result.offload.optimizer == "none"
    t = adapters.read({"Trainer": {"precision": "16-mixed"}, "DeepSpeedStrategy": {"loss_scale_window": 500,
                                                                                     "initial_scale_power": 12}},
                      "lightning")  # fmt: skip
    scaled = {n.source_path for n in t.notes if not n.lossy}
    assert {"DeepSpeedStrategy.loss_scale_window", "DeepSpeedStrategy.initial_scale_power"} <= scaled
    t = adapters.read({"DeepSpeedStrategy": {"loss_scale_window": 500}}, "lightning")
    (note,) = [n for n in t.notes if n.source_path == "DeepSpeedStrategy.loss_scale_window"]
    assert note.fidelity is Fidelity.IGNORED and "fp16" in note.reason
