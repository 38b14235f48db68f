"""A file is recognised by its dialect's shape: the sections and keys the dialect is known by. Keys the dialect does
not know (a section a newer version added, a fork's own key) lower the confidence but do not hand the file to
another dialect's reader."""

from __future__ import annotations

import copy
import functools
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torsh import adapters
from torsh.adapters._sniff import FEW, Shape, best, confidence
from torsh.errors import ConfigError
from torsh.formats import load_file

CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus"
#: corpus folder -> the dialect its files are written in (launch lines are command text, not mappings)
FOLDERS = {
    "deepspeed": "deepspeed", "deepspeed_config_templates": "deepspeed", "accelerate": "accelerate",
    "accelerate_variants": "accelerate", "fsdp": "fsdp", "fairscale": "fairscale", "horovod": "horovod",
    "torchtitan": "torchtitan", "torchtune": "torchtune", "fsdp_plugin_json": "fsdp_plugin", "lightning": "lightning",
}  # fmt: skip


def _parses(path: Path) -> bool:
    try:
        load_file(path)
    except ConfigError:  # a file torsh refuses to parse (a key set twice) is never sniffed
        return False
    return True


FILES = sorted(p for folder in FOLDERS for p in (CORPUS / folder).glob("*")
               if p.is_file() and p.name != "SOURCES.md" and _parses(p))  # fmt: skip


@functools.cache
def _shapes() -> list[Shape]:
    return [shape for name in adapters.names() for shape in getattr(adapters.get(name), "SHAPES", ())]


def _foreign(name: str) -> bool:
    """No dialect knows the key, at the top level or inside any section."""
    return not any(shape.knows(name) or shape.knows(f"x.{name}") for shape in _shapes())


# ---- the rule ------------------------------------------------------------------------------------------------------


def test_a_file_with_no_foreign_key_is_at_the_ceiling_and_each_foreign_key_lowers_it():
    scores = [confidence(0.97, 10, foreign) for foreign in range(FEW + 1)]
    assert scores[0] == 0.97 and scores == sorted(scores, reverse=True) and len(set(scores)) == len(scores)
    assert all(score > 0.97 / 2 for score in scores)


def test_a_file_mostly_of_foreign_keys_is_not_the_dialect():
    assert confidence(0.95, 1, FEW) > 0  # a small file with a few foreign keys is still recognised
    assert confidence(0.95, 1, FEW + 1) == 0 and confidence(0.95, 10, 2 * 10 + 1) == 0
    assert confidence(0.95, 10, 2 * 10) > 0
    assert confidence(0.95, 7, 35, lenient=True) > 0  # DeepSpeed ignores GPT-NeoX's keys in the same file


def test_a_shape_needs_each_group_of_anchors_and_looks_into_the_sections_it_knows():
    titan = Shape(0.97, anchors=({"job", "parallelism"}, {"job", "model", "training"}),
                  vocabulary={"model.name", "training.steps", "parallelism.*"})  # fmt: skip
    assert titan.confidence({"parallelism": {"data_parallel_shard_degree": -1}}) == 0  # no job, model or training
    assert titan.confidence({"job": {}, "model": {"name": "llama3"}}) == 0.97
    forked = titan.confidence({"job": {}, "model": {"name": "llama3"}, "training": {"steps": 1, "task": "a2a"}})
    assert 0 < forked < 0.97  # training.task is foreign: the keys inside known sections count
    evaluation = {"job": {}, "model": {"name": "llama3"}, "training": {"steps": 1}, "evaluation": {"a": 1, "b": 2}}
    assert titan.confidence(evaluation) == forked  # an unknown section is one foreign key, whatever it holds


def test_tables_count_only_as_mappings_and_excluded_keys_belong_to_another_layout():
    deepspeed = Shape(0.95, anchors=({"fp16", "train_batch_size"},), tables={"fp16"})
    assert deepspeed.confidence({"fp16": {"enabled": True}}) == 0.95
    assert deepspeed.confidence({"fp16": True}) == 0  # the HF Trainer's argument
    plugin = Shape(0.96, anchors=({"fsdp_config"},), vocabulary={"fsdp_config.*"}, excludes={"distributed_type"})
    assert plugin.confidence({"fsdp_config": {"fsdp_version": 2}, "distributed_type": "FSDP"}) == 0


def test_patterns_name_families_of_keys_and_the_best_layout_wins():
    env = Shape(0.9, anchors=({"HOROVOD_*"},), vocabulary={"[A-Z]*"})
    four = Shape(1.0, anchors=({"env", "horovodrun"},))
    assert env.confidence({"HOROVOD_FUSION_THRESHOLD": "1", "NCCL_DEBUG": "INFO"}) == 0.9
    assert best((env, four), {"env": {}}) == 1.0 and best((env, four), {"other": 1}) == 0


# ---- the dialects --------------------------------------------------------------------------------------------------


def test_every_corpus_file_is_recognised_as_its_dialect():
    wrong = {f"{p.parent.name}/{p.name}": adapters.sniff(load_file(p)[0]) for p in FILES}
    assert not {k: v for k, v in wrong.items() if v != FOLDERS[k.split("/")[0]]}


def test_every_dialect_that_reads_mappings_declares_its_shapes():
    missing = [name for name in adapters.names() if name not in ("launch", "fsdp1", "fsdp2")
               and not getattr(adapters.get(name), "SHAPES", ())]  # fmt: skip
    assert not missing


_PART = st.text(string.ascii_lowercase + string.digits, min_size=2, max_size=9)
#: snake_case names no dialect knows: a letter, then one to three parts of lowercase letters and digits
_NAMES = st.builds(lambda first, parts: first + "_".join(parts), st.sampled_from(string.ascii_lowercase),
                   st.lists(_PART, min_size=1, max_size=3)).filter(_foreign)  # fmt: skip
_VALUES = st.one_of(st.booleans(), st.integers(-5, 5000), st.sampled_from(["x", "a2a", "librispeech_asr"]),
                    st.dictionaries(_NAMES, st.integers(0, 9), min_size=1, max_size=3))  # fmt: skip


@st.composite
def _additions(draw, raw: dict) -> list[tuple[str | None, str, object]]:
    """One to three foreign keys, each at the top level or inside one of the file's sections."""
    sections = sorted(k for k, v in raw.items() if isinstance(v, dict) and isinstance(k, str))
    where = st.sampled_from([None, *sections]) if sections else st.just(None)
    return draw(st.lists(st.tuples(where, _NAMES, _VALUES), min_size=1, max_size=3, unique_by=lambda t: (t[0], t[1])))


@functools.cache
def _loaded(path: Path) -> dict:
    return load_file(path)[0]


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
@settings(max_examples=12, deadline=None, derandomize=True)
@given(data=st.data())
def test_a_corpus_file_with_a_few_foreign_keys_is_still_its_dialect(path, data):
    raw = _loaded(path)
    changed = copy.deepcopy(raw)
    for section, name, value in data.draw(_additions(raw)):
        target = changed if section is None else changed[section]
        target.setdefault(name, value)
    assert adapters.sniff(changed) == FOLDERS[path.parent.name]


@pytest.mark.parametrize("section", [{"scheduler": {"type": "WarmupLR", "params": {}}},
                                     {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
                                     {"communication_data_type": "fp32"}])  # fmt: skip
def test_every_top_level_key_of_deepspeeds_schema_is_a_deepspeed_key(section):
    """DeepSpeed's own unit tests pass deepspeed.initialize a batch size and a scheduler section only: the keys its
    reader handles by rules (scheduler, optimizer), not by the map, are DeepSpeed's keys too."""
    assert adapters.sniff({"train_batch_size": 1, **section}) == "deepspeed"
