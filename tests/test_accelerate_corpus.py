"""Real `accelerate config` YAMLs from public repositories: each reads with every key accounted for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from adapter_validator import assert_accounted

from torsh import adapters
from torsh.formats import load_file

CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus"
FILES = sorted((CORPUS / "accelerate").glob("*.yaml"))


def _sources_rows(section: str) -> dict[str, list[str]]:
    text = (CORPUS / "SOURCES.md").read_text(encoding="utf-8")
    body = re.search(rf"^## {re.escape(section)}/\n(.*?)(?=^## |\Z)", text, re.S | re.M).group(1)
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines()
            if line.startswith("| ") and not line.startswith("| file") and not line.startswith("| ---")]
    return {row[0]: row for row in rows}


def test_corpus_is_large_enough_and_every_file_has_its_source():
    assert len(FILES) >= 10
    assert {p.name for p in FILES} == set(_sources_rows("accelerate"))


#: Corpus YAMLs torsh refuses (a ConfigError naming this key): a DeepSpeed file its consumer refuses, a file named
#: that is not in the corpus, a duplicated key.
REFUSED = {"CarperAI__trlx__default_accelerate_config.yaml": "fp16.min_loss_scale",
           "LAION-AI__Open-Assistant__accelerate_config.yaml": "deepspeed_config.deepspeed_config_file",
           "huggingface__accelerate__0_30_0_sagemaker.yaml": "debug"}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_files_name_the_key(name):
    from torsh.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        adapters.load(CORPUS / "accelerate" / name)
    assert any(p.path.endswith(REFUSED[name]) for p in exc.value.problems), exc.value.problems


@pytest.mark.parametrize("path", [p for p in FILES if p.name not in REFUSED], ids=lambda p: p.stem)
def test_reads_with_every_key_accounted_for(path):
    raw, _ = load_file(path)
    assert adapters.sniff(raw) == "accelerate"
    translation = adapters.load(path)
    assert_accounted(raw, translation)
    kind = raw.get("distributed_type", "NO")
    stage = translation.result.sharding.stage
    if kind == "FSDP":
        assert stage >= 2
    elif kind in ("NO", "MULTI_GPU", "MULTI_CPU"):
        assert stage == 0


def test_the_deepspeed_file_named_by_a_corpus_yaml_is_there():
    raw, _ = load_file(CORPUS / "accelerate" / "huggingface__accelerate__deepspeed.yaml")
    named = (CORPUS / "accelerate" / raw["deepspeed_config"]["deepspeed_config_file"]).resolve()
    assert named.is_file() and named.name in _sources_rows("deepspeed_config_templates")
