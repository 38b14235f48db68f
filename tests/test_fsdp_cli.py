"""torsh-migrate with the FSDP-family dialects: convert --to fsdp1/fsdp2, snippet, diff; no torch import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from torsh.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "migration_examples"
CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus"


def test_convert_to_either_fsdp_generation(tmp_path, capsys):
    source = EXAMPLES / "accelerate" / "fsdp1_to_fsdp2.yaml"
    assert main(["convert", str(source), "--to", "fsdp1", "-o", str(tmp_path / "v1.json")]) == 0
    assert json.loads((tmp_path / "v1.json").read_text())["sharding_strategy"] == "FULL_SHARD"
    assert main(["convert", str(source), "--to", "fsdp2", "-o", str(tmp_path / "v2.json")]) == 0
    assert json.loads((tmp_path / "v2.json").read_text())["fully_shard"]["offload_policy"] == {"pin_memory": True}
    # BACKWARD_POST has no FSDP2 counterpart: --strict refuses the translation
    assert main(["convert", str(source), "--to", "fsdp2", "--strict"]) == 1
    assert "sharding.backward_prefetch" in capsys.readouterr().err


def test_snippet_command(capsys):
    assert main(["snippet", str(EXAMPLES / "fsdp" / "hsdp_offload_fsdp2.json")]) == 0
    out = capsys.readouterr().out
    compile(out, "snippet", "exec")
    assert "shard_size = 8" in out and "CPUOffloadPolicy(pin_memory=True)" in out


def test_diff_lists_semantic_differences_with_their_source_keys(tmp_path, capsys):
    fsdp = tmp_path / "fsdp.json"
    fsdp.write_text(json.dumps({"fully_shard": {"reshard_after_forward": True, "mp_policy": {
        "param_dtype": "torch.bfloat16", "reduce_dtype": "torch.float32"}}}))
    accelerate = CORPUS / "accelerate" / "huggingface__trl__fsdp2.yaml"
    assert main(["diff", str(accelerate), str(fsdp), "--ignore", "launch", "--report", "json"]) == 1
    report = json.loads(capsys.readouterr().out)
    by_path = {d["path"]: d for d in report["differences"]}
    assert by_path["precision.reduce_dtype"]["a"] == "bf16" and by_path["precision.reduce_dtype"]["b"] == "fp32"
    assert by_path["precision.reduce_dtype"]["b_sources"] == ["fully_shard.mp_policy.reduce_dtype"]
    assert by_path["sharding.sync_module_states"]["a_sources"] == ["fsdp_config.fsdp_cpu_ram_efficient_loading"]
    assert not any(p.startswith("launch.") for p in by_path)


def test_diff_of_the_same_job_in_two_dialects_is_empty(tmp_path, capsys):
    source = EXAMPLES / "fsdp" / "llama_fsdp1.json"
    assert main(["convert", str(source), "--to", "fsdp1", "-o", str(tmp_path / "again.json")]) == 0
    capsys.readouterr()
    assert main(["diff", str(source), str(tmp_path / "again.json")]) == 0
    assert "same meaning" in capsys.readouterr().out


def test_diff_of_a_bad_file_is_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"sharding_strategy": "FULL_SHRAD"}))
    assert main(["diff", str(bad), str(bad), "--from-a", "fsdp"]) == 2
    assert "did you mean 'FULL_SHARD'" in capsys.readouterr().err


def test_converting_and_diffing_never_import_torch(tmp_path):
    code = (
        "import sys; from torsh.cli import main\n"
        f"main(['convert', {str(EXAMPLES / 'accelerate' / 'fsdp1_to_fsdp2.yaml')!r}, '--to', 'fsdp2', '-o', "
        f"{str(tmp_path / 'o.json')!r}])\n"
        f"main(['diff', {str(EXAMPLES / 'fairscale' / 'oss_sdp_to_fsdp2.json')!r}, {str(tmp_path / 'o.json')!r}])\n"
        f"main(['snippet', {str(tmp_path / 'o.json')!r}])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_diff_of_an_accelerate_yaml_and_the_deepspeed_json_written_from_it(tmp_path, capsys):
    source = EXAMPLES / "accelerate" / "deepspeed_zero3_to_fsdp2.yaml"
    assert main(["convert", str(source), "--to", "deepspeed", "-o", str(tmp_path / "ds.json")]) == 0
    capsys.readouterr()
    code = main(["diff", str(source), str(tmp_path / "ds.json"), "--ignore", "launch", "--report", "json"])
    assert code in (0, 1)
    paths = {d["path"] for d in json.loads(capsys.readouterr().out)["differences"]}
    assert not paths & {"sharding.stage", "offload.params", "offload.optimizer", "precision.param_dtype"}


def test_convert_version_picks_the_accelerate_backend(tmp_path):
    import yaml

    source = EXAMPLES / "accelerate" / "fsdp1_to_fsdp2.yaml"
    assert main(["convert", str(source), "--to", "accelerate", "-o", str(tmp_path / "same.yaml")]) == 0
    assert yaml.safe_load((tmp_path / "same.yaml").read_text())["fsdp_config"]["fsdp_version"] == 1
    v2 = tmp_path / "v2.yaml"
    assert main(["convert", str(source), "--to", "accelerate", "--variant", "fsdp2", "-o", str(v2)]) == 0
    assert v2.read_text() == (EXAMPLES / "accelerate" / "fsdp1_to_fsdp2.expected.yaml").read_text()
    assert main(["convert", str(source), "--to", "accelerate", "--variant", "fsdp3"]) == 2
