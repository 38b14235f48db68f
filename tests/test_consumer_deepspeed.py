"""Every DeepSpeed JSON torsh writes, from every dialect, is accepted by DeepSpeed 0.19.8 itself.

All files (corpus, migration examples, "auto" fixtures) converted ``--to deepspeed`` go through DeepSpeed's own
config parser (``DeepSpeedConfig``), after the Hugging Face "auto" values are filled in the way the HF Trainer /
Accelerate fill them (DeepSpeed alone rejects "auto"; :func:`torsh.parity.resolve_auto` is that fill). A sample at
each ZeRO stage, written from another dialect, runs ``deepspeed.initialize`` and two optimizer steps on 2 gloo ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capabilities import fp16_as_deepspeed_runs_it
from torsh import adapters, parity
from torsh.errors import ConfigError
from torsh.translate import Fidelity

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is needed to check the written JSON against its parser")

HERE = Path(__file__).parent
ROOTS = (HERE / "fixtures" / "corpus", HERE.parent / "migration_examples", HERE / "fixtures" / "consumer" / "auto")
FILES = sorted(p for base in ROOTS for p in base.rglob("*") if p.suffix in (".json", ".yaml", ".yml", ".toml", ".conf"))


def written_for_deepspeed(path: Path) -> dict | None:
    try:
        read = adapters.load(path)
    except ConfigError:
        return None
    return adapters.write(read.result, "deepspeed").result


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name[:60])
def test_deepspeed_parses_every_json_torsh_writes(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    written = written_for_deepspeed(path)
    if written is None:
        pytest.skip("not a config torsh reads (a ConfigError, covered by the property test)")
    filled, _ = parity.resolve_auto(written, nproc=1, steps=10)
    DeepSpeedConfig(filled)  # raises on anything DeepSpeed 0.19.8 refuses


def test_a_source_without_batch_gets_a_batch_deepspeed_accepts_and_a_note():
    cfg = adapters.load(ROOTS[1] / "fairscale" / "oss_sdp_to_fsdp2.json").result
    written = adapters.write(cfg, "deepspeed")
    assert written.result["train_micro_batch_size_per_gpu"] == 1
    note = next(n for n in written.notes if n.target_path == "train_micro_batch_size_per_gpu")
    assert note.fidelity is Fidelity.DEFAULTED and "DataLoader" in note.reason


def test_an_accelerate_deepspeed_yaml_carries_auto_batch_keys_that_accelerate_fills():
    cfg = adapters.load(HERE / "fixtures" / "corpus" / "accelerate" / "huggingface__trl__deepspeed_zero3.yaml").result
    written = adapters.write(cfg, "deepspeed").result
    assert written["train_micro_batch_size_per_gpu"] == "auto" and written["train_batch_size"] == "auto"


#: One file per ZeRO stage, each from another dialect: what deepspeed.initialize is run on.
INITIALIZE_SAMPLE = {0: "tests/fixtures/corpus/accelerate/huggingface__accelerate__multi_gpu.yaml",
                     1: "tests/fixtures/corpus/accelerate/huggingface__accelerate__deepspeed.yaml",
                     2: "migration_examples/fairscale/oss_sdp_to_fsdp2.json",
                     3: "tests/fixtures/corpus/fsdp/pytorch__examples__FSDP2_example.json"}  # fmt: skip


def test_deepspeed_initializes_and_steps_the_written_json_at_every_stage(tmp_path):
    scenarios = []
    for stage, source in INITIALIZE_SAMPLE.items():
        written = written_for_deepspeed(HERE.parent / source)
        assert written["zero_optimization"]["stage"] == stage if stage else written.get("zero_optimization",
                                                                                         {}).get("stage", 0) == 0
        filled, _ = parity.resolve_auto(written, nproc=2, steps=2)
        filled.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})  # the script's, in these sources
        # where DeepSpeed has no fp16 on this CPU, it runs bf16 instead (the fp16 section is parsed above)
        scenarios.append(parity.Scenario(f"stage{stage}", fp16_as_deepspeed_runs_it(filled), steps=2))
    results = parity.run(scenarios, "deepspeed", nproc=2, workdir=tmp_path, timeout=600)
    for scenario in scenarios:
        entry = results["scenarios"][scenario.name]
        assert "records" in entry, (scenario.name, entry.get("error"))
        assert len(entry["records"]) == 2


NO_BATCH = HERE / "fixtures" / "corpus" / "deepspeed" / "deepspeedai__DeepSpeed__template_zero3.json"


@pytest.mark.parametrize("with_loader", [False, True], ids=["no-data", "a-dataloader"])
def test_the_drop_in_refuses_a_config_without_a_batch_size_as_deepspeed_does(with_loader):
    """DeepSpeed checks the batch keys when it reads the config, before it looks at training_data: a DataLoader
    does not fill a batch size the file leaves out (it fills one written "auto"). Stage 0 keeps it to one process."""
    import json

    import torch
    from deepspeed.runtime.config import DeepSpeedConfig

    from torsh.compat import deepspeed as drop_in

    raw = json.loads(NO_BATCH.read_text())
    raw["zero_optimization"]["stage"] = 0
    with pytest.raises(Exception) as theirs:
        DeepSpeedConfig(raw)
    model = torch.nn.Linear(4, 4)
    data = torch.utils.data.TensorDataset(torch.zeros(8, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=2) if with_loader else None
    with pytest.raises(drop_in.DeepSpeedConfigError) as ours:
        drop_in.initialize(model=model, model_parameters=model.parameters(), config=raw, training_data=loader)
    assert str(theirs.value) in str(ours.value)
    try:
        engine, *_ = drop_in.initialize(model=model, model_parameters=model.parameters(), training_data=loader,
                                        config={**raw, "train_micro_batch_size_per_gpu": "auto" if with_loader else 2})
        assert engine.train_micro_batch_size_per_gpu() == 2
    finally:  # initialize started a one-process group, as DeepSpeed's does: the next test in this worker gets none
        torch.distributed.destroy_process_group()
