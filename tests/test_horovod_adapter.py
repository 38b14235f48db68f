"""The horovod dialect: horovodrun flags, --config-file YAML, HOROVOD_* environment, DistributedOptimizer kwargs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from golden import check_golden
from adapter_validator import Lossy, assert_accounted, validate_all, validate_identity

from torsh import adapters
from torsh.adapters import horovod
from torsh.config import TorshConfig
from torsh.errors import ConfigError
from torsh.formats import dump_text, load_file
from torsh.translate import Fidelity


def notes_by_source(translation):
    return {n.source_path: n for n in translation.notes}


def test_config_file_example_reads_every_section(examples):
    raw, _ = load_file(examples / "horovod" / "horovodrun_config.yaml")
    assert adapters.sniff(raw) == "horovod"
    t = adapters.read(raw)
    assert_accounted(raw, t)
    cfg = t.result
    assert cfg.communication.fusion_threshold_bytes == 64 * 1024 * 1024
    assert cfg.ddp.bucket_cap_mb == 64.0
    assert cfg.communication.cycle_time_ms == 2.5
    assert cfg.communication.hierarchical_allreduce is True and cfg.communication.hierarchical_allgather is False
    assert cfg.communication.backend == "gloo" and cfg.communication.timeout_s == 60
    timeline = cfg.monitoring.timeline
    assert (timeline.filename, timeline.mark_cycles) == ("/tmp/horovod_timeline.json", True)
    assert cfg.monitoring.log_level == "INFO"
    notes = notes_by_source(t)
    assert notes["params.cache_capacity"].fidelity is Fidelity.IGNORED
    assert cfg.extensions["horovod"]["config_file.stall_check.warning_time_seconds"] == 120


def test_fusion_threshold_is_exact_in_bytes_and_approximate_as_ddp_buckets():
    t = adapters.read({"horovodrun": {"fusion_threshold_mb": 32}}, "horovod")
    found = {(n.target_path, n.fidelity) for n in t.notes if n.source_path == "horovodrun.fusion_threshold_mb"}
    assert found == {("communication.fusion_threshold_bytes", Fidelity.EXACT),
                     ("ddp.bucket_cap_mb", Fidelity.APPROXIMATE)}
    bucket = next(n for n in t.notes if n.target_path == "ddp.bucket_cap_mb")
    assert "DDP" in bucket.reason and "Horovod" in bucket.reason
    assert t.result.ddp.bucket_cap_mb == 32.0


def test_hide_timestamp_is_reported_as_silently_ignored_by_horovod():
    t = adapters.read({"logging": {"level": "debug", "hide_timestamp": True}})
    note = notes_by_source(t)["logging.hide_timestamp"]
    assert note.fidelity is Fidelity.IGNORED and "silently ignores" in note.reason and "with_timestamp" in note.reason
    assert notes_by_source(t)["logging.level"].fidelity is Fidelity.EXACT
    # with_timestamp is the key Horovod reads: kept, and written back.
    t = adapters.read({"logging": {"with_timestamp": False}})
    assert adapters.write(t.result, "horovod").result["config_file"]["logging"] == {"with_timestamp": False}


def test_env_mapping_is_sniffed_and_parsed_like_horovod():
    env = {"HOROVOD_FUSION_THRESHOLD": "33554432", "HOROVOD_CYCLE_TIME": "0.5", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
           "HOROVOD_TIMELINE": "/tmp/t.json", "HOROVOD_LOG_LEVEL": "warning", "HOROVOD_RANK": "3",
           "HOROVOD_WITH_PYTORCH": "1", "PATH": "/usr/bin"}
    assert adapters.sniff(env) == "horovod"
    t = adapters.read(env)
    assert_accounted(env, t)
    cfg = t.result
    assert cfg.communication.fusion_threshold_bytes == 32 * 1024 * 1024 and cfg.communication.cycle_time_ms == 0.5
    assert cfg.communication.hierarchical_allreduce and cfg.monitoring.log_level == "WARNING"
    notes = notes_by_source(t)
    assert "run time" in notes["HOROVOD_RANK"].reason
    assert "built" in notes["HOROVOD_WITH_PYTORCH"].reason
    assert notes["PATH"].fidelity is Fidelity.IGNORED
    assert "HOROVOD_RANK" not in str(cfg.extensions)  # per-process values are not a setting to carry


def test_env_booleans_must_be_integers_as_horovod_parses_them():
    with pytest.raises(ConfigError) as exc:
        adapters.read({"env": {"HOROVOD_HIERARCHICAL_ALLREDUCE": "true"}}, "horovod")
    assert exc.value.problems[0].path == "env.HOROVOD_HIERARCHICAL_ALLREDUCE" and "1 or 0" in str(exc.value)


def test_precedence_flag_beats_config_file_beats_environment(examples):
    raw, _ = load_file(examples / "horovod" / "horovod_job.yaml")
    t = adapters.read(raw)
    assert_accounted(raw, t)
    assert t.result.communication.fusion_threshold_bytes == 32 * 1024 * 1024  # the flag, not the env's 128 MB
    loser = notes_by_source(t)["env.HOROVOD_FUSION_THRESHOLD"]
    assert loser.fidelity is Fidelity.IGNORED and "overridden by horovodrun.fusion_threshold_mb" in loser.reason
    t = adapters.read({"config_file": {"params": {"cycle_time_ms": 4}}, "env": {"HOROVOD_CYCLE_TIME": "9"}}, "horovod")
    assert t.result.communication.cycle_time_ms == 4
    assert "overridden by config_file" in notes_by_source(t)["env.HOROVOD_CYCLE_TIME"].reason


def test_distributed_optimizer_kwargs_map_to_the_core_model():
    t = adapters.read({"distributed_optimizer": {"compression": "hvd.Compression.fp16", "backward_passes_per_step": 4,
                                                 "op": "hvd.Sum", "gradient_predivide_factor": 1.0}}, "horovod")
    cfg = t.result
    assert cfg.compression.method == "fp16" and cfg.batch.gradient_accumulation_steps == 4
    assert cfg.gradients.reduce_op == "sum" and cfg.gradients.predivide_factor == 1.0
    bpps = notes_by_source(t)["distributed_optimizer.backward_passes_per_step"]
    assert bpps.fidelity is Fidelity.APPROXIMATE and "loss" in bpps.reason
    t = adapters.read({"distributed_optimizer": {"gradient_predivide_factor": 8.0}}, "horovod")
    assert t.result.gradients.predivide_factor == 8.0


@pytest.mark.parametrize("op", ["Adasum", "Min", "Max", "Product"])
def test_adasum_and_other_ops_are_unsupported_with_the_reason(op):
    t = adapters.read({"distributed_optimizer": {"op": op}}, "horovod")
    note = notes_by_source(t)["distributed_optimizer.op"]
    assert note.fidelity is Fidelity.UNSUPPORTED
    assert t.result.gradients.reduce_op == "mean"
    if op == "Adasum":
        assert "no torch.distributed equivalent" in note.reason
    assert adapters.write(t.result, "horovod").result["distributed_optimizer"]["op"] == op  # kept for Horovod


def test_elastic_min_max_processes_become_nodes_with_slots():
    t = adapters.read({"horovodrun": {"min_num_proc": 4, "max_num_proc": 12, "slots": 4,
                                      "host_discovery_script": "./discover.sh"}}, "horovod")
    launch = t.result.launch
    assert (launch.nnodes, launch.max_nnodes, launch.nproc_per_node) == (1, 3, 4)
    notes = notes_by_source(t)
    assert notes["horovodrun.min_num_proc"].fidelity is Fidelity.APPROXIMATE
    assert "counts processes" in notes["horovodrun.min_num_proc"].reason
    assert notes["horovodrun.host_discovery_script"].fidelity is Fidelity.UNSUPPORTED
    back = adapters.write(t.result, "horovod").result["horovodrun"]
    assert (back["min_num_proc"], back["max_num_proc"], back["slots"]) == (4, 12, 4)
    # Without slots every "node" is one process, so the counts survive.
    launch = adapters.read({"horovodrun": {"min_num_proc": 2, "max_num_proc": 6}}, "horovod").result.launch
    assert (launch.nnodes, launch.max_nnodes, launch.nproc_per_node) == (2, 6, 1)


def test_horovodrun_launch_flags_and_command_line():
    flags = {"num_proc": 8, "hosts": "a:4,b:4", "use_gloo": True, "hierarchical_allreduce": True,
             "command": ["python", "train.py", "--epochs", "3"]}
    t = adapters.read({"horovodrun": flags}, "horovod")
    assert [h.model_dump() for h in t.result.launch.hosts] == [{"name": "a", "slots": 4}, {"name": "b", "slots": 4}]
    assert (t.result.launch.script, t.result.launch.script_args) == ("train.py", ["--epochs", "3"])
    written = adapters.write(t.result, "horovod").result
    assert horovod.command_line(written["horovodrun"]) == [
        "horovodrun", "--hierarchical-allreduce", "--gloo", "-H", "a:4,b:4", "-np", "8", "python", "train.py",
        "--epochs", "3"]


def test_unknown_keys_suggest_the_spelling():
    # horovodrun's config parser passes over a key it does not read: a dropped (lossy) note, not a refusal
    t = adapters.read({"params": {"fusion_treshold_mb": 64}})
    note = next(n for n in t.notes if n.source_path == "params.fusion_treshold_mb")
    assert note.fidelity is Fidelity.DROPPED and "did you mean 'fusion_threshold_mb'" in note.reason
    assert t.lossy  # --strict fails on it
    with pytest.raises(ConfigError) as exc:
        adapters.read({"env": {"HOROVOD_CYCLE_TIMES": "1"}}, "horovod")
    assert exc.value.problems[0].suggestion == "HOROVOD_CYCLE_TIME"


def test_values_are_validated_as_horovodrun_does():
    with pytest.raises(ConfigError, match="cycle_time_ms"):
        adapters.read({"params": {"cycle_time_ms": -1}})
    with pytest.raises(ConfigError, match="gaussian_process_noise"):
        adapters.read({"autotune": {"gaussian_process_noise": 1.5}})
    with pytest.raises(ConfigError, match="controller"):
        adapters.read({"controller": "nccl", "params": {}})
    with pytest.raises(ConfigError, match="compression"):
        adapters.read({"distributed_optimizer": {"compression": "bf16"}}, "horovod")


def test_config_file_round_trip_is_lossless():
    raw = {"config_file": {"controller": "mpi", "params": {"cycle_time_ms": 3.5, "cache_capacity": 0,
                                                           "hierarchical_allgather": True},
                           "autotune": {"enabled": True, "log_file": "at.csv"}, "timeline": {"filename": "tl.json"},
                           "stall_check": {"enabled": False}, "library_options": {"num_nccl_streams": 2},
                           "logging": {"level": "ERROR", "with_timestamp": True}}}
    validate_identity("horovod", raw, normalise=lambda d: d["config_file"], expect_lossless=False)


def test_write_gives_flags_config_file_and_environment_that_read_back_the_same():
    cfg = TorshConfig.from_dict({"communication": {"fusion_threshold_bytes": 16 * 1024 * 1024, "cycle_time_ms": 1.5,
                                                   "hierarchical_allreduce": True, "backend": "gloo"},
                                 "compression": {"method": "fp16"}, "gradients": {"predivide_factor": 2.0}})
    written = adapters.write(cfg, "horovod").result
    assert written["horovodrun"]["fusion_threshold_mb"] == 16
    assert written["config_file"]["params"]["cycle_time_ms"] == 1.5
    assert written["env"]["HOROVOD_FUSION_THRESHOLD"] == str(16 * 1024 * 1024)
    assert written["env"]["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "1"
    assert written["distributed_optimizer"] == {"compression": "fp16", "gradient_predivide_factor": 2.0}
    for form in ("horovodrun", "config_file", "env"):
        single = {form: written[form], "distributed_optimizer": written["distributed_optimizer"]}
        back = adapters.read(single, "horovod").result
        assert back.communication.model_dump() == cfg.communication.model_dump(), form
        assert back.compression.method == "fp16" and back.gradients.predivide_factor == 2.0


def test_what_horovod_cannot_express_is_reported():
    validate_all(
        {"sharding": {"stage": 3}, "compression": {"method": "bf16"}, "precision": {"param_dtype": "bf16"}},
        write={"horovod": Lossy({"sharding.stage": "unsupported", "compression.method": "unsupported",
                                 "precision.param_dtype": "unsupported"})},
    )
    written = adapters.write(TorshConfig.from_dict({"sharding": {"stage": 2}}), "horovod")
    note = next(n for n in written.notes if n.source_path == "sharding.stage")
    assert "no ZeRO / FSDP sharding" in note.reason
    validate_all({"gradients": {"reduce_op": "sum"}, "batch": {"gradient_accumulation_steps": 2}},
                 write={"horovod": Lossy({"batch.gradient_accumulation_steps": "approximate"},
                                         payload={"distributed_optimizer": {"op": "Sum",
                                                                            "backward_passes_per_step": 2}})})


def test_the_adapter_never_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1")
    assert adapters.read({"params": {"cycle_time_ms": 1}}).result.communication.fusion_threshold_bytes is None


def test_golden_native_conversion(examples):
    """The config-file example converted to the native TOML (regenerate with `make goldens`)."""
    source = examples / "horovod" / "horovodrun_config.yaml"
    golden = source.with_suffix(".expected.toml")
    text = dump_text(adapters.write(adapters.load(source).result, "torsh").result, "toml")
    check_golden(golden, text)
    assert adapters.load(golden).result == adapters.load(source).result


def test_horovod_only_knobs_are_written_in_all_three_spellings_with_their_inversions():
    t = adapters.read({"stall_check": {"enabled": False}, "logging": {"with_timestamp": False},
                       "params": {"cache_capacity": 0}})
    written = adapters.write(t.result, "horovod").result
    assert written["horovodrun"] == {"cache_capacity": 0, "no_stall_check": True, "log_with_timestamp": False}
    assert written["env"] == {"HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_STALL_CHECK_DISABLE": "1",
                              "HOROVOD_LOG_HIDE_TIME": "1"}
    assert horovod.command_line(written["horovodrun"]) == [
        "horovodrun", "--cache-capacity", "0", "--no-stall-check", "--log-without-timestamp"]


def test_schema_lists_every_tunable_in_every_spelling():
    from torsh import schemas

    schema = schemas.load("horovod")["properties"]
    flags, sections = schema["horovodrun"]["properties"], schema["config_file"]["properties"]
    for t in horovod.TUNABLES:
        section, key = t.yaml.split(".")
        assert t.flag in flags and key in sections[section]["properties"], t
        assert f"env.{t.env}" in horovod.FIELD_MAP
    assert not schemas.check({"horovodrun": {"cycle_time_ms": 1.5}, "env": {"HOROVOD_CYCLE_TIME": "1"}}, "horovod")
    assert schemas.check({"horovodrun": {"cycle_time_ms": "fast"}}, "horovod")


def test_auto_is_never_written_into_horovod_settings(examples):
    """Horovod has no "auto": values the source leaves to the launcher or script are deferred notes instead."""
    from torsh import adapters

    cfg = adapters.load(examples / "deepspeed" / "zero1_fp16_auto.json").result
    written = adapters.write(cfg, "horovod")
    assert "auto" not in json.dumps(written.result)
    assert any(n.fidelity.value == "deferred" and n.target_path is None for n in written.notes)


@pytest.mark.parametrize("name", ["config.default.2019-08-23", "config.test.2019-08-23", "config.test.2020-09-26"])
def test_keys_of_horovods_own_older_config_files_are_read_as_having_no_effect(name):
    """Horovod's own config files from before 0.21.1 use keys horovodrun 0.28.1 passes over (mlsl_bgt_affinity,
    ccl_bgt_affinity, ...): read with an ignored note that names the key it reads now, and written back as kept."""
    raw, _ = load_file(Path(__file__).parent / "fixtures" / "corpus" / "horovod" / f"horovod__horovod__{name}.yaml")
    t = horovod.read(raw)
    assert_accounted(raw, t)
    notes = notes_by_source(t)
    old = [k for k in notes if k.rsplit(".", 1)[-1] in ("mlsl_bgt_affinity", "ccl_bgt_affinity", "enabled",
                                                          "batches_per_sample", "mpi_threads_disabled")
           and not k.startswith(("autotune.enabled", "stall_check"))]  # fmt: skip
    assert old
    for key in old:
        assert notes[key].fidelity is Fidelity.IGNORED and "0.28.1 does not read" in notes[key].reason, key
    affinity = [k for k in old if "bgt_affinity" in k]
    assert all("thread_affinity" in notes[k].reason for k in affinity)
    written = horovod.write(t.result).result["config_file"]
    for key in old:
        section, leaf = key.split(".")
        assert written[section][leaf] == raw[section][leaf]


def test_old_affinity_variables_are_read_as_having_no_effect():
    t = horovod.read({"env": {"HOROVOD_CCL_BGT_AFFINITY": "1", "HOROVOD_MLSL_BGT_AFFINITY": "2"}})
    assert {n.fidelity for n in t.notes} == {Fidelity.IGNORED}
    assert all("HOROVOD_THREAD_AFFINITY" in n.reason for n in t.notes)


def test_the_map_shows_where_each_spelling_of_a_tunable_goes():
    """One concept table (TUNABLES): each tunable's flag, config-file key and variable are map entries that name
    their form and the core path they set."""
    for t in horovod.TUNABLES:
        for form, key in (("flag", f"horovodrun.{t.flag}"), ("yaml", f"config_file.{t.yaml}"), ("env", f"env.{t.env}")):
            rule = horovod.FIELD_MAP[key]
            assert (rule.form, rule.to, rule.tunable) == (form, t.core, t), key
    assert horovod.FIELD_MAP["env.HOROVOD_FUSION_THRESHOLD"].to == "communication.fusion_threshold_bytes"


def test_horovodrun_section_numbers_as_text_and_nulls_as_horovodruns_parser_reads_them():
    """horovodrun's argparse converts each word by the option's type (``--cycle-time-ms 2.5``) and leaves a flag
    not given at None: a number written as text is that number, a null is the flag not given (a note says so)."""
    t = adapters.read({"horovodrun": {"num_proc": "4", "cycle_time_ms": "2.5", "fusion_threshold_mb": None}},
                      "horovod")  # fmt: skip
    assert t.result.launch.world_size == 4 and t.result.communication.cycle_time_ms == 2.5
    (note,) = [n for n in t.notes if n.source_path == "horovodrun.fusion_threshold_mb"]
    assert note.fidelity is Fidelity.IGNORED and "not given" in note.reason
    with pytest.raises(ConfigError, match="horovodrun.num_proc"):
        adapters.read({"horovodrun": {"num_proc": "four"}}, "horovod")
