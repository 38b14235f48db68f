"""torsh-migrate env: versions without importing, PyTorch backends and devices, launcher variables, JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from torsh import __version__
from torsh.cli import env as env_cli
from torsh.cli import main


def run_cli(*args: str, env: dict[str, str] | None = None, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = prelude + "import sys\nfrom torsh.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})  # fmt: skip


#: A launcher environment (torchrun on a Slurm node) plus variables that must not be reported.
LAUNCHED = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "node7", "MASTER_PORT": "29511",
            "TORCHELASTIC_RUN_ID": "job9", "SLURM_PROCID": "0", "HOROVOD_FUSION_THRESHOLD": "1024",
            "OMPI_COMM_WORLD_SIZE": "4", "MY_SECRET_TOKEN": "x", "RANKING": "no"}  # fmt: skip


def test_json_report_is_one_document_with_versions_backends_devices_and_launcher_variables(monkeypatch, capsys):
    for name in list(os.environ):
        if name in env_cli.LAUNCHER_NAMES or name.startswith(env_cli.LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    for name, value in LAUNCHED.items():
        monkeypatch.setenv(name, value)
    assert main(["env", "--report", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["versions"]["torsh"] == __version__
    assert report["versions"]["torch"] == metadata.version("torch")
    assert report["versions"]["deepspeed"] == metadata.version("deepspeed")
    assert report["versions"]["fairscale"] == metadata.version("fairscale")
    assert set(report["versions"]) >= {"torsh", "torch", "deepspeed", "accelerate", "fairscale", "horovod"}
    torch = report["torch"]
    assert torch["distributed_available"] is True and torch["gloo_available"] is True
    assert set(torch) >= {"cuda_available", "cuda_built", "nccl_available", "mpi_available", "nccl_version"}
    assert torch["devices"][0]["type"] == "cpu" and torch["devices"][0]["cores"] == os.cpu_count()
    expected = {k: v for k, v in LAUNCHED.items() if k not in ("MY_SECRET_TOKEN", "RANKING")}
    assert report["environment"] == expected


def test_table_report_says_not_installed_and_lists_the_variables(monkeypatch, capsys):
    real = metadata.version

    def version(dist):
        if dist in ("horovod", "accelerate"):
            raise metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(metadata, "version", version)
    for name in list(os.environ):
        if name in env_cli.LAUNCHER_NAMES or name.startswith(env_cli.LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    assert ["horovod", "not", "installed"] in lines and ["accelerate", "not", "installed"] in lines
    assert ["torsh", __version__] in lines
    assert ["gloo", "yes"] in lines
    env_section = out.split("Launcher environment\n")[1].split()
    assert env_section == ["SLURM_JOB_ID", "77", "WORLD_SIZE", "2"]
    assert main(["env", "--report", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["versions"]["horovod"] is None and report["versions"]["accelerate"] is None


def test_without_torch_env_reports_it_and_imports_nothing_heavy():
    # torch's metadata says "not installed": env must not import it (and says which extra installs it).
    prelude = ("import importlib.metadata as m\n_v = m.version\n"
               "def version(d):\n    if d == 'torch':\n        raise m.PackageNotFoundError(d)\n    return _v(d)\n"
               "m.version = version\nimport atexit\n"
               "atexit.register(lambda: print('TORCH IMPORTED' if 'torch' in sys.modules else 'torch not imported'))\n"
               "import sys\n")  # fmt: skip
    result = run_cli("env", prelude=prelude)
    assert result.returncode == 0, result.stderr
    assert "torch not imported" in result.stdout
    assert "not installed: pip install 'torsh-distributed[engine]'" in result.stdout


def test_a_broken_torch_is_reported_not_raised():
    result = run_cli("env", "--report", "json", prelude="import sys\nsys.modules['torch'] = None\n")
    assert result.returncode == 0, result.stderr
    assert "import torch failed" in json.loads(result.stdout)["torch"]["error"]


@pytest.mark.parametrize("argv", [["--help"], ["validate", "--help"]])
def test_the_env_command_keeps_the_cli_free_of_torch(argv):
    code = ("import sys\nfrom torsh.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'torsh.cli.env' in sys.modules)\n")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert result.stdout.split()[-2:] == ["False", "True"], result.stdout + result.stderr
