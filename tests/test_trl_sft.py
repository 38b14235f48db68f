"""TRL's ``SFTTrainer`` on the real stack (trl, transformers, accelerate, datasets; requirements-dev.txt pins them)
with TRL's own accelerate configs, ``deepspeed_zero2.yaml`` and ``deepspeed_zero3.yaml`` (tests/fixtures/trl, 2
processes, fp32): the ``accelerate launch --config_file <yaml>`` line translated to torchrun (``torsh-migrate
launch --to torchrun``, which keeps every ACCELERATE_* variable Accelerate's DeepSpeed launcher exports) runs
tests/dropin_scripts/trl_sft.py on 2 CPU ranks under real DeepSpeed 0.19.8 and under ``torsh run`` with DeepSpeed
unimportable. Per-step losses agree within 1e-5 relative, the learning rates are the same warm-up, and the weights
``save_model`` wrote agree element by element (1e-5, against moves of ~1e-2). At ZeRO-3 ``accelerate launch``
itself also runs the line on torsh (its import hook, DeepSpeed unimportable) and trains as the torchrun line does.

Nothing is downloaded (HF_HUB_OFFLINE=1): the script's ``make_model`` writes a 2-layer Llama and a word-level
tokenizer, the dataset is built in memory. What the script adds to a CPU run of TRL's sft script is the command
line: ``--use_cpu true`` (without it Accelerate counts one process on a machine without GPUs and both DeepSpeed and
torsh refuse the "auto" batch sizes) and ``--bf16 false`` (``SFTConfig`` defaults to bf16)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_dropin_scripts import BLOCKER, EXIT_ABORT, SCRIPTS, TOLERANCE, _env, _relative

pytest.importorskip("trl", reason="TRL's SFTTrainer cases need trl (requirements-dev.txt installs trl==1.16.0)")

CONFIGS = Path(__file__).parent / "fixtures" / "trl"
SCRIPT = SCRIPTS / "trl_sft.py"
STEPS = 6
#: TRL's sft script command line, shrunk: 6 optimizer steps of 2 micro-batches of 2 sequences (at most 32 tokens).
SFT_ARGS = ["--max_steps", str(STEPS), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--learning_rate", "5e-3", "--warmup_steps", "2", "--logging_steps", "1", "--save_strategy", "no",
            "--report_to", "none", "--max_length", "32", "--bf16", "false", "--use_cpu", "true"]  # fmt: skip
WEIGHTS_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The tiny model and tokenizer (written once, read by every run) and DeepSpeed's blocker."""
    root = tmp_path_factory.mktemp("trl_sft")
    spec = importlib.util.spec_from_file_location("trl_sft", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_model(str(root / "model"))
    (root / "blocker" / "deepspeed").mkdir(parents=True)
    (root / "blocker" / "deepspeed" / "__init__.py").write_text(BLOCKER)
    return root


def _torchrun_line(stage: int, work: Path, out: Path):
    """TRL's documented line, ``accelerate launch --config_file <yaml> sft.py ...``, translated to torchrun."""
    from torsh.adapters import launch

    config = CONFIGS / f"deepspeed_zero{stage}.yaml"
    line = (f"accelerate launch --config_file {config} --main_process_port 0 {SCRIPT} "
            f"{' '.join(_script_args(work, out))}")  # fmt: skip
    written = launch.write(launch.read(line).result, version="torchrun")
    return written.result.commands[0]


def _script_args(work: Path, out: Path) -> list[str]:
    return ["--model_name_or_path", str(work / "model"), "--output_dir", str(out.parent / "saved"), *SFT_ARGS,
            "--out", str(out)]  # fmt: skip


def _hf_env(work: Path, extra_path: str | None = None) -> dict:
    env = _env(os.pathsep.join(p for p in (extra_path, str(SCRIPTS)) if p))
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(work / "hf_home"),
                "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
    return env


def _run(argv: list[str], cwd: Path, env: dict, out: Path, *, reference: bool = False) -> dict:
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if out.exists() and (proc.returncode == 0 or (reference and EXIT_ABORT in proc.stderr)):
        return json.loads(out.read_text())  # real DeepSpeed may abort at exit after writing its record
    pytest.fail(f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


_runs: dict[tuple[str, int], dict] = {}
STAGES = (2, 3)
#: Runs several scripts in the ranks of one launch, each unchanged as ``__main__`` with its own variables.
RUNNER = SCRIPTS / "_run_cases.py"


def _launch_spec(engine: str, work: Path) -> tuple[list[str], dict, dict[int, Path]] | None:
    """One launch of the translated torchrun line for every stage of STAGES (engine "torsh" or "deepspeed"): its
    argv and environment, and each stage's record path; None when the stages' launcher options differ."""
    cases, outs, options = [], {}, set()
    for stage in STAGES:
        tmp = work / f"{engine}_zero{stage}"
        tmp.mkdir(parents=True, exist_ok=True)
        outs[stage] = tmp / "result.json"
        command = _torchrun_line(stage, work, outs[stage])
        at = command.argv.index(str(SCRIPT))
        options.add(tuple(command.argv[1:at]))
        cases.append({"name": f"zero{stage}", "script": str(SCRIPT), "args": list(command.argv[at + 1:]),
                      "cwd": str(tmp), "env": dict(command.env)})  # fmt: skip
    if len(options) != 1:
        return None
    spec = work / f"{engine}_cases.json"
    spec.write_text(json.dumps(cases))
    launcher = ["torsh.run"] if engine == "torsh" else ["torch.distributed.run"]
    env = _hf_env(work, str(work / "blocker")) if engine == "torsh" else _hf_env(work)
    return [sys.executable, "-m", *launcher, *options.pop(), str(RUNNER), str(spec)], env, outs


def _both_stages(engine: str, work: Path) -> None:
    """Both stages of ``engine`` in one launch; a stage whose record is missing or whose launch failed (beyond real
    DeepSpeed's abort at exit) is left for its own launch."""
    launch = _launch_spec(engine, work)
    if launch is None:
        return
    argv, env, outs = launch
    for out in outs.values():
        out.unlink(missing_ok=True)
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode == 0 or (engine == "deepspeed" and EXIT_ABORT in proc.stderr):
        for stage, out in outs.items():
            if out.exists():
                record = json.loads(out.read_text())
                record["saved"] = str(out.parent / "saved" / "model.safetensors")
                _runs[engine, stage] = record


@pytest.fixture(scope="module")
def runs(work):
    """Per (engine, stage) the run's record: the torchrun line's stages of one engine in one launch (the first
    time a test asks for one of them), accelerate launch in its own."""

    def get(engine: str, stage: int) -> dict:
        if engine in ("torsh", "deepspeed") and (engine, stage) not in _runs and (engine, -1) not in _runs:
            _runs[engine, -1] = {}  # tried once
            _both_stages(engine, work)
        if (engine, stage) not in _runs:
            tmp = work / f"{engine}_zero{stage}"
            out = tmp / "result.json"
            command = _torchrun_line(stage, work, out)
            if engine == "torsh":
                argv = [sys.executable, "-m", "torsh.run", *command.argv[1:]]
                env = {**_hf_env(work, str(work / "blocker")), **command.env}
            elif engine == "deepspeed":
                argv = [sys.executable, "-m", "torch.distributed.run", *command.argv[1:]]
                env = {**_hf_env(work), **command.env}
            else:  # accelerate launch itself, torsh's import hook first on the path (docs/torsh-run.md's recipe)
                import torsh.run

                config = CONFIGS / f"deepspeed_zero{stage}.yaml"
                argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                        "--main_process_port", "0", str(SCRIPT), *_script_args(work, out)]  # fmt: skip
                env = _hf_env(work, os.pathsep.join([torsh.run.SITE_DIR, str(work / "blocker")]))
            record = _run(argv, tmp, env, out, reference=engine == "deepspeed")
            record["saved"] = str(tmp / "saved" / "model.safetensors")
            _runs[engine, stage] = record
        return _runs[engine, stage]

    return get


def _deepspeed_or_skip():
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pytest.skip("DeepSpeed 0.19.8 (requirements-dev.txt) is not installed: torsh's run not compared")


def _weights_difference(ours: dict, theirs: dict) -> tuple[float, float]:
    """The largest element difference between the two saved models, and the smallest distance a tensor moved."""
    from safetensors.torch import load_file

    a, b = load_file(ours["saved"]), load_file(theirs["saved"])
    assert a.keys() == b.keys()
    assert {k: (list(v.shape), str(v.dtype)) for k, v in a.items()} == {
        k: (list(v.shape), str(v.dtype)) for k, v in b.items()}  # fmt: skip
    return max(float((a[k] - b[k]).abs().max()) for k in a), min(moved for *_, moved in theirs["weights"].values())


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_trl_config_line_keeps_deepspeed_and_runs_on_torsh_without_it(stage, work, runs):
    command = _torchrun_line(stage, work, work / "unused.json")
    assert command.env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert command.env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == str(stage)
    assert command.env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == ("true" if stage == 3 else "false")
    assert "--nproc-per-node=2" in command.argv
    ours = runs("torsh", stage)
    assert ours["deepspeed_version"] == "0.19.8+torsh" and ours["real_deepspeed_modules"] == 0
    assert ours["engine"] == "Engine" and ours["stage"] == stage
    assert ours["optim"] == "adamw_torch_fused"  # the Trainer's default optimizer: no optimizer section
    assert len(ours["losses"]) == STEPS and ours["losses"][-1] < ours["losses"][0]
    assert ours["lrs"][:3] == pytest.approx([0.0, 2.5e-3, 5e-3])  # warm-up from 0, then linear decay
    assert min(moved for *_, moved in ours["weights"].values()) > 1e-3  # every tensor trained


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_trl_sft_trains_as_under_deepspeed(stage, runs):
    ours = runs("torsh", stage)
    _deepspeed_or_skip()
    theirs = runs("deepspeed", stage)
    assert theirs["real_deepspeed_modules"] > 0 and theirs["engine"] == "DeepSpeedEngine"
    assert theirs["stage"] == stage and theirs["optim"] == ours["optim"]
    assert len(ours["losses"]) == len(theirs["losses"]) == STEPS
    worst = max(_relative(a, b) for a, b in zip(ours["losses"], theirs["losses"]))
    assert worst <= TOLERANCE["fp32"], f"ZeRO-{stage}: losses differ by {worst:.3g}:\n{ours['losses']}\n" \
                                       f"{theirs['losses']}"  # fmt: skip
    assert ours["lrs"] == pytest.approx(theirs["lrs"], rel=1e-12)
    difference, moved = _weights_difference(ours, theirs)
    assert difference <= WEIGHTS_TOLERANCE < moved / 100
    print(f"trl_sft zero{stage}: {STEPS} steps, worst relative loss difference {worst:.2e}, "
          f"largest weight difference {difference:.2e} (every tensor moved at least {moved:.2e})")


@pytest.mark.slow
def test_accelerate_launch_with_trl_zero3_config_runs_on_torsh(runs):
    launched, ours = runs("accelerate", 3), runs("torsh", 3)
    assert launched["real_deepspeed_modules"] == 0 and launched["engine"] == "Engine" and launched["stage"] == 3
    assert launched["accelerate_env"] == ours["accelerate_env"]  # the translation carried every variable
    assert launched["losses"] == ours["losses"] and launched["lrs"] == ours["lrs"]
    difference, _ = _weights_difference(launched, ours)
    assert difference == 0.0
