"""Side-by-side parity: the same model, data and config through real DeepSpeed and through torsh, step by step.

A :class:`Scenario` (config + built-in model + deterministic data + steps) runs N ranks wide under an engine.
Runs start from the same seed checkpoint and see the same batches in the same order; per optimizer step they
record loss, global gradient norm, learning rate, loss scale and the skipped flag. :func:`compare` checks a
candidate run against a reference run with per-precision tolerances and names the first divergent step and
metric; :func:`calibrate` derives the low-precision band from DeepSpeed's own spread between two of its ZeRO
stages on the same scenario (DeepSpeed does not match itself across stages exactly, so a fixed epsilon would
be a guess). :func:`check_config` is the whole flow behind ``torsh-migrate parity``.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

METRICS = ("loss", "grad_norm", "lr", "loss_scale")

#: fp32 needs no calibration: the same math in the same order agrees to rounding.
FP32_TOLERANCE = {"loss": 1e-5, "grad_norm": 1e-4, "lr": 1e-9, "loss_scale": 0.0}
#: One unit in the last place of bf16 (8 bits of significand), relative.
BF16_ULP = 2.0**-8
#: The smallest band a calibrated low-precision tolerance may have. DeepSpeed's ZeRO stages 1-3 are often
#: bit-identical to each other in bf16, so their spread can be 0; two implementations that round in different
#: places still drift by a few bf16 ulps over a run (measured: up to 0.36% in the loss after 20 steps).
LOW_PRECISION_FLOOR = {"loss": 2.5 * BF16_ULP, "grad_norm": 4 * BF16_ULP, "lr": 1e-9, "loss_scale": 0.0}
#: Calibrated tolerance = this factor x DeepSpeed's own stage-to-stage spread (at least the floor): a migration
#: may differ from one DeepSpeed code path as much as DeepSpeed's other path does, with half of that as margin.
CALIBRATION_FACTOR = 1.5


class ParityUnavailable(RuntimeError):
    """The reference side cannot run (DeepSpeed is not installed)."""


class ParityRunError(RuntimeError):
    """A parity launch failed; carries the tail of its log."""


@dataclass
class Scenario:
    """One training job to run under an engine."""

    name: str
    config: dict[str, Any]
    """The engine's config (a DeepSpeed dict for the deepspeed engine; any dialect for torsh)."""
    model: str = "tiny-mlp"
    steps: int = 20
    seed: int = 0
    data_seed: int = 1


@dataclass
class Divergence:
    """The first step at which a metric left its tolerance."""

    step: int
    metric: str
    reference: float
    candidate: float
    rel_diff: float


@dataclass
class Comparison:
    """Candidate vs reference, metric by metric."""

    passed: bool
    tolerance: dict[str, float]
    max_rel_diff: dict[str, float]
    first_divergence: Divergence | None = None
    notes: list[str] = field(default_factory=list)


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def rel_diff(a: float, b: float) -> float:
    """|a-b| relative to the larger magnitude; 0 for two NaNs or two equal values."""
    if math.isnan(a) and math.isnan(b):
        return 0.0
    if math.isnan(a) or math.isnan(b):
        return math.inf
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def compare(reference: list[dict], candidate: list[dict], tolerance: Mapping[str, float]) -> Comparison:
    """Compare two runs step by step; the skipped flag must match exactly."""
    notes = []
    if len(reference) != len(candidate):
        notes.append(f"the runs have {len(reference)} and {len(candidate)} steps")
    max_rel = dict.fromkeys(METRICS, 0.0)
    first: Divergence | None = None
    ref_has_norm = any(not math.isnan(r["grad_norm"]) for r in reference)
    if not ref_has_norm:
        notes.append("the reference reports no gradient norm (DeepSpeed stage 0 fp32 returns None); not compared")
    for ref, cand in zip(reference, candidate, strict=False):
        for metric in METRICS:
            if metric == "grad_norm" and not ref_has_norm:
                continue
            diff = rel_diff(float(ref[metric]), float(cand[metric]))
            max_rel[metric] = max(max_rel[metric], diff)
            if diff > tolerance[metric] and first is None:
                first = Divergence(ref["step"], metric, float(ref[metric]), float(cand[metric]), diff)
        if ref["skipped"] != cand["skipped"] and first is None:
            first = Divergence(ref["step"], "skipped", float(ref["skipped"]), float(cand["skipped"]), math.inf)
    passed = first is None and len(reference) == len(candidate)
    return Comparison(passed, dict(tolerance), max_rel, first, notes)


def calibrate(run_a: list[dict], run_b: list[dict]) -> dict[str, float]:
    """A tolerance from DeepSpeed's spread between two of its stages: factor x spread, at least the floor."""
    spread = compare(run_a, run_b, dict.fromkeys(METRICS, math.inf)).max_rel_diff
    return {m: max(LOW_PRECISION_FLOOR[m], CALIBRATION_FACTOR * spread[m]) for m in METRICS}


def precision_of(config: Mapping[str, Any]) -> str:
    """fp32 / bf16 / fp16 of a DeepSpeed-style config."""
    for key in ("bf16", "bfloat16"):
        if isinstance(config.get(key), Mapping) and config[key].get("enabled") is True:
            return "bf16"
    if isinstance(config.get("fp16"), Mapping) and config["fp16"].get("enabled") is True:
        return "fp16"
    return "fp32"


#: The ZeRO stage DeepSpeed is compared with itself at, for calibration. DeepSpeed has two low-precision code
#: paths - stage 0 (FP16/BF16 optimizer wrappers) and ZeRO 1-3 (partitioned fp32 masters) - and stages 1-3 are
#: usually bit-identical to each other, so the spread that says how much DeepSpeed varies with its own
#: implementation is between stage 0 and ZeRO.
CALIBRATION_STAGE = {0: 1, 1: 0, 2: 0, 3: 0}


def calibration_variant(config: Mapping[str, Any]) -> dict[str, Any]:
    """The same DeepSpeed config under DeepSpeed's other low-precision code path, for the calibration run.

    Offload keys are dropped when the variant's stage cannot hold them (parameter offload needs stage 3).
    """
    variant = copy.deepcopy(dict(config))
    zero = variant.get("zero_optimization")
    zero = dict(zero) if isinstance(zero, Mapping) else {}
    zero["stage"] = CALIBRATION_STAGE[int(zero.get("stage", 0))]
    if zero["stage"] != 3:
        zero.pop("offload_param", None)
    if zero["stage"] == 0:
        zero.pop("offload_optimizer", None)
    variant["zero_optimization"] = zero
    return variant


# --------------------------------------------------------------------------------------------------
# running


#: A build of DeepSpeed's C++ ops takes minutes; its lock file older than this was left by an interrupted build.
STALE_LOCK_S = 900


def _check_no_stale_build_lock() -> None:
    """torch's JIT build waits without end (and without a word) on a ``lock`` file an interrupted build left in the
    extensions folder; DeepSpeed builds its CPU ops there on first use. Refuse with the file to delete instead."""
    import time

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    stale = [lock for lock in root.glob("*/*/lock") if time.time() - lock.stat().st_mtime > STALE_LOCK_S]
    if stale:
        raise ParityRunError("DeepSpeed would wait forever: an interrupted build of its C++ ops left "
                             f"{', '.join(map(str, stale))}; delete it and run again (the ops are rebuilt once)")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_seed_checkpoints(scenarios: list[Scenario], seed_dir: Path) -> None:
    """One initial state dict per scenario, shared by every engine that runs it."""
    import torch

    from torsh.models import build_model

    seed_dir.mkdir(parents=True, exist_ok=True)
    for scenario in scenarios:
        path = seed_dir / f"{scenario.name}.pt"
        if not path.exists():
            torch.save(build_model(scenario.model, scenario.seed).state_dict(), path)


def run(scenarios: list[Scenario], engine: str, *, nproc: int = 2, workdir: Path,
        on_progress: Callable[[str, int, int], None] | None = None, timeout: float = 1800) -> dict[str, Any]:  # fmt: skip
    """Run every scenario under ``engine`` in ONE launch of ``nproc`` ranks; returns the worker's results."""
    if engine == "deepspeed" and not deepspeed_available():
        raise ParityUnavailable("DeepSpeed is not installed, so there is no reference to compare against; "
                                "install it with: pip install 'torsh-distributed[parity]'")  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    write_seed_checkpoints(scenarios, workdir / "seeds")
    out = workdir / f"{engine}-results.json"
    spec = workdir / f"{engine}-spec.json"
    spec.write_text(json.dumps({"engine": engine, "seed_dir": str(workdir / "seeds"), "out": str(out),
                                "scenarios": [asdict(s) for s in scenarios]}))  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={_free_port()}", "-m", "torsh.parity.worker", str(spec)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    if engine == "deepspeed":
        _check_no_stale_build_lock()
    log: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          start_new_session=True) as proc:  # fmt: skip
        # The launcher and its ranks are one process group: a run that hangs is killed whole after ``timeout``.
        timed_out = threading.Event()
        watchdog = threading.Timer(timeout, lambda: (timed_out.set(), _kill_group(proc)))
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.append(line)
                if line.startswith("PROGRESS ") and on_progress is not None:
                    _, name, frac = line.split()
                    done, total = frac.split("/")
                    on_progress(name, int(done), int(total))
            code = proc.wait()
        finally:
            watchdog.cancel()
            _kill_group(proc)  # ranks left behind by a failed launcher
    if timed_out.is_set():
        raise ParityRunError(f"the {engine} run did not finish within {timeout:g} s and was stopped; the last lines "
                             "it printed:\n" + "".join(log[-40:]))  # fmt: skip
    results = _written_results(out) if code == 0 or engine == "deepspeed" else None
    if results is None:
        raise ParityRunError(f"the {engine} run failed (exit {code}):\n" + "".join(log[-40:]))
    if code != 0:
        # DeepSpeed 0.19.8's CPU/gloo processes can abort at interpreter exit ("terminate called without an
        # active exception") after the job finished; rank 0 wrote every record before the last barrier. The
        # reference counts; torsh's own runs get no such allowance.
        results["exit"] = f"the launcher exited with {code} after every record was written"
    results["log"] = "".join(log)
    return results


def _written_results(out: Path) -> dict[str, Any] | None:
    """The worker's records when the file was written whole, else None."""
    try:
        results = json.loads(out.read_text())
    except (OSError, ValueError):
        return None
    return results if isinstance(results, dict) and "scenarios" in results else None


# --------------------------------------------------------------------------------------------------
# the whole flow


@dataclass
class ParityReport:
    """Verdict, first divergence, tolerances and both runs' records."""

    scenario: str
    precision: str
    reference: str
    candidate: str
    comparison: Comparison
    reference_records: list[dict]
    candidate_records: list[dict]
    calibration: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        return self.comparison.passed

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = "pass" if self.passed else "fail"
        return data


def deepspeed_config_for(config: Any) -> dict[str, Any]:
    """The DeepSpeed JSON of any config: as is when it is DeepSpeed, else translated by the adapter."""
    from torsh import adapters

    translation = adapters.load(config) if not isinstance(config, dict) else adapters.read(config)
    if translation.source == "deepspeed" and isinstance(config, dict):
        return copy.deepcopy(config)
    if translation.source == "deepspeed":
        from torsh.formats import load_file

        return load_file(config)[0]
    return adapters.write(translation.result, "deepspeed").result


#: What a scenario puts in place of "auto" (the HF Trainer's defaults where it has one): the built-in models are
#: small, so the bucket knobs take DeepSpeed's own defaults rather than HF's hidden-size formulas.
SCENARIO_MICRO_BATCH = 4
SCENARIO_AUTO = {
    "gradient_clipping": 1.0,
    "optimizer.params.lr": 1e-3,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.cycle_min_lr": 1e-4,
    "scheduler.params.cycle_max_lr": 1e-3,
    "zero_optimization.stage": 2,
    "zero_optimization.reduce_bucket_size": 500_000_000,
    "zero_optimization.allgather_bucket_size": 500_000_000,
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_param_persistence_threshold": 100_000,
    "zero_optimization.param_persistence_threshold": 100_000,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    "zero_optimization.gather_16bit_weights_on_model_save": False,
}
#: Keys whose DeepSpeed default is the string "auto" itself: left as they are.
_OWN_AUTO = ("pipeline.stages", "data_types.keep_in_fp32_modules", "zero_optimization.zenflow")


def resolve_auto(config: Mapping[str, Any], *, nproc: int, steps: int) -> tuple[dict[str, Any], list[str]]:
    """A DeepSpeed config with every Hugging Face ``"auto"`` replaced by what the parity scenario implies.

    Real DeepSpeed rejects ``"auto"`` (the HF Trainer or Accelerate fill it in before DeepSpeed sees it); here the
    scenario fills it the same way: the batch from the other batch keys and ``nproc`` (micro batch
    ``SCENARIO_MICRO_BATCH`` when nothing says), precision "auto" as off (fp32: the HF Trainer without --bf16 /
    --fp16), the schedule from ``steps``, the rest from :data:`SCENARIO_AUTO` or DeepSpeed's own default. Returns the
    config and one note per value filled in.
    """
    out = copy.deepcopy(dict(config))
    notes: list[str] = []

    def fill(path: str, value: Any, why: str) -> None:
        node = out
        parts = path.split(".")
        for part in parts[:-1]:
            node = node[part]
        if value is _DELETE:
            del node[parts[-1]]
            notes.append(f"{path}: \"auto\" left to DeepSpeed's default ({why})")
        else:
            node[parts[-1]] = value
            notes.append(f"{path}: \"auto\" -> {value!r} ({why})")

    _resolve_batch(out, nproc, fill)
    for section in ("fp16", "bf16", "bfloat16"):
        if isinstance(out.get(section), Mapping) and _is_auto(out[section].get("enabled")):
            fill(f"{section}.enabled", False, "the HF Trainer's default without --bf16 / --fp16")
    lr = get_nested(out, "optimizer.params.lr")
    lr = SCENARIO_AUTO["optimizer.params.lr"] if _is_auto(lr) or lr is None else lr
    scheduler = {"scheduler.params.warmup_max_lr": (lr, "the optimizer's lr"),
                 "scheduler.params.warmup_num_steps": (max(1, steps // 10), "a tenth of the scenario's steps"),
                 "scheduler.params.total_num_steps": (steps, "the scenario's steps")}  # fmt: skip
    for path, value in _auto_leaves(out):
        if path.startswith(_OWN_AUTO):
            continue
        if path in scheduler:
            fill(path, *scheduler[path])
        elif path in SCENARIO_AUTO:
            fill(path, SCENARIO_AUTO[path], "the scenario's value")
        else:
            fill(path, _DELETE, "no value is known for it")
    return out, notes


_DELETE = object()


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def get_nested(data: Mapping[str, Any], path: str) -> Any:
    """``data[a][b]...`` for a dotted path, None when absent."""
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _auto_leaves(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out += _auto_leaves(value, path)
        elif _is_auto(value):
            out.append((path, value))
    return out


def _resolve_batch(out: dict[str, Any], nproc: int, fill: Callable[..., None]) -> None:
    """train_batch_size = micro x accumulation x ranks, each "auto" filled from the others (DeepSpeed's rule)."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    given = {k: out.get(k) for k in keys}
    auto = [k for k in keys if _is_auto(given[k])]
    if given["train_batch_size"] is None and given["train_micro_batch_size_per_gpu"] is None:
        auto.append("train_micro_batch_size_per_gpu")  # no batch at all: Accelerate fills it as for "auto"
    if not auto:
        return
    known = {k: v for k, v in given.items() if isinstance(v, int) and not isinstance(v, bool)}
    total, micro, accum = (known.get(k) for k in keys)
    if accum is None and total is not None and micro is not None and total % (micro * nproc) == 0:
        accum = total // (micro * nproc)
    accum = accum or 1
    if micro is None and total is not None and total % (accum * nproc) == 0:
        micro = total // (accum * nproc)
    micro = micro or SCENARIO_MICRO_BATCH
    values = {"train_batch_size": micro * accum * nproc, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": accum}  # fmt: skip
    for key in auto:
        fill(key, values[key], f"micro batch {micro} x accumulation {accum} x {nproc} ranks")


def _resolved_candidate(config: Any, reference_ds: dict[str, Any]) -> Any:
    """The torsh side of a config with "auto": the same values the DeepSpeed side was given, in the core model."""
    from torsh import adapters
    from torsh.config import get_path

    translation = adapters.load(config) if not isinstance(config, dict) else adapters.read(config)
    cfg = translation.result
    deferred = cfg.deferred_paths()
    if not deferred:
        return config
    if translation.source == "deepspeed":
        return reference_ds  # the same file, resolved the same way
    resolved = adapters.read(reference_ds, "deepspeed").result
    values = {path: get_path(resolved, path) for path in deferred}
    values = {path: (v if v is not None else get_path(type(cfg)(), path)) for path, v in values.items()}
    return cfg.resolve_deferred(values)


def check_config(config: Any, *, steps: int = 20, nproc: int = 2, model: str = "tiny-mlp",
                 candidate_config: Any = None, reference_engine: str = "deepspeed", workdir: Path | None = None,
                 on_progress: Callable[[str, int, int], None] | None = None) -> ParityReport:  # fmt: skip
    """Run ``config`` under the reference engine and ``candidate_config`` (default: ``config``) under torsh; compare.

    ``reference_engine`` is ``"deepspeed"`` (real DeepSpeed runs ``config``) or ``"torsh"`` (torsh runs both, e.g.
    a DeepSpeed JSON against its FSDP translation). In low precision the band is calibrated from DeepSpeed when it
    is installed, else it is the floor.
    """
    if reference_engine not in ("deepspeed", "torsh"):
        raise ValueError(f"reference_engine must be 'deepspeed' or 'torsh', not {reference_engine!r}")
    ds_config, auto_notes = resolve_auto(deepspeed_config_for(config), nproc=nproc, steps=steps)
    precision = precision_of(ds_config)
    if candidate_config is None:
        candidate_source = _resolved_candidate(config, ds_config)
    else:
        candidate_source = _resolved_candidate(candidate_config, resolve_auto(
            deepspeed_config_for(candidate_config), nproc=nproc, steps=steps)[0])  # fmt: skip
    candidate = Scenario("candidate", _plain_config(candidate_source), model=model, steps=steps)
    torsh_scenarios = [candidate]
    ds_scenarios = []
    if reference_engine == "deepspeed":
        ds_scenarios.append(Scenario("reference", ds_config, model=model, steps=steps))
    else:
        torsh_scenarios.append(Scenario("reference", _plain_config(_resolved_candidate(config, ds_config)),
                                        model=model, steps=steps))  # fmt: skip
    calibrating = precision != "fp32" and (reference_engine == "deepspeed" or deepspeed_available())
    if calibrating:
        if reference_engine == "torsh":
            ds_scenarios.append(Scenario("calibration-base", ds_config, model=model, steps=steps))
        ds_scenarios.append(Scenario("calibration", calibration_variant(ds_config), model=model, steps=steps))
    with tempfile.TemporaryDirectory(prefix="torsh-parity-") as tmp:
        work = workdir or Path(tmp)
        ds = run(ds_scenarios, "deepspeed", nproc=nproc, workdir=work, on_progress=on_progress) if ds_scenarios \
            else None  # fmt: skip
        ts = run(torsh_scenarios, "torsh", nproc=nproc, workdir=work, on_progress=on_progress)
    reference_records = _records(ds if reference_engine == "deepspeed" else ts, "reference", reference_engine)
    candidate_records = _records(ts, "candidate", "torsh")
    calibration = None
    if precision == "fp32":
        tolerance = dict(FP32_TOLERANCE)
    elif calibrating:
        base = "reference" if reference_engine == "deepspeed" else "calibration-base"
        tolerance = calibrate(_records(ds, base, "deepspeed"), _records(ds, "calibration", "deepspeed"))
        calibration = {"against_stage": ds_scenarios[-1].config["zero_optimization"]["stage"],
                       "factor": CALIBRATION_FACTOR, "floor": LOW_PRECISION_FLOOR}  # fmt: skip
    else:
        tolerance = dict(LOW_PRECISION_FLOOR)
        calibration = {"note": "DeepSpeed is not installed: the band is the floor, not calibrated"}
    comparison = compare(reference_records, candidate_records, tolerance)
    comparison.notes[:0] = auto_notes
    if ds is not None and "exit" in ds:
        comparison.notes.append(f"deepspeed: {ds['exit']} (it aborted at exit, after the job; the records are whole)")
    reference_name = "deepspeed 0.19.8" if reference_engine == "deepspeed" else "torsh (reference config)"
    candidate_name = "torsh" if candidate_config is None else "torsh (candidate config)"
    return ParityReport("reference", precision, reference_name, candidate_name, comparison, reference_records,
                        candidate_records, calibration)  # fmt: skip


def _plain_config(config: Any) -> Any:
    """A JSON-able config for the worker: dicts as they are, files parsed, core models dumped."""
    from torsh.config import TorshConfig

    if isinstance(config, TorshConfig):
        return config.model_dump(mode="json")
    if isinstance(config, (str, os.PathLike)):
        from torsh.formats import load_file

        return load_file(config)[0]
    return copy.deepcopy(config)


def _records(results: dict[str, Any], name: str, engine: str) -> list[dict]:
    entry = results["scenarios"].get(name, {})
    if "error" in entry or "records" not in entry:
        raise ParityRunError(f"{engine}: scenario {name} failed: {entry.get('error', 'no records')}")
    return entry["records"]


# --------------------------------------------------------------------------------------------------
# plot


def plot(report: ParityReport, path: str | os.PathLike[str]) -> None:
    """Loss and grad-norm curves of both runs and their relative difference, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref, cand = report.reference_records, report.candidate_records
    steps = [r["step"] for r in ref]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    for ax, metric in zip(axes[:2], ("loss", "grad_norm"), strict=True):
        ax.plot(steps, [r[metric] for r in ref], "o-", label=report.reference, markersize=3)
        ax.plot(steps[: len(cand)], [c[metric] for c in cand], "x--", label=report.candidate, markersize=4)
        ax.set_ylabel(metric.replace("_", " "))
        ax.legend(loc="upper right", fontsize=8)
    for metric, style in (("loss", "o-"), ("grad_norm", "x-")):
        diffs = [max(rel_diff(r[metric], c[metric]), 1e-16) for r, c in zip(ref, cand, strict=False)]
        axes[2].semilogy(steps[: len(diffs)], diffs, style, markersize=3, label=f"{metric} rel. diff")
        axes[2].axhline(max(report.comparison.tolerance[metric], 1e-16), linestyle=":", linewidth=1,
                        color="C0" if metric == "loss" else "C1", label=f"{metric} tolerance")  # fmt: skip
    div = report.comparison.first_divergence
    if div is not None:
        for ax in axes:
            ax.axvline(div.step, color="red", linewidth=1)
    axes[2].set_ylabel("relative difference")
    axes[2].set_xlabel("optimizer step")
    axes[2].legend(loc="upper right", fontsize=8)
    verdict = "PASS" if report.passed else f"FAIL at step {div.step} ({div.metric})" if div else "FAIL"
    fig.suptitle(f"parity {report.precision}: {report.candidate} vs {report.reference} - {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
