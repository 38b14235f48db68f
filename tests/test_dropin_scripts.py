"""DeepSpeed-style training scripts (tests/dropin_scripts/) run unchanged on torsh and on real DeepSpeed.

Each script runs twice on 2 CPU ranks: launched by ``torsh run`` with a ``deepspeed`` package on PYTHONPATH that
raises on import (so real DeepSpeed cannot be reached), and with DeepSpeed 0.19.8 in ranks forked from the test
process with the variables torchrun gives its ranks (torch and DeepSpeed are imported once). The
per-step losses they write must agree: fp32 within 1e-5 relative, bf16 within the parity band. The scripts of
one side run one after the other in the ranks of one launch (tests/dropin_scripts/_run_cases.py), each unchanged
as ``__main__`` and checked by its own test.

The same launches run two Hugging Face scripts whose optimizer and scheduler are built by the Trainer or the script
(HF_CASES, with checks of their own): the per-step losses agree (fp32, 1e-5 relative), the learning rates are the
warm-up's, and the weights moved as far as DeepSpeed's.

- ``trainer_zero3`` (tests/dropin_scripts/hf_trainer_client_optim.py): ``Trainer`` with
  ``TrainingArguments(deepspeed=<dict>)``, a config without ``optimizer``/``scheduler``, the Trainer's default
  optimizer (a fused AdamW: it crashed at ZeRO-2/3, "fused and foreach cannot be True together") and
  ``optim="adamw_torch"``.
- ``accelerate_scheduler_zero2`` (tests/dropin_scripts/hf_accelerate_scheduler.py): a warm-up scheduler built
  before ``accelerator.prepare`` on the script's optimizer (not passed to ``initialize``): it stepped an optimizer
  that no longer stepped, and the run trained nothing at lr 0 while the scheduler reported a rising lr.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torsh import parity

SCRIPTS = Path(__file__).parent / "dropin_scripts"

CIFAR_CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
                "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
                "zero_optimization": {"stage": 0}}  # fmt: skip
#: fp16 with dynamic loss scaling, on the conv + BatchNorm model: DeepSpeed casts the whole module (buffers too).
CIFAR_FP16_CONFIG = {**CIFAR_CONFIG, "fp16": {"enabled": True, "initial_scale_power": 8}}

#: case -> (script, extra arguments, precision, config written to {tmp}/ds_config.json); "{tmp}": the test's dir.
CASES = {
    "cifar_style": ("cifar_style", ["--deepspeed_config", "{tmp}/ds_config.json"], "fp32", CIFAR_CONFIG),
    "cifar_style_fp16": ("cifar_style", ["--deepspeed_config", "{tmp}/ds_config.json"], "fp16", CIFAR_FP16_CONFIG),
    # DeepSpeedExamples' cifar10 --moe: 2 experts over 2 ranks, top-1 with RSample noise, the expert param groups
    "cifar_moe_style": ("cifar_style", ["--deepspeed_config", "{tmp}/ds_config.json", "--moe", "--ep-world-size", "2",
                                        "--num-experts", "2", "--top-k", "1", "--noisy-gate-policy", "RSample",
                                        "--moe-param-group", "--save_dir", "{tmp}/checkpoints"], "fp32",
                        CIFAR_CONFIG),
    "cifar_moe_zero2_style": ("cifar_style", ["--deepspeed_config", "{tmp}/ds_config.json", "--moe", "--ep-world-size",
                                              "2", "--num-experts", "2", "--top-k", "1", "--moe-param-group",
                                              "--save_dir", "{tmp}/checkpoints"], "fp32",
                              {**CIFAR_CONFIG, "zero_optimization": {"stage": 2}}),
    "comm_checkpoint_style": ("comm_checkpoint_style", ["--ckpt_dir", "{tmp}/checkpoints"], "fp32", None),
    "bert_unused_raw_style": ("bert_unused_raw_style", [], "fp32", None),
    "hf_causal_lm_style": ("hf_causal_lm_style", [], "bf16", None),
    "hf_causal_lm_zero2_style": ("hf_causal_lm_style", ["--zero_stage", "2", "--dtype", "fp32"], "fp32", None),
    "hf_trainer_style": ("hf_trainer_style", [], "fp32", None),
    "hf_trainer_zero3_style": ("hf_trainer_style", ["--zero_stage", "3"], "fp32", None),
    "accelerate_style": ("accelerate_style", [], "fp32", None),
    "accelerate_zero3_style": ("accelerate_style", ["--zero_stage", "3"], "fp32", None),
    "accelerate_compile_style": ("accelerate_style", ["--dynamo_backend", "eager"], "fp32", None),
}
#: Cases with checks of their own (the tests at the end), run in the same launches as CASES.
HF_CASES = {"trainer_zero3": ("hf_trainer_client_optim", ["--zero_stage", "3"], "fp32", None),
            "accelerate_scheduler_zero2": ("hf_accelerate_scheduler", ["--zero_stage", "2"], "fp32", None)}
ALL_CASES = {**CASES, **HF_CASES}
#: Cases whose script needs packages beyond the engine's (skipped, with the reason, when they are missing).
NEEDS = {"hf_trainer_style": ("transformers", "accelerate"), "hf_trainer_zero3_style": ("transformers", "accelerate"),
         "accelerate_style": ("accelerate",), "accelerate_zero3_style": ("accelerate",),
         "accelerate_compile_style": ("accelerate",), "trainer_zero3": ("transformers", "accelerate"),
         "accelerate_scheduler_zero2": ("transformers", "accelerate")}
#: Cases real DeepSpeed 0.19.8 cannot run on the CPU, and why (they run on torsh only).
DEEPSPEED_CANNOT = {"cifar_style_fp16": "DeepSpeed 0.19.8 on the CPU accelerator fails in BatchNorm with fp16 "
                                        "('expected scalar type Half but found Float')"}
TOLERANCE = {"fp32": parity.FP32_TOLERANCE["loss"], "bf16": parity.LOW_PRECISION_FLOOR["loss"]}

BLOCKER = 'raise ImportError("real DeepSpeed was imported in a torsh run job")\n'

def _env(extra_path: str | None = None) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    return env


#: What a process that finished its work prints when it is killed by the C++ teardown after Python's exit.
EXIT_ABORT = "terminate called without an active exception"
#: Runs several cases in the ranks of one launch (each script unchanged, as ``__main__``).
RUNNER = SCRIPTS / "_run_cases.py"
#: Cases that end a launch: the script destroys its process group.
LAST = ("comm_checkpoint_style",)


def _case(name: str, tmp: Path, cases: dict | None = None) -> dict:
    """The case's script, arguments and working directory (``tmp/name``, its config written there); ``cases``: the
    table it is in (CASES by default)."""
    cwd = tmp / name
    cwd.mkdir(parents=True, exist_ok=True)
    script, args, _, config = (cases or CASES)[name]
    if config is not None:
        (cwd / "ds_config.json").write_text(json.dumps(config))
    args = [a.format(tmp=cwd) for a in args]
    return {"name": name, "script": str(SCRIPTS / f"{script}.py"), "args": [*args, "--out", str(cwd / "result.json")],
            "cwd": str(cwd)}


def _launches(names: list[str]) -> list[list[str]]:
    """The cases in as few launches as LAST allows: one, unless more than one case destroys its process group."""
    last = [name for name in names if name in LAST]
    launches = [[name for name in names if name not in LAST]]
    launches[-1] += last[:1]
    launches += [[name] for name in last[1:]]
    return [launch for launch in launches if launch]


def _launch_all(launcher: list[str] | None, names: list[str], tmp: Path, env: dict, *, reference: bool = False,
                cases: dict | None = None) -> dict[str, dict | str]:
    """Run the cases ``names`` (of ``cases``, CASES by default) on 2 ranks in as few launches as they allow
    (:func:`_launches`); returns ``{name: rank 0's record}``, or the failure (command and output) of a case that
    failed."""
    results: dict[str, dict | str] = {}
    for index, names_ in enumerate(_launches(names)):
        results.update(_launch_cases(launcher, names_, tmp, tmp / f"cases{index}.json", env, reference=reference,
                                     cases=cases))  # fmt: skip
    return results


def _launch_cases(launcher: list[str] | None, names: list[str], tmp: Path, spec: Path, env: dict, *,
                  reference: bool, cases: dict | None) -> dict[str, dict | str]:
    """Run the cases ``names`` in one launch (``launcher`` None: ranks forked from this process), in order. A
    launch that ends before a case wrote its record failed at that case, and the cases after it run again in a new
    launch. ``reference``: the runs under real
    DeepSpeed, whose processes can abort at exit after training (CPU/gloo, scripts that end without destroying
    their process group; 2 of 15 reference runs in one day's full suites): a record written whole counts, and a
    case whose launch aborted before writing it is run once more. torsh's own runs get no such allowance: a launch
    that wrote every record and exits non-zero fails all its cases."""
    tmp.mkdir(parents=True, exist_ok=True)
    pending = list(names)
    results: dict[str, dict | str] = {}
    retried: set[str] = set()
    while pending:
        specs = [_case(name, tmp, cases) for name in pending]
        outs = {case["name"]: Path(case["args"][-1]) for case in specs}
        for out in outs.values():
            out.unlink(missing_ok=True)
        spec.write_text(json.dumps(specs))
        cmd = [*(launcher or ["(forked ranks)"]), "--nproc-per-node", "2", str(RUNNER), str(spec)]
        if launcher is None:
            output, code = _forked_launch(spec, tmp, env, timeout=300 + 150 * len(specs))
        else:
            try:
                proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True,
                                      timeout=300 + 150 * len(specs))  # fmt: skip
                output, code = f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}", proc.returncode
            except subprocess.TimeoutExpired as exc:
                output, code = f"timed out after {exc.timeout:.0f} s\n{str(exc.stderr or '')[-6000:]}", None
        written = {name: json.loads(out.read_text()) for name, out in outs.items() if out.exists()}
        aborted = reference and EXIT_ABORT in output
        failure = f"{' '.join(cmd)} (cases {', '.join(pending)}) failed:\n{output}"
        if len(written) == len(pending):
            for name in pending:
                results[name] = written[name] if code == 0 or aborted else failure
            break
        failed = next(name for name in pending if name not in written)
        for name in pending[:pending.index(failed)]:  # finished before the runner went on to the failed case
            results[name] = written[name]
        if aborted and failed not in retried:
            retried.add(failed)
            pending = pending[pending.index(failed):]
        else:
            results[failed] = failure
            pending = pending[pending.index(failed) + 1:]
    return results


def _forked_launch(spec: Path, cwd: Path, env: dict, timeout: float) -> tuple[str, int | None]:
    """The runner on 2 ranks forked from the test process (torch and what it imported are not imported again),
    each with ``env`` and the variables torchrun gives its ranks; (output, exit code: None on a timeout)."""
    import time

    import _engine_harness as h

    log = spec.with_suffix(".log")
    log.write_text("")
    launch = h.start(_forked_rank, (h.free_port(), str(spec), str(cwd), str(log), env), 2, join=False)
    deadline = time.monotonic() + timeout
    try:
        while not launch.join(timeout=5):
            if time.monotonic() > deadline:
                for process in launch.processes:
                    process.kill()
                return f"timed out after {timeout:.0f} s\n{log.read_text()[-6000:]}", None
    except Exception as exc:  # noqa: BLE001 - a rank raised or died: the launch failed, with its error
        return f"{log.read_text()[-3000:]}\n{str(exc)[-6000:]}", 1
    return log.read_text()[-3000:], 0


def _forked_rank(rank: int, port: int, spec: str, cwd: str, log: str, env: dict) -> None:
    import torch

    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    os.chdir(cwd)
    with open(log, "a") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
    sys.argv = [str(RUNNER), spec]
    sys.path.insert(0, str(SCRIPTS))  # as ``python _run_cases.py`` has it
    import runpy

    runpy.run_path(str(RUNNER))["main"](spec)


def _launch(launcher: list[str], name: str, tmp: Path, env: dict, *, reference: bool = False) -> dict:
    """One case on 2 ranks (see :func:`_launch_all`): rank 0's record, or the test fails with the launch's
    output."""
    result = _launch_all(launcher, [name], tmp, env, reference=reference)[name]
    if isinstance(result, str):
        pytest.fail(result)
    return result


def _needs_met(name: str) -> bool:
    return all(importlib.util.find_spec(package) is not None for package in NEEDS.get(name, ()))


def _skip_without_needs(name: str) -> None:
    for package in NEEDS.get(name, ()):
        pytest.importorskip(package, reason=f"{name} needs {package} (requirements-dev.txt installs it)")


def _record(results: dict[str, dict | str], name: str) -> dict:
    if isinstance(results[name], str):
        pytest.fail(results[name])
    return results[name]


@pytest.fixture(scope="module")
def torsh_results(tmp_path_factory) -> dict[str, dict | str]:
    """Every case (whose packages are installed) under ``torsh run``, with an importable ``deepspeed`` on
    PYTHONPATH that raises, in as few launches as they allow."""
    tmp = tmp_path_factory.mktemp("torsh")
    blocker = tmp / "blocker" / "deepspeed"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(BLOCKER)
    names = [name for name in sorted(ALL_CASES) if _needs_met(name)]
    return _launch_all([sys.executable, "-m", "torsh.run"], names, tmp / "runs", _env(str(tmp / "blocker")),
                       cases=ALL_CASES)  # fmt: skip


@pytest.fixture(scope="module")
def deepspeed_results(tmp_path_factory) -> dict[str, dict | str]:
    """Every case real DeepSpeed runs here (whose packages are installed) with DeepSpeed 0.19.8, in ranks forked
    from the test process (:func:`_forked_launch`), in as few launches as they allow."""
    pytest.importorskip("deepspeed", reason="DeepSpeed 0.19.8 is installed by requirements-dev.txt")
    names = [name for name in sorted(set(ALL_CASES) - set(DEEPSPEED_CANNOT)) if _needs_met(name)]
    return _launch_all(None, names, tmp_path_factory.mktemp("deepspeed"), _env(), reference=True,
                       cases=ALL_CASES)  # fmt: skip


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_script_runs_unchanged_on_torsh_without_deepspeed(name, torsh_results):
    _skip_without_needs(name)
    result = _record(torsh_results, name)
    assert result["deepspeed_file"].startswith(str(Path(__import__("torsh").__file__).parent))
    assert result["deepspeed_version"] == "0.19.8+torsh" and result["real_deepspeed_modules"] == 0
    assert all(l == l and l < 1e4 for l in result["losses"])  # finite
    if name == "cifar_style_fp16":
        assert result["losses"][-1] < result["losses"][0]  # trains with the BatchNorm buffers cast
    if name == "comm_checkpoint_style":
        assert result["resumed_steps"] == 5 and result["consumed"] == 6 and result["loaded"]
        assert result["losses"][-4:] == pytest.approx(result["after_save"], rel=1e-6)  # resume continues exactly
    if name == "bert_unused_raw_style":
        assert result["ranks_agree"] and result["pooler_grad_is_none"]
    if name.startswith("hf_trainer"):
        assert result["metadata_version"] == "0.19.8+torsh"  # Accelerate/Trainer see the package metadata
        # resume_from_checkpoint at step 2 continues exactly; save_model wrote the whole model
        assert result["resumed"][2:] == pytest.approx(result["losses"][2:], rel=1e-6)
        assert result["saved"]["transformer.wte.weight"][:2] == [[64, 32], "torch.float32"]
    if name.startswith("hf_causal_lm"):
        assert result["tied"] and result["shapes"]["lm_head.weight"] == [64, 32]
        # the save helpers that gather when hasattr(p, "ds_id") get whole plain tensors at stages 2 and 3
        for saved in (result["copies"], result["saved"]) if name == "hf_causal_lm_style" else (result["copies"],):
            assert {k: v[:2] for k, v in saved.items()} == {k: [s, "Tensor"] for k, s in result["shapes"].items()
                                                            if k != "lm_head.weight"}, saved  # tied: listed once


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(CASES) - set(DEEPSPEED_CANNOT)))
def test_script_losses_match_real_deepspeed(name, deepspeed_results, torsh_results):
    _skip_without_needs(name)
    theirs = _record(deepspeed_results, name)
    ours = _record(torsh_results, name)
    assert theirs["real_deepspeed_modules"] > 0 and len(ours["losses"]) == len(theirs["losses"])
    tolerance = TOLERANCE[CASES[name][2]]
    worst = max(_relative(a, b) for a, b in zip(ours["losses"], theirs["losses"]))
    assert worst <= tolerance, f"{name}: losses differ by {worst:.3g} relative (> {tolerance:g}):\n" \
                               f"torsh     {ours['losses']}\ndeepspeed {theirs['losses']}"
    print(f"{name}: {len(ours['losses'])} steps, worst relative loss difference {worst:.2e}")
    if name.startswith("hf_causal_lm"):
        assert _relative(ours["checksum"], theirs["checksum"]) <= 1e-2  # the full weights read back agree
        # the save helpers' copies: DeepSpeed's keys, shapes, tensor types and dtypes; the values within 1e-3 of
        # the tensor's size (Adam's step turns a gradient's last-bit differences into whole lr-sized updates)
        assert ours["statuses"] == theirs["statuses"] and ours["numel"] == theirs["numel"]
        for helper in ("copies", "saved"):
            assert ours[helper].keys() == theirs[helper].keys()
            for key, (shape, kind, dtype, total, size) in theirs[helper].items():
                assert ours[helper][key][:3] == [shape, kind, dtype], (helper, key)
                assert abs(ours[helper][key][3] - total) <= max(tolerance, 1e-3) * size, (helper, key)
    if name.startswith("accelerate"):  # get_state_dict, the loss after load_state, engine.compile through Accelerate
        assert (ours["engine"], theirs["engine"]) == ("Engine", "DeepSpeedEngine")  # prepare took DeepSpeed's path
        assert ours["compiled"] == theirs["compiled"] == (name == "accelerate_compile_style")
        assert ours["state"].keys() == theirs["state"].keys() and len(ours["state"]) == 5
        for key, (shape, total) in theirs["state"].items():
            assert ours["state"][key][0] == shape and ours["state"][key][1] == pytest.approx(total, rel=tolerance)
        assert ours["after_load"] == pytest.approx(theirs["after_load"], rel=tolerance)
    if name.startswith("cifar_moe"):  # DeepSpeed's files of the checkpoint: the same names, keys, shapes and values
        assert ours["expert_groups"] == theirs["expert_groups"] == [2, 1]
        assert ours["checkpoint"].keys() == theirs["checkpoint"].keys() and len(theirs["checkpoint"]) == 3
        for file, entries in theirs["checkpoint"].items():
            assert ours["checkpoint"][file].keys() == entries.keys(), file
            for key, value in entries.items():
                if key == "num_experts":
                    assert ours["checkpoint"][file][key] == value == [2]
                    continue
                assert ours["checkpoint"][file][key][0] == value[0], (file, key)
                assert ours["checkpoint"][file][key][1] == pytest.approx(value[1], rel=tolerance, abs=1e-5), (file, key)
    if name.startswith("hf_trainer"):  # the model save_model wrote: the same tensors as DeepSpeed's
        assert ours["saved"].keys() == theirs["saved"].keys()
        for key, (shape, dtype, total) in theirs["saved"].items():
            assert ours["saved"][key][:2] == [shape, dtype] and ours["saved"][key][2] == pytest.approx(
                total, rel=tolerance, abs=1e-5), key


FAKE_LAUNCHER = """
import json, os, sys
out = json.load(open(sys.argv[-1]))[0]["args"][-1]  # the first case's --out
if os.environ.get("WRITE") == "1":
    with open(out, "w") as f:
        json.dump({"losses": [1.0]}, f)
sys.stderr.write("terminate called without an active exception\\n")
sys.stderr.flush()
os.abort()
"""


@pytest.mark.parametrize("written", [True, False])
def test_only_the_reference_run_may_abort_at_exit_and_only_after_its_record(tmp_path, written):
    """The allowance for real DeepSpeed's exit abort: the record counts when written; torsh gets none."""
    fake = tmp_path / "fake_launcher.py"
    fake.write_text(FAKE_LAUNCHER)
    env = {**_env(), "WRITE": "1" if written else "0"}
    launcher = [sys.executable, str(fake)]
    if written:
        assert _launch(launcher, "cifar_style", tmp_path / "ref", env, reference=True) == {"losses": [1.0]}
    else:
        with pytest.raises(pytest.fail.Exception, match="failed"):
            _launch(launcher, "cifar_style", tmp_path / "ref", env, reference=True)
    with pytest.raises(pytest.fail.Exception, match="failed"):
        _launch(launcher, "cifar_style", tmp_path / "ours", env)


FAKE_RUNS = """
import json, os, sys
with open(os.path.join(os.path.dirname(sys.argv[-1]), "launches"), "a") as f:
    f.write("x")
for case in json.load(open(sys.argv[-1])):
    if case["name"] == os.environ["FAIL"]:
        sys.exit(1)
    with open(case["args"][-1], "w") as f:
        json.dump({"losses": [1.0]}, f)
"""


def test_a_case_failing_in_a_shared_launch_fails_alone_and_the_cases_after_it_run_again(tmp_path):
    fake = tmp_path / "fake_launcher.py"
    fake.write_text(FAKE_RUNS)
    names = ["cifar_style", "bert_unused_raw_style", "accelerate_style", "comm_checkpoint_style"]
    env = {**_env(), "FAIL": "bert_unused_raw_style"}
    results = _launch_all([sys.executable, str(fake)], names, tmp_path / "runs", env)
    assert (tmp_path / "runs" / "launches").read_text() == "xx"  # the failed launch, then one for the cases after
    assert {name: results[name] for name in names if name != "bert_unused_raw_style"} == {
        name: {"losses": [1.0]} for name in ("cifar_style", "accelerate_style", "comm_checkpoint_style")}
    assert "failed" in results["bert_unused_raw_style"] and "bert_unused_raw_style" in results["bert_unused_raw_style"]
    # the group's destroyer ends a launch; every other case shares it
    assert _launches(["hf_trainer_style", "cifar_style", "comm_checkpoint_style", "hf_trainer_zero3_style"]) == [
        ["hf_trainer_style", "cifar_style", "hf_trainer_zero3_style", "comm_checkpoint_style"]]
    assert _launches(["comm_checkpoint_style", "cifar_style"]) == [["cifar_style", "comm_checkpoint_style"]]


# ---- Hugging Face scripts with checks of their own (HF_CASES) ------------------------------------------------------


def _both(case: str, torsh_results: dict, request) -> tuple[dict, dict | None]:
    """(torsh's record, DeepSpeed's or None when DeepSpeed is not installed) of an HF_CASES case."""
    _skip_without_needs(case)
    ours = _record(torsh_results, case)
    try:
        theirs = _record(request.getfixturevalue("deepspeed_results"), case)
    except pytest.skip.Exception:  # without DeepSpeed torsh's own checks still run
        theirs = None
    assert ours["deepspeed_version"] == "0.19.8+torsh" and ours["real_deepspeed_modules"] == 0
    if theirs is not None:
        assert theirs["real_deepspeed_modules"] > 0
    return ours, theirs


def _same_losses(case: str, ours: list[float], theirs: list[float]) -> float:
    assert len(ours) == len(theirs) > 0
    worst = max(_relative(a, b) for a, b in zip(ours, theirs))
    assert worst <= TOLERANCE["fp32"], f"{case}: losses differ by {worst:.3g}:\n{ours}\n{theirs}"
    return worst


@pytest.mark.slow
def test_trainer_builds_optimizer_and_scheduler_and_trains_as_under_deepspeed(torsh_results, request):
    ours, theirs = _both("trainer_zero3", torsh_results, request)
    for optim, expected in (("default", "adamw_torch_fused"), ("adamw_torch", "adamw_torch")):
        run = ours["runs"][optim]
        assert run["optim"] == expected and run["fused"] is (expected == "adamw_torch_fused")
        assert run["lrs"][0] == 0.0 and run["lrs"][3] == pytest.approx(5e-3)  # warm-up from 0, then decay
        assert run["moved"] > 1e-3  # trained (the weights stayed bit-identical when the scheduler drove nothing)
        if theirs is None:
            continue
        ref = theirs["runs"][optim]
        worst = _same_losses(f"trainer {optim}", run["losses"], ref["losses"])
        assert run["lrs"] == pytest.approx(ref["lrs"]) and run["moved"] == pytest.approx(ref["moved"], rel=1e-3)
        print(f"trainer_zero3 {optim}: {len(run['losses'])} steps, worst relative loss difference {worst:.2e}, "
              f"weights moved {run['moved']:.3g} (DeepSpeed {ref['moved']:.3g})")
    if theirs is None:
        pytest.skip("DeepSpeed 0.19.8 (requirements-dev.txt) is not installed: not compared")


@pytest.mark.slow
def test_scheduler_built_before_prepare_drives_the_optimizer_that_steps(torsh_results, request):
    ours, theirs = _both("accelerate_scheduler_zero2", torsh_results, request)
    assert ours["reported"][0] == 0.0 and max(ours["reported"]) > 0
    assert ours["held"] == pytest.approx(ours["reported"])  # the lr used at every step is the one reported
    assert ours["moved"] > 1e-3
    if theirs is None:
        pytest.skip("DeepSpeed 0.19.8 (requirements-dev.txt) is not installed: not compared")
    worst = _same_losses("accelerate_scheduler_zero2", ours["losses"], theirs["losses"])
    assert ours["reported"] == pytest.approx(theirs["reported"]) and ours["held"] == pytest.approx(theirs["held"])
    assert ours["moved"] == pytest.approx(theirs["moved"], rel=1e-3)
    print(f"accelerate_scheduler_zero2: {len(ours['losses'])} steps, worst relative loss difference {worst:.2e}, "
          f"weights moved {ours['moved']:.3g} (DeepSpeed {theirs['moved']:.3g})")
