"""migration_examples/launch: the torchrun script is the translation of the deepspeed script."""

from __future__ import annotations

import re

from torsh.adapters import launch


def _command(path) -> str:
    return path.read_text(encoding="utf-8").strip().splitlines()[-1]


def test_torchrun_script_is_the_translation_of_the_deepspeed_script(examples):
    folder = examples / "launch"
    cfg = launch.read(_command(folder / "run_deepspeed.sh"), hostfile=(folder / "hostfile").read_text()).result
    written = launch.write(cfg, version="torchrun").result
    template = _command(folder / "run_torchrun.sh")
    expected = [re.sub(r"\$\{NODE_RANK:\?[^}]*\}", str(rank), template) for rank in range(2)]
    assert [c.shell() for c in written.commands] == expected
    assert [c.host for c in written.commands] == ["worker-0", "worker-1"]


def test_readme_shows_the_current_output_and_explains_every_flag(examples):
    folder = examples / "launch"
    readme = (folder / "README.md").read_text(encoding="utf-8")
    cfg = launch.read(_command(folder / "run_deepspeed.sh"), hostfile=(folder / "hostfile").read_text()).result
    for command in launch.write(cfg, version="torchrun").result.commands:
        assert command.shell() in readme
    for flag in ("--hostfile", "--master_addr", "--master_port", "--num_nodes", "--num_gpus", "--include",
                 "--no_ssh", "--local_rank", "--nproc-per-node", "--node-rank", "--nnodes"):
        assert f"`{flag}" in readme or f" {flag}" in readme, flag
