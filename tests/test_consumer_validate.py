"""``validate`` agrees with the consumer: exit 2 where DeepSpeed 0.19.8 refuses the file, a note where it ignores a
key, and a ``"$schema"`` key accepted in every dialect."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest

from torsh import adapters, cli
from torsh.adapters._deepspeed_rules import STRICT_SECTIONS
from torsh.errors import ConfigError
from torsh.translate import Fidelity

os.environ.setdefault("DS_ACCELERATOR", "cpu")

#: A minimal valid body for each strict section, to put one unknown key next to.
_BODIES = {"zero_optimization": {"stage": 1}, "fp16": {"enabled": True}, "bf16": {"enabled": True},
           "bfloat16": {"enabled": True}}  # fmt: skip


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("section", STRICT_SECTIONS)
def test_an_unknown_key_in_a_section_deepspeed_refuses_is_exit_2(section, tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 decides what is refused")
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = {"train_batch_size": 8, section: {**_BODIES.get(section, {}), "enabledd": True}}
    with pytest.raises(Exception, match="Extra inputs are not permitted"):
        DeepSpeedConfig(raw)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    code, _, err = run_cli(["validate", str(path), "--from", "deepspeed"])
    assert code == 2 and f"{section}.enabledd" in err


def test_an_unknown_top_level_key_deepspeed_ignores_stays_a_lossy_note(tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 decides what is refused")
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = {"train_batch_size": 8, "gradient_clippping": 1.0}
    DeepSpeedConfig(raw)  # accepted: DeepSpeed ignores unknown top-level keys
    note = next(n for n in adapters.read(raw, "deepspeed").notes if n.source_path == "gradient_clippping")
    assert note.lossy and "gradient_clipping" in note.reason


@pytest.mark.parametrize("name, text", [
    ("ds.json", '{"$schema": "deepspeed.schema.json", "train_batch_size": 8}'),
    ("acc.yaml", "$schema: accelerate.schema.json\ndistributed_type: MULTI_GPU\nnum_processes: 2\n"),
    ("fsdp.json", '{"$schema": "fsdp.schema.json", "sharding_strategy": "FULL_SHARD"}'),
    ("job.toml", '"$schema" = "torsh.schema.json"\n[sharding]\nstage = 2\n'),
    ("fairscale.json", '{"$schema": "fairscale.schema.json", "fsdp": {"mixed_precision": true}}'),
])  # fmt: skip
def test_a_schema_key_is_allowed_in_every_dialect(name, text, tmp_path):
    path = tmp_path / name
    path.write_text(text)
    translation = adapters.load(path)
    note = translation.notes[0]
    assert (note.source_path, note.fidelity) == ("$schema", Fidelity.IGNORED)
    assert run_cli(["validate", str(path)])[0] == 0


def test_deepspeed_auto_zero_stage_is_not_an_error():
    assert adapters.read({"train_batch_size": 8, "zero_optimization": {"stage": "auto"}}, "deepspeed").result


def test_wrong_type_in_a_strict_section_is_an_error():
    with pytest.raises(ConfigError):
        adapters.read({"train_batch_size": 8, "fp16": {"enabled": "yes please"}}, "deepspeed")


# ---- a config with no batch size -----------------------------------------------------------------------------------

#: DeepSpeed's own autotuning template (ZeRO-3 alone, no batch size: its autotuner writes one in before each run).
NO_BATCH = Path(__file__).parent / "fixtures" / "corpus" / "deepspeed" / "deepspeedai__DeepSpeed__template_zero3.json"
DEEPSPEED_SAYS = "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"


@pytest.mark.parametrize("extra", [{}, {"gradient_accumulation_steps": 4}], ids=["template", "accumulation-only"])
def test_a_config_without_a_batch_size_deepspeed_refuses_fails_strict_naming_the_key(extra, tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 decides what is refused")
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = {**json.loads(NO_BATCH.read_text()), **extra}
    with pytest.raises(Exception, match=DEEPSPEED_SAYS):
        DeepSpeedConfig(raw)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    assert run_cli(["validate", str(path)])[0] == 0  # read as it is: a caller may still write a batch in
    code, out, err = run_cli(["validate", "--strict", str(path)])
    assert code == 1 and "train_micro_batch_size_per_gpu" in err and DEEPSPEED_SAYS in err
    note = next(n for n in adapters.load(path).notes if n.source_path == "train_micro_batch_size_per_gpu")
    assert (note.target_path, note.fidelity, note.lossy) == ("batch.micro_batch_size", Fidelity.DEFERRED, True)
    assert '"auto"' in note.reason  # how to have the HF Trainer / Accelerate fill it


def test_the_strict_finding_is_in_the_json_report():
    code, out, _ = run_cli(["validate", "--strict", "--report", "json", str(NO_BATCH)])
    notes = json.loads(out)["files"][0]["report"]["notes"]
    flagged = [n["source_path"] for n in notes if n["refused"]]
    assert (code, flagged) == (1, ["train_micro_batch_size_per_gpu"])


@pytest.mark.parametrize("batch", [{"train_micro_batch_size_per_gpu": "auto"}, {"train_batch_size": "auto"},
                                   {"train_micro_batch_size_per_gpu": 2}, {"train_batch_size": 16}])  # fmt: skip
def test_a_batch_size_auto_or_a_number_passes_strict(batch, tmp_path):
    """"auto" stays a deferred value --strict accepts: the HF Trainer and Accelerate fill it (a key left out they
    do not fill)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**json.loads(NO_BATCH.read_text()), **batch}))
    assert run_cli(["validate", "--strict", str(path)])[0] == 0
    assert not any(n.refused for n in adapters.load(path).notes)


def test_an_accelerate_config_naming_a_file_without_a_batch_size_fails_strict(tmp_path, monkeypatch):
    """Accelerate fills the batch keys written "auto" in the file it names, and only those: DeepSpeed then refuses
    the file the same way."""
    (tmp_path / "ds.json").write_text(NO_BATCH.read_text())
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\nnum_processes: 2\n"
                                       "deepspeed_config:\n  deepspeed_config_file: ds.json\n")  # fmt: skip
    monkeypatch.chdir(tmp_path)  # where accelerate launch opens the file from
    code, _, err = run_cli(["validate", "--strict", "acc.yaml"])
    assert code == 1 and "ds.json:train_micro_batch_size_per_gpu" in err


def test_lightning_sets_the_micro_batch_a_deepspeed_config_leaves_out():
    """DeepSpeedStrategy (the Trainer's: the dataloader's batch size; Fabric's: 1) writes the micro batch into the
    config it hands DeepSpeed when there is none: no refusal to report."""
    from torsh.adapters import lightning

    config = json.loads(NO_BATCH.read_text())
    for raw in ({"Trainer": {"devices": 2}, "DeepSpeedStrategy": {"config": config}},
                {"Trainer": {"devices": 2}, "DeepSpeedStrategy": {"stage": 3}}):  # fmt: skip
        assert not lightning.read(raw).lossy
