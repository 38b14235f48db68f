"""A transformers model built from a config or loaded with ``from_pretrained`` (and ``resize_token_embeddings``)
under ZeRO-3 (``HfDeepSpeedConfig``: transformers builds it inside ``deepspeed.zero.Init``, which partitions each
module's parameters when its constructor returns, and initialises or loads it inside ``GatheredParameters``): the
weights and each rank's torch random stream afterwards are the same under both engines, measured on 2 ranks
against real DeepSpeed. The partitioning itself is tested in ``test_zero_init_partition.py`` and
``test_zero_init_ranks.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")


# ---- transformers under ZeRO-3: 2 ranks, real DeepSpeed and torsh ----------------------------------------------

SCRIPT = r'''
import json, logging, os, sys
import torch, torch.distributed as dist
import deepspeed
import transformers
from transformers import AutoModelForCausalLM, GPT2Config
from transformers.integrations import HfDeepSpeedConfig

transformers.logging.set_verbosity_error()
out_dir = sys.argv[1]
messages = []
handler = logging.Handler(logging.WARNING)
handler.emit = lambda record: messages.append(record.getMessage())
logging.getLogger("torsh.compat").addHandler(handler)
config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
if os.environ["RANK"] == "0":  # saved before ZeRO-3 is on
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir + "/pretrained")
keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})


def summary(model):
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [round(float(p.detach().double().sum()), 6) for p in params] + [list(params[0].shape)]


record = {}
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config)  # zero.Init starts torch.distributed here
rank = dist.get_rank()
record["from_config"] = [summary(model), torch.rand(2).tolist()]
dist.barrier()
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(out_dir + "/pretrained")
record["from_pretrained"] = [summary(model), torch.rand(2).tolist()]
torch.manual_seed(0)
model.resize_token_embeddings(108)
record["resized"] = [summary(model), torch.rand(2).tolist()]
record["warnings"] = [m for m in messages if "zero.Init" in m]
with open(f"{out_dir}/rank{rank}.json", "w") as f:
    json.dump(record, f)
'''


def _launch(launcher: list[str] | None, tmp, env) -> list[dict]:
    """The script on 2 ranks: under ``launcher``, or (None) in ranks forked from the test process with the
    variables torchrun gives its ranks."""
    tmp.mkdir()
    script = tmp / "zero3_build.py"
    script.write_text(SCRIPT)
    if launcher is None:
        import _engine_harness as h

        h.start(_forked_rank, (h.free_port(), str(script), str(tmp)), 2)
        output = ""
    else:
        proc = subprocess.run([*launcher, "--nproc-per-node", "2", str(script), str(tmp)], cwd=tmp, env=env,
                              capture_output=True, text=True, timeout=900)  # fmt: skip
        output = f"{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    ranks = [tmp / f"rank{r}.json" for r in range(2)]
    assert all(p.exists() for p in ranks), output
    return [json.loads(p.read_text()) for p in ranks]


def _forked_rank(rank: int, port: int, script: str, out: str) -> None:
    import os
    import runpy

    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      DS_ACCELERATOR="cpu")  # fmt: skip
    torch.set_num_threads(1)
    os.chdir(out)
    sys.argv = [script, out]
    runpy.run_path(script, run_name="__main__")


@pytest.mark.slow
def test_transformers_zero3_models_match_deepspeed(tmp_path):
    pytest.importorskip("transformers", reason="transformers is installed by requirements-dev.txt")
    from test_dropin_scripts import BLOCKER, _env

    blocker = tmp_path / "blocker" / "deepspeed"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(BLOCKER)
    ours = _launch([sys.executable, "-m", "torsh.run"], tmp_path / "torsh", _env(str(tmp_path / "blocker")))
    pytest.importorskip("deepspeed", reason="the comparison needs real DeepSpeed (requirements-dev.txt)")
    theirs = _launch(None, tmp_path / "deepspeed", None)  # real DeepSpeed, in forked ranks
    for rank, (o, t) in enumerate(zip(ours, theirs)):
        assert o["warnings"] == [], o["warnings"]
        for step in ("from_config", "from_pretrained", "resized"):
            assert o[step] == t[step], (rank, step)
    # rank 0 initialised the model built from a config (transformers' ZeRO-3 path), rank 1 drew nothing
    assert ours[0]["from_config"][1] != ours[1]["from_config"][1]
    assert ours[0]["resized"][0][-1] == [108, 32]
