"""The one read pipeline: a file and the same data as a dict get the same report, and grouped map rules."""

from __future__ import annotations

import json

import pytest

from torsh import adapters
from torsh.config import TorshConfig
from torsh.dialect import Dialect
from torsh.errors import ConfigError
from torsh.translate import Fidelity, Group, Seen, To, WriteContext

CASES = [
    ({"sharding": {"stage": 3}, "compression": {"method": "topk", "ratio": 0.01}}, "torsh"),
    ({"zero_optimization": {"stage": 3}, "train_batch_size": 8, "$schema": "x.json"}, "deepspeed"),
]


@pytest.mark.parametrize(("data", "dialect"), CASES)
def test_a_file_reads_as_its_data_does(tmp_path, data, dialect):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    from_file, from_dict = adapters.load(path), adapters.read(data)
    assert from_file.source == from_dict.source == dialect
    assert [n.to_dict() for n in from_file.notes] == [n.to_dict() for n in from_dict.notes]
    assert from_file.result == from_dict.result


def test_cross_dialect_notes_reach_a_file(tmp_path):
    """Compression at an FSDP2 stage is unsupported whatever the entry point (it used to be silent for files)."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps(CASES[0][0]))
    lossy = [n for n in adapters.load(path).notes if n.lossy]
    assert [n.source_path for n in lossy] == ["compression.method"]


def test_non_text_keys_are_refused_on_every_path():
    with pytest.raises(ConfigError, match="keys must be text"):
        adapters.read({"sharding": {3: 1}}, "torsh")


# ---- a grouped rule: one concept's keys read and written together ---------------------------------


def _read_precision(seen: Seen) -> None:
    half = seen.value("half", False)
    seen.set("half", "precision.param_dtype", "bf16" if half else "fp32", reason="half means bf16 here",
             default="fp32")  # fmt: skip
    if half:
        seen.set("scale", "precision.reduce_dtype", "bf16" if seen.value("scale") else "fp32")
    else:
        seen.inert("scale", "no effect without half")


def _write_precision(cfg: TorshConfig, ctx: WriteContext) -> None:
    if cfg.precision.param_dtype == "bf16":
        ctx.put("half", True, "precision.param_dtype")


class Toy(Dialect):
    NAME = "toy"
    SCHEMA = "torsh"
    SCHEMA_NAMES_UNKNOWN_KEYS = False
    FIELD_MAP = {"steps": To("batch.gradient_accumulation_steps")}
    GROUPS = (Group("precision", ("half", "scale"), ("precision.param_dtype",), _read_precision, _write_precision),)

    def check_schema(self, raw):  # the toy has no schema of its own
        pass


def test_a_group_reads_its_keys_together():
    read = Toy().read({"half": True, "scale": 128.0, "steps": 2})
    assert read.result.precision.param_dtype == "bf16"
    assert read.result.precision.reduce_dtype == "bf16"
    assert {n.source_path: n.fidelity for n in read.notes} == {
        "steps": Fidelity.EXACT, "half": Fidelity.EXACT, "scale": Fidelity.EXACT}


def test_a_group_notes_absent_and_inert_keys():
    read = Toy().read({"scale": 4.0})
    notes = {n.source_path: n for n in read.notes}
    assert notes["half"].fidelity is Fidelity.DEFAULTED
    assert notes["scale"].fidelity is Fidelity.IGNORED
    assert read.result.extensions["toy"] == {"scale": 4.0}


def test_a_group_writes_its_keys_and_claims_its_targets():
    cfg = TorshConfig.model_validate({"precision": {"param_dtype": "bf16"}})
    written = Toy().write(cfg)
    assert written.result == {"half": True}
    assert not [n for n in written.notes if n.source_path == "precision.param_dtype" and n.lossy]


def test_a_key_cannot_be_in_the_map_and_a_group():
    class Both(Toy):
        FIELD_MAP = {"half": "precision.param_dtype"}

    with pytest.raises(ValueError, match="one rule"):
        Both().field_map


def test_unknown_keys_get_a_suggestion():
    with pytest.raises(ConfigError, match="steps"):
        Toy().read({"stepz": 1})
