"""transformers (5.x) reads every ``fsdp_config`` torsh writes as ``TrainingArguments(fsdp=..., fsdp_config=...)``
does, and builds the Accelerate FSDP plugin arguments the translation meant: for the real plugin files round-tripped
and for DeepSpeed, Accelerate and FSDP configs converted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from consumers import converted_sources, load_or_skip

from torsh import adapters

CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus"
FILES = sorted((CORPUS / "fsdp_plugin_json").glob("*.json")) + converted_sources(20, 20, 15)


def plugin_args(written: dict, tmp_path: Path, monkeypatch) -> dict | None:
    """What transformers hands Accelerate's FSDP plugin for ``written`` (None on its XLA path)."""
    transformers = pytest.importorskip("transformers", reason="transformers is needed to read an fsdp_config")
    for key in [k for k in __import__("os").environ if k.startswith("FSDP_")]:
        monkeypatch.delenv(key)
    options, config = (written["fsdp"], written["fsdp_config"]) if "fsdp_config" in written else (True, written)
    path = tmp_path / "fsdp_config.json"
    path.write_text(json.dumps(config), encoding="utf-8")  # --fsdp_config takes a file path, as here
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), fsdp=options, fsdp_config=str(path),
                                          use_cpu=True, report_to=[])  # fmt: skip
    return args.fsdp_plugin_args


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name[:50]}")
def test_transformers_reads_what_torsh_writes_with_its_meaning(path, tmp_path, monkeypatch):
    cfg = load_or_skip(path)
    written = adapters.write(cfg, "fsdp_plugin")
    args = plugin_args(written.result, tmp_path, monkeypatch)
    if args is None:  # the XLA path: reported as unsupported when read
        assert path.parent.name == "fsdp_plugin_json"
        return
    lossy = {n.source_path for n in written.lossy}
    s = cfg.sharding
    assert args["fsdp_version"] == 2
    if "sharding.stage" not in lossy:
        assert args["reshard_after_forward"] is (s.stage >= 3 and s.reshard_after_forward is not False)
    assert args["state_dict_type"] == f"{cfg.checkpoint.state_dict_type.upper()}_STATE_DICT"
    if "offload" not in lossy and "offload.params" not in lossy:
        assert ("cpu_offload" in args) is (cfg.offload.params == "cpu")
    if s.wrap.module_classes:
        assert args["transformer_cls_names_to_wrap"] == ",".join(s.wrap.module_classes)


def test_a_round_tripped_plugin_file_gives_transformers_the_same_plugin(tmp_path, monkeypatch):
    for path in sorted((CORPUS / "fsdp_plugin_json").glob("*.json")):
        raw = json.loads(path.read_text("utf-8"))
        written = adapters.write(adapters.load(path).result, "fsdp_plugin").result
        same = [{k: v for k, v in (args or {}).items() if (k, v) != ("activation_checkpointing", False)}
                for args in (plugin_args(written, tmp_path, monkeypatch), plugin_args(raw, tmp_path, monkeypatch))]
        assert same[0] == same[1], path.name  # an absent activation_checkpointing is the plugin's False
