"""Kill a process in the middle of ``save_checkpoint`` and check the previous checkpoint still loads.

``python atomic_worker.py WORKDIR`` prints one JSON object: scenario -> "ok" or the failure text. Each scenario
forks a child that saves a newer checkpoint and SIGKILLs itself at one point of the save; the parent then loads.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from torsh.engine.checkpoint import save_load as checkpoint


def _job(seed: int):
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    return model, opt


def _save(root: Path, tag: str, model, opt) -> None:
    checkpoint.save_checkpoint(root, tag, model=model, optimizer=opt, lr_scheduler=None, loss_scaler=None,
                               engine_state={"global_steps": 1}, client_state={"marker": tag},
                               save_latest=True)  # fmt: skip


def _die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_in_dcp_before_metadata():
    FileSystemWriter.finish = _die  # data files written, .metadata not yet


def _kill_after_model_before_engine_states():
    real = checkpoint._write_bytes
    checkpoint._write_bytes = lambda path, data: _die() if path.name == checkpoint.ENGINE_STATES else real(path, data)


def _kill_before_publish():
    checkpoint._publish = _die


def _kill_between_renames():
    real = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".tmp-"):
            _die()
        real(src, dst)

    checkpoint.os.replace = replace


SCENARIOS = {
    "in_dcp_before_metadata": (_kill_in_dcp_before_metadata, "b"),
    "after_model_before_engine_states": (_kill_after_model_before_engine_states, "b"),
    "before_publish": (_kill_before_publish, "b"),
    "resave_same_tag_between_renames": (_kill_between_renames, "a"),
}


def scenario(root: Path, arm, new_tag: str) -> None:
    model, opt = _job(0)
    _save(root, "a", model, opt)
    expected = model.weight.detach().clone()
    pid = os.fork()
    if pid == 0:  # child: train further, then die while saving
        try:
            with torch.no_grad():
                model.weight.add_(1.0)
            arm()
            _save(root, new_tag, model, opt)
        finally:
            os._exit(3)  # only reached if the kill did not happen
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"child status {status}"
    assert (root / "latest").read_text() == "a"
    fresh, fresh_opt = _job(1)
    path, client, _ = checkpoint.load_checkpoint(root, None, model=fresh, optimizer=fresh_opt,
                                                 lr_scheduler=None, loss_scaler=None)  # fmt: skip
    assert path is not None and client == {"marker": "a"}, (path, client)
    assert torch.equal(fresh.weight, expected), "loaded weights are not the last complete checkpoint's"
    # The next save succeeds and cleans up after the crash.
    _save(root, "c", fresh, fresh_opt)
    leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".old-")))
    assert leftovers == [], leftovers
    assert checkpoint._is_complete(root / "a"), "the last complete copy of tag 'a' is back in place"
    assert checkpoint.load_checkpoint(root, None, model=fresh, optimizer=fresh_opt, lr_scheduler=None,
                                      loss_scaler=None)[1] == {"marker": "c"}  # fmt: skip


def main() -> None:
    workdir = Path(sys.argv[1])
    results = {}
    for name, (arm, new_tag) in SCENARIOS.items():
        try:
            scenario(workdir / name, arm, new_tag)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
