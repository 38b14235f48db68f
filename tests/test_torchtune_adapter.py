"""The torchtune dialect: the distributed keys of a torchtune 0.6.1 recipe config (the real configs are in the corpus
and the consumer test; these cover what the corpus does not show)."""

from __future__ import annotations

from pathlib import Path

import pytest
from golden import check_golden

from torsh import adapters
from torsh.errors import ConfigError
from torsh.formats import dump_text, load_file
from torsh.translate import Fidelity

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "fixtures" / "corpus" / "torchtune"
BASE = {"model": {"_component_": "torchtune.models.llama3_2.llama3_2_1b"}, "dtype": "bf16"}


def read(**keys):
    return adapters.read({**BASE, **keys}, "torchtune")


def _note(t, path):
    return next(n for n in t.notes if n.source_path == path)


def test_the_recipe_defaults_are_zero3_without_offload_and_dtype_is_everything():
    t = read()
    cfg = t.result
    assert (cfg.sharding.stage, cfg.offload.params) == (3, "none")
    p = cfg.precision
    assert (p.param_dtype, p.master_dtype, p.optimizer_state_dtype) == ("bf16", "bf16", "bf16")
    assert _note(t, "fsdp_reshard_after_forward").fidelity is Fidelity.DEFAULTED


def test_distributed_keys_map_and_every_other_key_is_ignored_and_kept():
    t = read(fsdp_reshard_after_forward=False, fsdp_cpu_offload=True, enable_activation_checkpointing=True,
             batch_size=4, gradient_accumulation_steps=8, clip_grad_norm=1.0, log_peak_memory_stats=True,
             output_dir="/tmp/x", frobnicate=3)  # fmt: skip
    cfg = t.result
    assert (cfg.sharding.stage, cfg.offload.params, cfg.offload.optimizer) == (2, "cpu", "cpu")
    assert cfg.activation_checkpointing.enabled and cfg.batch.micro_batch_size == 4
    assert _note(t, "log_peak_memory_stats").reason == "not a distributed setting"
    assert "no torchtune 0.6.1 recipe reads it" in _note(t, "frobnicate").reason
    written = adapters.write(cfg, "torchtune").result
    assert written["frobnicate"] == 3 and written["model"] == BASE["model"] and written["output_dir"] == "/tmp/x"


def test_the_optimizer_component_is_read_and_kept():
    t = read(optimizer={"_component_": "bitsandbytes.optim.PagedAdamW8bit", "lr": 2e-5, "betas": [0.9, 0.95]})
    o = t.result.optimizer
    assert (o.name, o.lr, o.betas) == ("PagedAdamW8bit", 2e-5, (0.9, 0.95))
    written = adapters.write(t.result, "torchtune").result
    assert written["optimizer"]["_component_"] == "bitsandbytes.optim.PagedAdamW8bit"


def test_interpolations_are_kept_as_written_and_reported():
    t = read(batch_size="${batch_size_val}")
    assert t.result.batch.micro_batch_size is None
    assert _note(t, "batch_size").fidelity is Fidelity.DROPPED
    assert adapters.write(t.result, "torchtune").result["batch_size"] == "${batch_size_val}"


@pytest.mark.parametrize("keys, path", [
    ({"dtype": "fp16"}, "dtype"),
    ({"fsdp_cpu_offload": "yes"}, "fsdp_cpu_offload"),
    ({"batch_size": 0}, "batch_size"),
])  # fmt: skip
def test_what_torchtune_refuses_is_refused_naming_the_key(keys, path):
    with pytest.raises(ConfigError) as exc:
        read(**keys)
    assert any(p.path == path for p in exc.value.problems), exc.value.problems


def test_hsdp_dims_and_tensor_parallelism():
    cfg = read(data_parallel_shard_dim=8, data_parallel_replicate_dim=2).result
    assert cfg.sharding.hybrid_shard_size == 8
    t = read(tensor_parallel_dim=8, tensor_parallel_plan={"_component_": "x"})
    assert t.result.parallelism.tp == 8 and _note(t, "tensor_parallel_dim").fidelity is Fidelity.APPROXIMATE
    assert adapters.write(t.result, "torchtune").result["tensor_parallel_dim"] == 8
    assert read(data_parallel_replicate_dim=2).result.parallelism.dp_replicate == 2


def test_sniffing_finds_recipe_configs_and_leaves_fsdp_excerpts_to_the_fsdp_dialect():
    raw, _ = load_file(CORPUS / "pytorch__torchtune__llama3_1__8B_full.yaml")
    assert adapters.sniff(raw) == "torchtune"
    assert adapters.sniff({"fsdp_cpu_offload": True, "dtype": "bf16"}) == "fsdp"


def test_the_deepspeed_example_converts_to_its_golden():
    example = ROOT / "migration_examples" / "torchtune"
    written = adapters.write(adapters.load(example / "zero3_bf16_offload_to_torchtune.json").result, "torchtune")
    check_golden(example / "zero3_bf16_offload_to_torchtune.expected.yaml", dump_text(written.result, "yaml"))
