"""``deepspeed.pipe`` on the torsh pipeline engine, side by side with real DeepSpeed 0.19.8.

tests/dropin_scripts/pipeline_style.py (DeepSpeed's pipeline example in shape: a layer list with a lambda,
``training_data`` and ``train_batch()``; and a language model with a ``TiedLayerSpec`` embedding reused on the last
stage, ``seed_layers``, activation checkpointing and ``train_batch(data_iter)``; and one passing a tuple with an
integer mask between stages, with tuple labels) is launched once per engine and
layout, and every check below reads those launches: 2 ranks (``-p 2``, fp32, gradient clipping, save and resume),
and 4 ranks (2 stages x 2 data-parallel replicas, ZeRO-1, bf16; and 4 stages with 2 micro-batches); a WarmupLR
schedule throughout.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_dropin_scripts import BLOCKER, EXIT_ABORT, _env
from torsh import parity
from torsh.config import TorshConfig
from torsh.plan import plan

SCRIPT = Path(__file__).parent / "dropin_scripts" / "pipeline_style.py"
#: use_reentrant false: DeepSpeed's reentrant activation checkpointing leaves a first stage that starts with an
#: embedding without gradients (torsh's checkpointing is non-reentrant).
FP32 = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.003, "torch_adam": True}}, "gradient_clipping": 0.05,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.003,
                                                     "warmup_num_steps": 4}},
        "pipeline": {"use_reentrant": False}}  # fmt: skip
#: 2 x 2 and 4 stages: DeepSpeed 0.19.8 cannot load its own bf16 pipeline checkpoint (KeyError in
#: BF16_Optimizer._load_legacy_checkpoint), so only torsh saves and resumes there.
BF16_ZERO1 = {**FP32, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}
LAYOUTS = {"pp2": (2, FP32, ["--models", "mlp,tied,masked", "--checkpoint_interval", "2"]),
           "pp2dp2": (4, BF16_ZERO1, ["--models", "tied,mlp:4"])}  # fmt: skip


def _start(engine: str, layout: str, tmp: Path) -> tuple[subprocess.Popen | _Forked, Path]:
    """torsh's launch (``torsh run``, DeepSpeed unimportable) or real DeepSpeed's: ranks forked from the test
    process (which has imported torch and DeepSpeed) with the variables torchrun gives its ranks."""
    ranks, config, args = LAYOUTS[layout]
    run = tmp / f"{engine}-{layout}"
    run.mkdir(parents=True)
    (run / "ds_config.json").write_text(json.dumps(config))
    ckpt = [] if (engine == "deepspeed" and layout == "pp2dp2") else ["--ckpt_dir", str(run / "ckpt")]
    argv = [str(SCRIPT), "--deepspeed_config", str(run / "ds_config.json"), *args, *ckpt, "--out",
            str(run / "result.json")]  # fmt: skip
    if engine == "deepspeed":
        import _engine_harness as h

        (run / "log.txt").write_text("")
        context = h.start(_forked_rank, (ranks, h.free_port(), str(run), argv), ranks, join=False)
        return _Forked(context, run / "log.txt"), run
    blocker = run / "blocker" / "deepspeed"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(BLOCKER)
    cmd = [sys.executable, "-m", "torsh.run", "--nproc-per-node", str(ranks), *argv]
    log = open(run / "log.txt", "w")
    return subprocess.Popen(cmd, cwd=run, env=_env(str(run / "blocker")), stdout=log, stderr=subprocess.STDOUT), run


def _forked_rank(rank: int, world: int, port: int, run: str, argv: list[str]) -> None:
    import os
    import runpy

    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      DS_ACCELERATOR="cpu")  # fmt: skip
    torch.set_num_threads(1)
    os.chdir(run)
    with open(Path(run, "log.txt"), "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
    sys.argv = argv
    sys.path.insert(0, str(Path(argv[0]).parent))  # as ``python script.py`` does
    runpy.run_path(argv[0], run_name="__main__")


class _Forked:
    """The forked ranks of one launch, waited for as a ``subprocess.Popen``."""

    def __init__(self, context, log: Path):
        self.context, self.log, self.returncode = context, log, None

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        try:
            while not self.context.join(timeout=5):
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired("forked ranks", timeout)
            self.returncode = 0
        except Exception as exc:  # noqa: BLE001 - a rank that raised or died: its error goes to the log
            with open(self.log, "a") as log:
                log.write(f"\n{exc}\n")
            self.returncode = 1
        return self.returncode

    def kill(self) -> None:
        for process in self.context.processes:
            if process.is_alive():
                process.kill()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{(engine, layout): {model: record}}``; torsh's and DeepSpeed's launches of a layout run side by side."""
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is installed by requirements-dev.txt")
    tmp = tmp_path_factory.mktemp("pipeline")
    results = {}
    for layout in LAYOUTS:
        started = {engine: _start(engine, layout, tmp) for engine in ("torsh", "deepspeed")}
        for engine, (proc, run) in started.items():
            for attempt in range(2):
                if attempt:  # the reference aborted before writing its record: once more
                    proc, run = _start(engine, layout, tmp / "again")
                try:
                    proc.wait(timeout=900)
                finally:
                    proc.kill()
                out, log = run / "result.json", (run / "log.txt").read_text()
                if out.exists() and (proc.returncode == 0 or (engine == "deepspeed" and EXIT_ABORT in log)):
                    break  # real DeepSpeed's processes may abort at exit (CPU/gloo) after writing the record
                if engine == "torsh" or EXIT_ABORT not in log:
                    pytest.fail(f"{engine} {layout} failed:\n{log[-6000:]}")
            results[engine, layout] = json.loads(out.read_text())
    return results


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _worst(ours: list[float], theirs: list[float]) -> float:
    assert len(ours) == len(theirs) > 0
    return max(_relative(a, b) for a, b in zip(ours, theirs))


@pytest.mark.slow
def test_the_runs_used_torsh_and_real_deepspeed(runs):
    for layout in LAYOUTS:
        assert runs["torsh", layout]["deepspeed_version"] == "0.19.8+torsh"
        assert runs["torsh", layout]["real_deepspeed_modules"] == 0
        assert runs["deepspeed", layout]["real_deepspeed_modules"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "tied", "masked"])
def test_pp2_losses_equal_deepspeeds(runs, model):
    """-p 2 in fp32, clipping on: every step's loss (and the evaluation loss) within 1e-5 of DeepSpeed's."""
    ours, theirs = runs["torsh", "pp2"]["models"][model], runs["deepspeed", "pp2"]["models"][model]
    worst = _worst(ours["losses"], theirs["losses"])
    assert worst <= parity.FP32_TOLERANCE["loss"], (ours["losses"], theirs["losses"])
    assert _relative(ours["ranks"][1]["eval_loss"], theirs["ranks"][1]["eval_loss"]) <= parity.FP32_TOLERANCE["loss"]
    print(f"pp2 {model}: {len(ours['losses'])} steps, worst relative loss difference {worst:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "tied", "masked"])
def test_pp2_stages_hold_deepspeeds_layers_and_report_its_loss_everywhere(runs, model):
    ours, theirs = runs["torsh", "pp2"]["models"][model], runs["deepspeed", "pp2"]["models"][model]
    # each stage built the same layers (parameter counts), is first/last as DeepSpeed's, and returns the same loss
    strip = [{k: v for k, v in r.items() if k != "eval_loss"} for r in ours["ranks"]]
    assert strip == [{k: v for k, v in r.items() if k != "eval_loss"} for r in theirs["ranks"]]
    assert [r["first"] for r in ours["ranks"][:2]] == [True, False]
    assert ours["ranks"][0]["micro_batches"] == 4 and ours["ranks"][0]["global_steps"] == 6
    assert ours["ranks"][1]["logits_shape"] == theirs["ranks"][1]["logits_shape"]
    assert all(len(set(step)) == 1 for step in ours["everywhere"])  # broadcast to every stage


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "tied", "masked"])
def test_pp2_checkpoint_has_deepspeeds_layout_and_resumes_exactly(runs, model):
    ours, theirs = runs["torsh", "pp2"]["models"][model], runs["deepspeed", "pp2"]["models"][model]
    assert ours["files"] == theirs["files"] and "layer_00-model_states.pt" in ours["files"]
    assert ours["resumed"] == ours["after_save"]  # a fresh engine (another seed) continues bit for bit
    assert ours["ranks"][-1] == {"resumed_global_steps": 6}


@pytest.mark.slow
def test_pp2_refuses_what_deepspeeds_pipeline_engine_refuses(runs):
    ours = runs["torsh", "pp2"]["models"]["mlp"]["refused"]
    theirs = runs["deepspeed", "pp2"]["models"]["mlp"]["refused"]
    for call in ("forward", "backward", "step"):
        assert ours[call] == theirs[call] == ["PipelineError", "Only train_batch() is accessible in pipeline mode."]
    assert "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" in theirs["zero2"]
    assert "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" in ours["zero2"]
    assert "sharding.stage" in ours["zero2"]


@pytest.mark.slow
def test_pp2dp2_zero1_bf16_losses_match_deepspeed_and_resume(runs):
    """4 ranks: 2 stages x 2 replicas, ZeRO-1 over each stage's replicas, bf16 with fp32 masters."""
    ours, theirs = runs["torsh", "pp2dp2"]["models"]["tied"], runs["deepspeed", "pp2dp2"]["models"]["tied"]
    worst = _worst(ours["losses"], theirs["losses"])
    assert worst <= parity.LOW_PRECISION_FLOOR["loss"], (ours["losses"], theirs["losses"])
    assert [r["first"] for r in ours["ranks"][:4]] == [True, True, False, False]
    assert ours["ranks"][0]["micro_batches"] == 2
    assert all(len(set(step)) == 1 for step in ours["everywhere"])
    assert ours["resumed"] == ours["after_save"]
    assert "zero_pp_rank_1_mp_rank_01_optim_states.pt" in ours["files"]
    stepped = [r["step_dtypes"] for r in ours["ranks"] + theirs["ranks"] if "step_dtypes" in r]
    assert stepped == [["torch.float32"]] * 8  # every rank of both engines steps fp32 masters
    print(f"pp2dp2 bf16 ZeRO-1: worst relative loss difference {worst:.2e}")


@pytest.mark.slow
def test_pp4_with_fewer_micro_batches_than_stages_matches_deepspeed(runs):
    """4 stages on 4 ranks (two of them in the middle, reading no data) and 2 micro-batches: torch's 1F1B takes
    no fewer micro-batches than stages, so the engine runs them as GPipe; DeepSpeed's losses all the same."""
    ours, theirs = runs["torsh", "pp2dp2"]["models"]["mlp:4"], runs["deepspeed", "pp2dp2"]["models"]["mlp:4"]
    worst = _worst(ours["losses"], theirs["losses"])
    assert worst <= parity.LOW_PRECISION_FLOOR["loss"], (ours["losses"], theirs["losses"])
    assert [r["first"] for r in ours["ranks"][:4]] == [True, False, False, False]
    assert [r["last"] for r in ours["ranks"][:4]] == [False, False, False, True]
    assert [r["params"] for r in ours["ranks"][:4]] == [r["params"] for r in theirs["ranks"][:4]]
    assert ours["resumed"] == ours["after_save"]
    print(f"pp4 bf16 2 micro-batches: worst relative loss difference {worst:.2e}")


# ---- in-process: the partition, the topology, the plan ------------------------------------------------------------


def test_parameter_partition_equals_deepspeeds():
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is installed by requirements-dev.txt")
    from deepspeed.runtime import utils as theirs

    from torsh.compat.deepspeed.runtime import utils as ours

    rng = random.Random(0)
    for _ in range(500):
        weights = [rng.choice([0, 1, 2, 100, rng.randint(0, 1000)]) for _ in range(rng.randint(1, 10))]
        parts = rng.randint(1, 4)
        assert ours.partition_balanced(weights, parts) == [int(b) for b in theirs.partition_balanced(weights, parts)]
        assert ours.partition_uniform(len(weights), parts) == theirs.partition_uniform(len(weights), parts)


def test_topology_numbers_ranks_as_deepspeeds():
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is installed by requirements-dev.txt")
    from deepspeed.runtime.pipe import topology as theirs

    from torsh.compat.deepspeed.runtime.pipe import topology as ours

    for make in (lambda t: t.PipeDataParallelTopology(num_pp=2, num_dp=3),
                 lambda t: t.PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)):  # fmt: skip
        a, b = make(ours), make(theirs)
        assert {tuple(k): v for k, v in a.mapping.items()} == {tuple(k): v for k, v in b.mapping.items()}
        for axis in b.get_axis_names():
            assert a.get_axis_comm_lists(axis) == b.get_axis_comm_lists(axis)
            assert a.get_axis_list(axis, 1) == b.get_axis_list(axis, 1)
        assert [a.get_rank_repr(r) for r in range(a.world_size())] == [b.get_rank_repr(r)
                                                                        for r in range(b.world_size())]
        assert a.filter_match(pipe=1) == b.filter_match(pipe=1)


def test_pipeline_degree_is_refused_outside_the_pipeline_engine_only():
    cfg = TorshConfig.model_validate({"parallelism": {"pp": 2}})
    assert any(p.path == "parallelism.pp" and "PipelineModule" in p.reason for p in plan(cfg, 2).refused)
    assert not any(p.path == "parallelism.pp" for p in plan(cfg, 2, pipeline=True).refused)


def test_pipeline_refusals_name_the_key_and_the_alternative():
    from types import SimpleNamespace

    from torsh.engine.pipeline.engine import pipeline_degree, pipeline_refusals

    module = SimpleNamespace(num_stages=2)
    zero3 = TorshConfig.model_validate({"sharding": {"stage": 3}})
    [problem] = pipeline_refusals(zero3, module)
    assert problem.path == "sharding.stage" and "use zero_optimization.stage 0 or 1" in problem.reason
    other = TorshConfig.model_validate({"parallelism": {"pp": 4}})
    assert pipeline_degree(other.parallelism) == 4
    [problem] = pipeline_refusals(other, module)
    assert problem.path == "parallelism.pp" and "has 2 stages" in problem.reason
    assert pipeline_refusals(TorshConfig.model_validate({"parallelism": {"pp": 2}}), module) == []
    assert pipeline_degree(TorshConfig().parallelism) is None  # the default (1) does not contradict the module
    tp = TorshConfig.model_validate({"parallelism": {"tp": 2}})
    assert [p.path for p in pipeline_refusals(tp, module)] == ["parallelism.tp"]


def test_a_deepspeed_fp32_stage_file_loads(tmp_path):
    """DeepSpeed's mp_rank_SS_model_states.pt (no stage count, no micro-step counter, the torch optimizer's state
    as it is, DeepSpeed's own keys) loads: counters, optimizer state, and only the client's keys as client state."""
    from types import SimpleNamespace

    import torch

    from torsh.engine.pipeline.checkpoint import load

    def adam():
        torch.manual_seed(0)
        return torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=0.1)

    theirs = adam()
    for p in theirs.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    theirs.step()
    (tmp_path / "global_step3").mkdir()
    torch.save({"module": None, "optimizer": theirs.state_dict(), "lr_scheduler": None, "global_steps": 3,
                "global_samples": 48, "skipped_steps": 0, "dp_world_size": 1, "mp_world_size": 2, "buffer_names": [],
                "ds_config": {}, "ds_version": "0.19.8", "consumed": 3},
               tmp_path / "global_step3" / "mp_rank_01_model_states.pt")  # fmt: skip
    (tmp_path / "latest").write_text("global_step3")
    loaded_dirs = []
    engine = SimpleNamespace(grid=SimpleNamespace(get_model_parallel_rank=lambda: 1), num_stages=2, dp_world_size=1,
                             get_data_parallel_rank=lambda: 0, zero_optimization_stage=lambda: 0, micro_batches=4,
                             _precision=SimpleNamespace(masters=None), _shard=SimpleNamespace(partition=None),
                             optimizer=adam(), lr_scheduler=None,
                             module=SimpleNamespace(load_state_dir=lambda path, strict: loaded_dirs.append(path)))
    path, client = load(engine, tmp_path, None, True, True, True, False)
    assert client == {"consumed": 3} and loaded_dirs == [path] and path.endswith("global_step3")
    assert (engine.global_steps, engine.global_samples, engine.micro_steps) == (3, 48, 12)
    assert engine.optimizer.state_dict()["state"][0]["exp_avg"].equal(theirs.state_dict()["state"][0]["exp_avg"])
