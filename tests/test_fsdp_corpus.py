"""FSDP argument sets transcribed from public code: each reads with every key accounted for."""

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
#: the vocabulary of each other kind (a trainer framework's config), as the fsdp dialect's layout names it
FRAMEWORK_KINDS = {"FSDP1 (HF Trainer)": "hf_trainer", "FSDP2 config (TOML)": "torchtitan",
                   "FSDP2 config (YAML)": "torchtune"}
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
def test_trainer_framework_configs_read_with_every_key_accounted_for(name):
    """HF Trainer arguments, a torchtitan TOML, a torchtune YAML: their FSDP settings in their own vocabularies."""
    raw = json.loads((CORPUS / "fsdp" / name).read_text(encoding="utf-8"))
    assert adapters.sniff(raw) == "fsdp" and layout(raw) == FRAMEWORK_KINDS[KINDS[name]]
    translation = adapters.read(raw, "fsdp")
    assert_accounted(raw, translation)
    assert translation.result.sharding.stage == 3


def test_a_framework_config_with_an_unknown_key_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError) as exc:
        adapters.read({"fsdp": "full_shard", "fsdp_min_num_param": 100}, "fsdp")
    assert exc.value.problems[0].suggestion == "fsdp_min_num_params"


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
    fastchat = read("lm-sys__FastChat__train_vicuna_7b_trainer_fsdp.json")
    assert fastchat.sharding.wrap.module_classes == ["LlamaDecoderLayer"] and fastchat.precision.param_dtype == "fp16"
    titan = read("pytorch__torchtitan__llama3_70b_toml_parallelism.json")
    assert titan.activation_checkpointing.enabled and titan.gradients.clip_max_norm == 1.0
    recipe = read("pytorch__torchtune__llama3_1_70B_full.json")
    assert (recipe.precision.master_dtype, recipe.offload.optimizer) == ("bf16", "cpu")
