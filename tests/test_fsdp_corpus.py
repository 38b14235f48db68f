"""FSDP argument sets transcribed from public code: the FSDP1 / FSDP2 ones read with every key accounted for."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from adapter_validator import assert_accounted

from torsh import adapters
from torsh.adapters.fsdp import layout
from torsh.errors import ConfigError
from torsh.translate import Fidelity

CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus"


def _kinds() -> dict[str, str]:
    text = (CORPUS / "SOURCES.md").read_text(encoding="utf-8")
    body = re.search(r"^## fsdp/\n(.*?)(?=^## |\Z)", text, re.S | re.M).group(1)
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines()
            if line.startswith("| ") and not line.startswith(("| file", "| ---"))]
    return {row[0]: row[1] for row in rows}


KINDS = _kinds()
KWARGS = sorted(name for name, kind in KINDS.items() if kind in ("FSDP1", "FSDP2"))
OTHER = sorted(name for name, kind in KINDS.items() if kind not in ("FSDP1", "FSDP2"))


def test_every_file_has_its_source_and_enough_are_call_arguments():
    assert {p.name for p in (CORPUS / "fsdp").glob("*.json")} == set(KINDS)
    assert len(KWARGS) >= 10


@pytest.mark.parametrize("name", KWARGS)
def test_call_arguments_read_with_every_key_accounted_for(name):
    raw = json.loads((CORPUS / "fsdp" / name).read_text(encoding="utf-8"))
    assert adapters.sniff(raw) == "fsdp"
    translation = adapters.read(raw, "fsdp")
    assert_accounted(raw, translation)
    assert layout(raw) == KINDS[name].lower()
    # Values computed by the script are reported as such, never guessed.
    for note in translation.notes:
        if note.fidelity is Fidelity.DROPPED:
            assert note.reason


@pytest.mark.parametrize("name", OTHER)
def test_other_frameworks_config_files_are_refused_with_a_message(name):
    """HF Trainer arguments, torchtitan TOML, torchtune YAML: their own vocabularies, not FSDP call arguments."""
    raw = json.loads((CORPUS / "fsdp" / name).read_text(encoding="utf-8"))
    with pytest.raises(ConfigError) as exc:
        adapters.read(raw, "fsdp")
    assert "unknown key" in str(exc.value)


def test_corpus_transcriptions_translate_key_facts():
    def read(name):
        return adapters.read(json.loads((CORPUS / "fsdp" / name).read_text(encoding="utf-8")), "fsdp").result

    t5 = read("pytorch__examples__T5_training.json")
    assert t5.sharding.wrap.module_classes == ["T5Block"] and t5.precision.buffer_dtype == "bf16"
    open_lm = read("mlfoundations__open_lm__main_FSDP.json")
    assert (open_lm.precision.param_dtype, open_lm.precision.reduce_dtype) == ("bf16", "fp32")
    assert open_lm.sharding.hybrid_shard_size is not None
    torchtune = read("pytorch__torchtune__shard_model.json")
    assert (torchtune.sharding.stage, torchtune.offload.params) == (3, "cpu")
