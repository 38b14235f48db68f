"""torchtitan's own job-config parser (``ConfigManager``, torchtitan 0.2.2) reads every torchtitan TOML torsh writes:
round-tripped real files give the same job config as the originals, and configs converted from DeepSpeed and
Accelerate give the data parallelism, precision and batch sizes the translation meant."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from consumers import converted_sources, load_or_skip, without_package_init

from torsh import adapters
from torsh.formats import dump_text, load_file

CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus"
TITAN = sorted((CORPUS / "torchtitan").glob("*.toml"))
#: Extension modules a file's run line names (torchtitan's own scripts pass them with --job.custom_config_module).
ON_COMMAND_LINE = {"transformers_modeling_backend": "torchtitan.experiments.transformers_modeling_backend.job_config"}


@pytest.fixture(scope="module")
def parse():
    """torchtitan's ConfigManager, imported without torchtitan's package __init__ (which imports its models and
    their GPU kernels); returns a function that parses a TOML text as ``--job.config_file``."""
    pytest.importorskip("tyro", reason="tyro (torchtitan's argument parser) is needed: pip install -r "
                        "requirements-dev.txt")  # fmt: skip
    without_package_init("torchtitan", "0.2.2")
    from torchtitan.config.manager import ConfigManager

    def run(text: str, tmp_path: Path, name: str = "") -> object:
        path = tmp_path / "job.toml"
        path.write_text(text, encoding="utf-8")
        extra = next((["--job.custom_config_module", m] for k, m in ON_COMMAND_LINE.items() if k in name), [])
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return ConfigManager().parse_args(["--job.config_file", str(path), *extra])

    return run


def _same_job(a: object, b: object) -> None:
    for section in ("parallelism", "training", "optimizer", "activation_checkpoint", "comm", "checkpoint", "job"):
        assert vars(getattr(a, section)) == vars(getattr(b, section)), section


def _without(node: dict, paths: set[str], prefix: str = "") -> dict:
    """``node`` without the keys at the dotted ``paths``."""
    return {key: _without(value, paths, f"{prefix}{key}.") if isinstance(value, dict) else value
            for key, value in node.items() if f"{prefix}{key}" not in paths}  # fmt: skip


@pytest.mark.parametrize("path", TITAN, ids=lambda p: p.stem)
def test_a_round_tripped_file_gives_torchtitan_the_same_job(path, parse, tmp_path):
    """A file of a fork or of an older torchtitan holds keys torchtitan 0.2.2 refuses: torsh notes each dropped and
    leaves it out, so what it writes is the job of the file without them, which torchtitan 0.2.2 runs."""
    read = adapters.load(path)
    unknown = {n.source_path for n in read.notes if n.refused}
    original = dump_text(_without(load_file(path)[0], unknown), "toml") if unknown else path.read_text("utf-8")
    try:
        expected = parse(original, tmp_path, path.name)
    except ModuleNotFoundError as exc:  # the file's custom_config_module needs a package torchtitan did not install
        pytest.skip(f"torchtitan cannot parse the original without {exc.name}")
    written = adapters.write(read.result, "torchtitan")
    assert not written.lossy, [str(n) for n in written.lossy]
    _same_job(parse(dump_text(written.result, "toml"), tmp_path, path.name), expected)


@pytest.mark.parametrize("path", converted_sources(), ids=lambda p: p.name[:60])
def test_torchtitan_runs_what_torsh_converts_with_the_meaning_of_the_source(path, parse, tmp_path):
    cfg = load_or_skip(path)
    written = adapters.write(cfg, "torchtitan")
    job = parse(dump_text(written.result, "toml"), tmp_path)
    p, s = job.parallelism, cfg.sharding
    lossy = {n.source_path for n in written.lossy}
    if s.stage >= 2:
        assert p.data_parallel_shard_degree != 1
        assert p.fsdp_reshard_after_forward == ("default" if s.stage == 3 and s.reshard_after_forward is not False
                                                else "never")  # fmt: skip
    if "precision.param_dtype" not in lossy and isinstance(cfg.precision.param_dtype, str):
        assert job.training.mixed_precision_param == {"fp32": "float32", "bf16": "bfloat16"}[cfg.precision.param_dtype]
    if isinstance(cfg.batch.micro_batch_size, int):
        assert job.training.local_batch_size == cfg.batch.micro_batch_size
    assert job.activation_checkpoint.mode == ("full" if cfg.activation_checkpointing.enabled else "none")
    if cfg.offload.params == "cpu":
        assert job.training.enable_cpu_offload
