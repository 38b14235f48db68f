"""torchtune reads every recipe config torsh writes as ``tune run`` does: OmegaConf loads it and resolves its
interpolations, and torchtune's ``config.instantiate`` builds the optimizer component from it. Round-tripped real
configs give the same values as the originals; configs converted from DeepSpeed and Accelerate give the meaning of
their source."""

from __future__ import annotations

from pathlib import Path

import pytest

from consumers import converted_sources, load_or_skip, without_package_init

from torsh import adapters
from torsh.formats import dump_text

CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus"
TUNE = sorted((CORPUS / "torchtune").glob("*.yaml"))


@pytest.fixture(scope="module")
def tune():
    """OmegaConf, and torchtune's instantiate imported without torchtune's package __init__ (which requires
    torchao)."""
    omegaconf = pytest.importorskip("omegaconf", reason="OmegaConf (torchtune's config loader) is needed: pip install "
                                    "-r requirements-dev.txt")  # fmt: skip
    without_package_init("torchtune", "0.6.1")
    from torchtune.config._instantiate import instantiate

    def load(text: str, tmp_path: Path) -> dict:
        path = tmp_path / "recipe.yaml"
        path.write_text(text, encoding="utf-8")
        cfg = omegaconf.OmegaConf.load(path)
        if "optimizer" in cfg:
            import torch

            optimizer = instantiate(cfg.optimizer, torch.nn.Linear(2, 2).parameters())
            assert isinstance(optimizer, torch.optim.Optimizer)
        return omegaconf.OmegaConf.to_container(cfg, resolve=True)

    return load


@pytest.mark.parametrize("path", TUNE, ids=lambda p: p.stem)
def test_a_round_tripped_recipe_config_gives_torchtune_the_same_values(path, tune, tmp_path):
    written = adapters.write(adapters.load(path).result, "torchtune")
    assert not written.lossy, [str(n) for n in written.lossy]
    try:
        original = tune(path.read_text(encoding="utf-8"), tmp_path)
    except Exception as exc:  # noqa: BLE001 - a resolver the recipe registers itself (${eval:...})
        pytest.skip(f"OmegaConf alone cannot load the original: {type(exc).__name__}")
    again = tune(dump_text(written.result, "yaml"), tmp_path)
    assert {k: again.get(k) for k in original} == original


@pytest.mark.parametrize("path", converted_sources(), ids=lambda p: p.name[:60])
def test_torchtune_reads_what_torsh_converts_with_the_meaning_of_the_source(path, tune, tmp_path):
    cfg = load_or_skip(path)
    written = adapters.write(cfg, "torchtune")
    recipe = tune(dump_text(written.result, "yaml"), tmp_path)
    lossy = {n.source_path for n in written.lossy}
    assert recipe["fsdp_reshard_after_forward"] is (cfg.sharding.stage >= 3 and cfg.sharding.reshard_after_forward
                                                    is not False)  # fmt: skip
    assert recipe.get("fsdp_cpu_offload", False) is (cfg.offload.params == "cpu")  # absent: torchtune's False
    if "precision.param_dtype" not in lossy:
        assert recipe["dtype"] == cfg.precision.param_dtype
    if isinstance(cfg.batch.micro_batch_size, int):
        assert recipe["batch_size"] == cfg.batch.micro_batch_size
    if cfg.optimizer is not None and "optimizer.name" not in lossy:
        assert recipe["optimizer"]["_component_"].endswith(cfg.optimizer.name)
