"""``accelerate launch`` with a DeepSpeed config: its torchrun translation keeps the environment accelerate's DeepSpeed
launcher gives the processes (``prepare_deepspeed_cmd_env``), and ``accelerate launch`` itself runs on torsh (the
``deepspeed.launcher.runner`` names Accelerate imports). The end-to-end check runs one line three ways on 2 CPU
ranks: ``accelerate launch`` under torsh's import hook (no DeepSpeed reachable), and its ``torsh-migrate launch
--to torchrun`` translation under ``torsh run``: the same ACCELERATE_* variables and the same per-step losses.
(Accelerate's DeepSpeed path against real DeepSpeed is compared in tests/test_dropin_scripts.py, accelerate_style;
``accelerate launch`` with real DeepSpeed 0.19.8 did not finish within 10 minutes on this CPU machine.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torsh.adapters import launch
from torsh.translate import Fidelity

SCRIPTS = Path(__file__).parent / "dropin_scripts"

DS_YAML = """compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  deepspeed_multinode_launcher: standard
  gradient_accumulation_steps: 1
  gradient_clipping: 1.0
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""
#: Accelerate's own DeepSpeed YAML naming a DeepSpeed JSON (TRL's and Accelerate's examples ship both forms).
FILE_YAML = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: ds_config.json
  zero3_init_flag: false
distributed_type: DEEPSPEED
num_machines: 1
num_processes: 2
main_process_port: 0
"""
#: No train_batch_size: on a CPU-only machine Accelerate fills an "auto" one counting 1 process (see accelerate_style).
DS_JSON = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2}}


def _translate(line: str, cwd: Path):
    here = os.getcwd()
    os.chdir(cwd)  # accelerate launch opens the config from the working directory; so does the reader
    try:
        read = launch.read(line)
        written = launch.write(read.result, version="torchrun")
    finally:
        os.chdir(here)
    return read, written


def _lossy(notes) -> dict[str, str]:
    return {n.source_path: n.fidelity.value for n in notes if n.lossy}


def test_deepspeed_yaml_keeps_accelerates_deepspeed_environment_in_the_torchrun_line(tmp_path):
    (tmp_path / "ds.yaml").write_text(DS_YAML)
    read, written = _translate("accelerate launch --config_file ds.yaml train.py --lr 1", tmp_path)
    env = dict(written.result.commands[0].env)
    # exactly what accelerate 1.15's prepare_deepspeed_cmd_env exports for this file (PYTHONPATH aside)
    assert env == {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_DEEPSPEED": "true",
                   "ACCELERATE_CONFIG_DS_FIELDS": "deepspeed_multinode_launcher,gradient_accumulation_steps,"
                   "gradient_clipping,offload_optimizer_device,offload_param_device,zero3_init_flag,"
                   "zero3_save_16bit_model,zero_stage,mixed_precision",
                   "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1",
                   "ACCELERATE_GRADIENT_CLIPPING": "1.0", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
                   "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true",
                   "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true"}  # fmt: skip
    assert written.result.commands[0].argv[-3:] == ("train.py", "--lr", "1")
    assert _lossy(read.notes) == {}
    # the one thing torchrun does not do: accelerate puts its working directory on PYTHONPATH (a loss, said so)
    assert _lossy(written.notes) == {"launch.env.PYTHONPATH": "approximate", "extensions.launch.program": "dropped"}


def test_the_command_line_wins_over_the_file_and_is_carried_as_its_variable(tmp_path):
    (tmp_path / "ds.yaml").write_text(FILE_YAML)
    line = "accelerate launch --config_file ds.yaml --zero_stage 3 --mixed_precision FP16 --debug train.py"
    read, written = _translate(line, tmp_path)
    env = dict(written.result.commands[0].env)
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3" and env["ACCELERATE_MIXED_PRECISION"] == "fp16"
    assert env["ACCELERATE_DEBUG_MODE"] == "true" and env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "ds_config.json"
    assert env["ACCELERATE_CONFIG_DS_FIELDS"] == "deepspeed_config_file,zero3_init_flag"  # precision: the flag's
    assert _lossy(read.notes) == {}
    carried = {n.source_path: n for n in written.notes if n.source_path.startswith("extensions.launch.accelerate.")}
    assert {k: n.fidelity for k, n in carried.items()} == {
        "extensions.launch.accelerate.zero_stage": Fidelity.EXACT,
        "extensions.launch.accelerate.mixed_precision": Fidelity.EXACT,
        "extensions.launch.accelerate.debug": Fidelity.EXACT}  # fmt: skip


def test_use_deepspeed_without_a_config_file_and_what_cannot_be_carried():
    read, written = _translate("accelerate launch --use_deepspeed --num_processes 2 --zero_stage 2 "
                               "--mixed_precision fp8 train.py", Path.cwd())  # fmt: skip
    env = dict(written.result.commands[0].env)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    assert env["ACCELERATE_CONFIG_DS_FIELDS"] == ""
    assert _lossy(read.notes) == {"accelerate.mixed_precision": "unsupported"}  # fp8's own settings
    # not a DeepSpeed job with --cpu (accelerate runs its plain launcher then)
    read, written = _translate("accelerate launch --use_deepspeed --cpu --num_processes 2 train.py", Path.cwd())
    assert "ACCELERATE_USE_DEEPSPEED" not in written.result.commands[0].env


def test_launcher_names_accelerate_imports_are_deepspeeds():
    import torsh.compat.deepspeed.launcher.constants as constants
    import torsh.compat.deepspeed.launcher.runner as runner

    ours = {name: getattr(runner, name) for name in runner.__all__ if not callable(getattr(runner, name))}
    ours.update({name: getattr(constants, name) for name in dir(constants) if name.isupper()})
    with pytest.raises(SystemExit, match="torsh run"):
        runner.main()
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 (requirements-dev.txt) gives the reference values")
    probe = ("import json, deepspeed.launcher.runner as r, deepspeed.launcher.constants as c; "
             f"print(json.dumps({{n: getattr(r, n, getattr(c, n, None)) for n in {sorted(ours)!r}}}))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == json.loads(json.dumps(ours))


def _run(argv: list[str], cwd: Path, env: dict, out: Path) -> dict:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if out.exists():  # real DeepSpeed may abort at exit after writing its record (see test_dropin_scripts)
        return json.loads(out.read_text())
    pytest.fail(f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


@pytest.mark.slow
def test_accelerate_launch_runs_on_torsh_and_its_torchrun_translation_trains_the_same(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate launch is the source launcher here")
    from test_dropin_scripts import BLOCKER

    import torsh.run

    (tmp_path / "ds.yaml").write_text(FILE_YAML)
    (tmp_path / "ds_config.json").write_text(json.dumps(DS_JSON))
    (tmp_path / "blocker" / "deepspeed").mkdir(parents=True)
    (tmp_path / "blocker" / "deepspeed" / "__init__.py").write_text(BLOCKER)
    script = str(SCRIPTS / "hf_accelerate_launched.py")
    base = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    path = os.pathsep.join([str(SCRIPTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    # the recipe: torsh's sitecustomize first on PYTHONPATH makes every Python of the job import torsh's deepspeed
    hooked = {**base, "PYTHONPATH": os.pathsep.join([torsh.run.SITE_DIR, str(tmp_path / "blocker"), path])}
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "ds.yaml", script]
    ours = _run([*accelerate, "--out", str(tmp_path / "a.json")], tmp_path, hooked, tmp_path / "a.json")
    assert ours["engine"] == "Engine" and ours["stage"] == 2 and ours["real_deepspeed_modules"] == 0

    read, written = _translate(f"accelerate launch --config_file ds.yaml {script} --out {tmp_path / 't.json'}",
                               tmp_path)  # fmt: skip
    command = written.result.commands[0]
    assert command.argv[0] == "torchrun"
    # the file's main_process_port 0 ("a free port" to accelerate) is torchrun's --standalone, not a port 0
    assert "--standalone" in command.argv and not any(a.startswith("--master-port") for a in command.argv)
    translated = _run([sys.executable, "-m", "torsh.run", *command.argv[1:]], tmp_path,
                      {**base, "PYTHONPATH": os.pathsep.join([str(tmp_path / "blocker"), path]), **command.env},
                      tmp_path / "t.json")  # fmt: skip
    assert translated["env"] == ours["env"]  # every ACCELERATE_* variable accelerate launch gave the processes
    assert translated["engine"] == "Engine" and translated["losses"] == ours["losses"]
