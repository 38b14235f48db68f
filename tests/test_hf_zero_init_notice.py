"""``deepspeed.zero.Init`` on torsh builds whole parameters (sharded at ``initialize``); DeepSpeed partitions each
parameter when its module's constructor returns. What a user can observe of that difference:

- a change made to such a parameter after that point, outside ``GatheredParameters(..., modifier_rank=r)``, is
  lost under DeepSpeed and kept by torsh: torsh logs it where it happens (leaving the context, at ``initialize``),
  naming the parameters and how to get one model under both engines (the 2-rank comparison with DeepSpeed is
  ``test_deepspeed_conformance.py::test_zero_init_change_after_construction``);
- a transformers model built from a config or loaded with ``from_pretrained`` (and ``resize_token_embeddings``)
  under ZeRO-3: transformers >= 5 initialises it inside ``GatheredParameters(modifier_rank=0)`` on rank 0, so the
  weights and each rank's torch random stream afterwards are the same under both engines (measured here on 2
  ranks against real DeepSpeed), and torsh says nothing.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

_LATE = "changed after their module's constructor returned"


@pytest.fixture
def pp(monkeypatch):
    """The partition_parameters module, with ``zero.Init`` not starting a process group in the test process."""
    from torsh.compat.deepspeed import comm
    from torsh.compat.deepspeed.runtime.zero import partition_parameters

    started = []
    monkeypatch.setattr(comm, "init_distributed", lambda *a, **k: started.append(True))
    partition_parameters.started = started
    return partition_parameters


def _late(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if _LATE in r.getMessage()]


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)  # Linear initialises its parameters in its own constructor: kept by both
        self.scale = torch.nn.Parameter(torch.empty(3))
        torch.nn.init.constant_(self.scale, 0.5)  # its own parameter, in its own constructor: kept by both


class _Model(torch.nn.Module):
    def __init__(self, post_init: bool):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.gain = torch.nn.Parameter(torch.ones(2))
        if post_init:  # as transformers < 5's post_init(): the children are partitioned by then under DeepSpeed
            for block in self.blocks:
                torch.nn.init.normal_(block.proj.weight)
        torch.nn.init.constant_(self.gain, 2.0)  # its own parameter, inside its own constructor: kept by both


def test_zero_init_starts_distributed_when_not_started(pp):
    with pp.Init(enabled=False):
        pass
    assert pp.started == [True]


def test_change_inside_constructors_is_not_reported(pp, caplog):
    with caplog.at_level("WARNING", logger="torsh.compat"):
        with pp.Init():
            with pp.Init():  # nested, as transformers nests it
                model = _Model(post_init=False)
        pp.check_before_initialize(model)
    assert _late(caplog) == []


def test_post_init_of_children_is_reported_when_the_context_ends(pp, caplog):
    with caplog.at_level("WARNING", logger="torsh.compat"):
        with pp.Init():
            with pp.Init():
                model = _Model(post_init=True)
            assert _late(caplog) == []  # said when the outermost context ends
        pp.check_before_initialize(model)  # said once, not again at initialize
    (message,) = _late(caplog)
    assert message.startswith("deepspeed.zero.Init: 2 parameter(s)") and "Linear.weight [3, 3]" in message
    assert "GatheredParameters(params, modifier_rank=0)" in message and "random generator" in message


def test_change_after_the_context_is_reported_at_initialize_by_name(pp, caplog):
    with caplog.at_level("WARNING", logger="torsh.compat"):
        with pp.Init():
            model = _Model(post_init=False)
        with torch.no_grad():
            model.blocks[1].scale.mul_(3)  # lost under DeepSpeed
            model.blocks[0].proj.weight.data.normal_()  # also through .data
        with pp.GatheredParameters([model.gain], modifier_rank=0):
            model.gain.data.fill_(5.0)  # written back under DeepSpeed too: not reported
        pp.check_before_initialize(model)
        pp.check_before_initialize(model)  # the parameters are forgotten after the first check
    (message,) = _late(caplog)
    assert message.startswith("deepspeed.initialize: 2 parameter(s)")
    assert "blocks.0.proj.weight, blocks.1.scale." in message and "gain" not in message


def test_failed_construction_says_nothing(pp, caplog):
    with caplog.at_level("WARNING", logger="torsh.compat"):
        with pytest.raises(RuntimeError):
            with pp.Init():
                _Model(post_init=True)
                raise RuntimeError("boom")
    assert _late(caplog) == []


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
