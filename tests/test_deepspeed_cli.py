"""torsh-migrate on DeepSpeed files: convert (with golden examples), validate, explain; and the precision contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from golden import check_golden

from torsh import adapters
from torsh.cli import main
from torsh.config import TorshConfig
from torsh.contract import engine_plan, loss_scaling_rule, precision_contract

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "migration_examples" / "deepspeed").glob("*.json"))
CORPUS = ROOT / "tests" / "fixtures" / "corpus" / "deepspeed"


def test_there_are_the_three_examples_the_guide_promises():
    names = {p.stem for p in EXAMPLES}
    assert {"zero2_bf16_adamw_warmupdecay", "zero3_cpu_offload", "zero1_fp16_auto"} <= names


@pytest.mark.parametrize("source", EXAMPLES, ids=lambda p: p.stem)
def test_example_converts_to_its_golden_native_file(source, tmp_path, capsys):
    golden = source.with_name(source.stem + ".expected.toml")
    out = tmp_path / "out.toml"
    assert main(["convert", str(source), "--to", "torsh", "-o", str(out)]) == 0
    check_golden(golden, out.read_text())


@pytest.mark.parametrize("source", EXAMPLES, ids=lambda p: p.stem)
def test_example_golden_file_converts_back_to_the_same_deepspeed_meaning(source):
    golden = adapters.load(source.with_name(source.stem + ".expected.toml")).result
    original = adapters.load(source).result
    assert golden == original
    back = adapters.read(adapters.write(golden, "deepspeed").result, "deepspeed").result
    assert back == original


def test_convert_to_deepspeed_writes_json_and_a_report(tmp_path, capsys):
    out = tmp_path / "ds.json"
    src = ROOT / "migration_examples" / "deepspeed" / "zero3_cpu_offload.expected.toml"
    assert main(["convert", str(src), "--to", "deepspeed", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert data["bf16"] == {"enabled": True} and data["gradient_clipping"] == 1.0
    assert "write deepspeed" in capsys.readouterr().out


def test_strict_convert_fails_on_a_misspelt_key(tmp_path, capsys):
    src = tmp_path / "ds.json"
    src.write_text(json.dumps({"train_batch_size": 8, "gradient_clippping": 0.5}))
    assert main(["convert", str(src), "--to", "torsh", "--strict"]) == 1
    assert "gradient_clipping" in capsys.readouterr().err


def test_validate_reports_schema_problems_with_their_key_path(tmp_path, capsys):
    src = tmp_path / "ds.json"
    src.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 4, "overlap_comm": "maybe"}}))
    assert main(["validate", str(src)]) == 2
    err = capsys.readouterr().err
    assert "zero_optimization.stage" in err and "zero_optimization.overlap_comm" in err


def test_validate_accepts_a_deepspeed_file(capsys):
    assert main(["validate", str(CORPUS / "huggingface__accelerate__zero_stage1_config.json")]) == 0
    assert "valid deepspeed config" in capsys.readouterr().out


def test_explain_prints_batch_math_contract_loss_scaling_and_plan(capsys):
    src = CORPUS / "microsoft__DeepSpeedExamples__ds_fp16_z1_config.json"
    assert main(["explain", str(src), "--world-size", "4", "--report", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batch"].startswith("global batch 256 = micro batch 64 x gradient accumulation 1 x 4")
    rows = {r["tensor"]: r["dtype"] for r in data["precision_contract"]}
    assert rows["parameters in compute"] == "fp16" and rows["master weights"] == "fp32"
    assert rows["gradient reduction"] == "fp16" and rows["optimizer state"] == "fp32"
    assert "hysteresis" in data["loss_scaling"]
    assert any(step.startswith("ZeRO-1 as DeepSpeed runs it") for step in data["engine"])


def test_explain_works_for_the_native_dialect_too(capsys):
    src = ROOT / "migration_examples" / "deepspeed" / "zero3_cpu_offload.expected.toml"
    assert main(["explain", str(src), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "Precision contract" in out and "reshard_after_forward=True" in out and "CPUOffloadPolicy" in out


def test_contract_rows_follow_the_config():
    cfg = TorshConfig.from_dict({"precision": {"param_dtype": "bf16", "reduce_dtype": "fp32",
                                               "buffer_dtype": "fp32"}, "sharding": {"stage": 2}})  # fmt: skip
    rows = {r.tensor: r.dtype for r in precision_contract(cfg.precision, cfg.sharding, cfg.offload, cfg.checkpoint)}
    assert rows == {"model load": "as built by the script", "parameters in compute": "bf16", "master weights": "fp32",
                    "gradient reduction": "fp32", "gradient accumulation": "bf16", "optimizer state": "fp32",
                    "buffers": "fp32", "checkpoint": "weights bf16, master fp32"}  # fmt: skip
    assert engine_plan(cfg)[0].startswith("ZeRO-2 as DeepSpeed runs it: whole parameters")


def test_loss_scaling_rule_differs_by_semantics():
    stage0 = TorshConfig.from_dict({"precision": {"param_dtype": "fp16", "loss_scaling": {
        "mode": "dynamic", "semantics": "deepspeed_stage0"}}}).precision  # fmt: skip
    scaler = TorshConfig.from_dict({"precision": {"param_dtype": "fp16", "loss_scaling": {
        "mode": "dynamic", "semantics": "torch_grad_scaler", "growth_interval": 2000}}}).precision  # fmt: skip
    assert "hysteresis is ignored" in loss_scaling_rule(stage0)
    assert "exactly 2000 clean steps" in loss_scaling_rule(scaler)


def test_convert_and_explain_never_import_torch():
    src = CORPUS / "huggingface__transformers__ds_config_zero2.json"
    code = ("import sys; from torsh.cli import main; "
            f"main(['convert', {str(src)!r}, '--to', 'deepspeed', '--report', 'json']); "
            f"main(['explain', {str(src)!r}]); "
            "sys.stderr.write('TORCH_LOADED' if 'torch' in sys.modules else 'NO_TORCH')")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stderr.endswith("NO_TORCH")


def test_torch_autocast_contract_keeps_fp32_parameters():
    cfg = adapters.read({"train_batch_size": 8, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
                        "deepspeed").result  # fmt: skip
    rows = {r.tensor: r.dtype for r in precision_contract(cfg.precision, cfg.sharding, cfg.offload, cfg.checkpoint)}
    assert rows["parameters in compute"] == "fp32" and rows["checkpoint"].startswith("weights fp32")
    assert rows["gradient reduction"] == "fp32"  # DeepSpeed's default when neither fp16 nor bf16 is enabled
    assert any("torch.autocast(bf16)" in step for step in engine_plan(cfg))
