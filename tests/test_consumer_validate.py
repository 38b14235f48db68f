"""``validate`` agrees with the consumer: exit 2 where DeepSpeed 0.19.8 refuses the file, a note where it ignores a
key, and a ``"$schema"`` key accepted in every dialect."""

from __future__ import annotations

import contextlib
import io
import json
import os

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
