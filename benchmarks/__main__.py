"""``python -m benchmarks``: torsh against hand-written PyTorch and DeepSpeed, interleaved, with ratios.

Every implementation of a case runs in its own 2-rank launch (so peak RSS and set-up time belong to it alone);
the launches are interleaved (native, torsh, deepspeed, native, ...) and repeated. The step-time ratio
torsh/native, which is held to 2%, is also measured in one launch running both jobs with alternating steps
(see ``benchmarks.worker``): separate launches on a shared machine differ by more than that. Medians and
min-max are reported with the ratios and whether each target holds. Writes ``benchmarks/results/latest.json``
and ``latest.md``, which the documentation's results page (docs/benchmarks.md) includes when the site is built.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The shapes of ``benchmarks.cases`` (named here so that this driver does not import torch).
SHAPE_NAMES = ("compute", "comm", "transformer")
IMPL_NAMES = ("native", "torsh", "deepspeed", "torsh-per-layer")
RESULTS = ROOT / "benchmarks" / "results"
#: The documentation page of the results: it includes ``latest.md`` when the site is built, so no table is copied.
RESULTS_PAGE = ROOT / "docs" / "benchmarks.md"
TARGETS = {
    "step torsh/native": 1.02,
    "step torsh/deepspeed": 0.9,
    "peak memory torsh/deepspeed": 1.0,
    "peak memory torsh/native": 1.03,
    "initialize torsh - native (s)": 0.3,
    "convert cold start (s)": 0.3,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cuda: bool = False) -> dict[str, str]:
    """The environment of every measured process: DeepSpeed on the CPU unless there is a GPU, and bytecode
    caches used as for an installed package (torch's and DeepSpeed's were compiled at install time; with
    PYTHONDONTWRITEBYTECODE set, only torsh would be compiled from source in every process, inside the measured
    time)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["DS_ACCELERATOR"] = "cuda" if cuda else "cpu"
    return env


def cuda_available() -> bool:
    """Whether the launches will run on CUDA/NCCL (the workers choose the device the same way)."""
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                          capture_output=True, text=True)  # fmt: skip
    return done.stdout.strip() == "True"


def flops_per_step(params: int, tokens: int) -> float:
    """Training FLOPs of one step: the usual dense estimate 6 x parameters x tokens (2 for the forward
    multiply-adds, 4 for the backward), attention's own FLOPs and activation recomputation left out."""
    return 6.0 * params * tokens


def throughput(result: dict, peak_tflops: float | None) -> dict[str, float]:
    """Tokens per second over all ranks and, given each device's peak (TFLOP/s), the model FLOPs utilisation
    (MFU): FLOPs per step / step time / (peak x ranks). Empty for a result without a token count."""
    if "tokens_per_step" not in result or "params" not in result:
        return {}
    out = {"tokens_per_s": result["tokens_per_step"] / result["step_s"]}
    if peak_tflops:
        achieved = flops_per_step(result["params"], result["tokens_per_step"]) / result["step_s"]
        out["mfu"] = achieved / (peak_tflops * 1e12 * result.get("world_size", 1))
    return out


def peak_memory_mib(result: dict) -> float:
    """The memory measure of a launch: CUDA's maximum allocated on a GPU (RSS counts host memory only), else
    the peak RSS."""
    return result.get("cuda_max_allocated_mib", result["peak_rss_mib"])


def compile_sources() -> None:
    """Write the bytecode caches of this checkout's packages once, before anything is measured."""
    import compileall

    for folder in ("core", "adapters", "schemas", "benchmarks"):
        compileall.compile_dir(ROOT / folder, quiet=2)


def run_case(impls: list[str], stage: str, precision: str, shape: str, steps: int, warmup: int,
             nproc: int, cuda: bool = False, torsh_units: str = "engine") -> dict:  # fmt: skip
    """One launch of ``impls`` (one implementation, or several with alternating steps) on ``nproc`` ranks."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    spec = {"impls": impls, "stage": stage, "precision": precision, "shape": shape, "steps": steps,
            "warmup": warmup, "out": out, "torsh_units": torsh_units}  # fmt: skip
    env = {**_env(cuda), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={_free_port()}", "-m", "benchmarks.worker", json.dumps(spec)]  # fmt: skip
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        # A rank that never joins (its port taken between _free_port and the launch) hangs the launch:
        # the case is recorded as failed and the run goes on.
        return {**_recorded(spec), "error": f"timed out after {exc.timeout} s"}
    if done.returncode != 0:
        return {**_recorded(spec), "error": (done.stdout + done.stderr)[-2000:]}
    result = _recorded(json.loads(Path(out).read_text()))
    Path(out).unlink(missing_ok=True)
    return result


def _recorded(spec: dict) -> dict:
    """What the results keep of a case: not the temporary file the worker wrote to (a path of this machine)."""
    return {k: v for k, v in spec.items() if k != "out"}


def _last_error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if "Error" in line or "error" in line]
    return (lines or text.splitlines() or ["failed"])[-1].strip()[:200]


def cold_start(repeats: int) -> dict[str, list[float]]:
    """Wall time of ``torsh-migrate convert`` against ``import deepspeed`` and ``import torch``, interleaved."""
    example = ROOT / "migration_examples" / "torsh" / "torsh_config.toml"
    commands = {
        "torsh-migrate convert": [sys.executable, "-m", "torsh.cli", "convert", str(example), "--to", "torsh"],
        "import torch": [sys.executable, "-c", "import torch"],
    }
    if importlib.util.find_spec("deepspeed"):
        commands["import deepspeed"] = [sys.executable, "-c", "import deepspeed"]
    times: dict[str, list[float]] = {name: [] for name in commands}
    env = _env()
    for command in commands.values():  # discarded: writes bytecode caches and warms the page cache
        subprocess.run(command, capture_output=True, env=env, check=True)
    for _ in range(repeats):
        for name, command in commands.items():
            started = time.perf_counter()
            subprocess.run(command, capture_output=True, env=env, check=True)
            times[name].append(time.perf_counter() - started)
    return times


def _machine() -> str:
    """CPU model, cores, memory, Python, torch and DeepSpeed versions (what the ratios were measured on)."""
    cpu = platform.processor() or platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        memory = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                          if line.startswith("MemTotal"))) / 2**20  # fmt: skip
        cpu = f"{cpu} ({os.cpu_count()} CPUs), {memory:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        cpu = f"{cpu} ({os.cpu_count()} CPUs)"
    versions = []
    for name in ("torch", "deepspeed"):
        try:
            from importlib.metadata import version

            versions.append(f"{name} {version(name)}")
        except Exception:  # noqa: BLE001 (not installed: leave it out)
            pass
    return ", ".join([cpu, f"Python {platform.python_version()}", *versions])


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _paired_ratio(torsh: dict, native: dict) -> float:
    """torsh/native from one launch: the median over rounds of the ratio of the two steps run back to back in
    each round (a disturbance lasting a few steps moves both), or of the step medians without per-step times."""
    if torsh.get("step_times") and native.get("step_times"):
        return statistics.median(t / n for t, n in zip(torsh["step_times"], native["step_times"]))
    return torsh["step_s"] / native["step_s"]


def aggregate(results: list[dict], peak_tflops: float | None = None) -> dict:
    """Per case (shape, stage, precision): every implementation's medians and min-max, the ratios, tokens/s and
    MFU (with ``peak_tflops``); the memory ratios compare :func:`peak_memory_mib`."""
    grouped: dict[tuple, dict[str, dict[str, list[float]]]] = {}
    paired: dict[tuple, list[float]] = {}
    for r in results:
        if "error" in r:
            continue
        key = (r["shape"], r["stage"], r["precision"])
        if "paired" in r:
            both = r["paired"]
            paired.setdefault(key, []).append(_paired_ratio(both["torsh"], both["native"]))
            for impl, measured in both.items():
                grouped.setdefault(key, {}).setdefault(f"{impl} (paired)", {}).setdefault("step_s", []).append(
                    measured["step_s"])
            continue
        measured = {"step_s": r["step_s"], "init_s": r["init_s"], "peak_rss_mib": r["peak_rss_mib"],
                    "peak_mib": peak_memory_mib(r), **throughput(r, peak_tflops)}  # fmt: skip
        if "cuda_max_allocated_mib" in r:
            measured["cuda_max_allocated_mib"] = r["cuda_max_allocated_mib"]
        for metric, value in measured.items():
            grouped.setdefault(key, {}).setdefault(r["impl"], {}).setdefault(metric, []).append(value)
    rows = []
    for key, impls in sorted(grouped.items()):
        shape, stage, precision = key
        row: dict = {"shape": shape, "stage": stage, "precision": precision}
        for impl, metrics in impls.items():
            for metric, values in metrics.items():
                row[f"{impl}.{metric}"] = _summary(values)
        med = {k: v["median"] for k, v in row.items() if isinstance(v, dict)}
        if key in paired:  # alternating steps in one launch: the ratio is taken launch by launch
            row["step torsh/native"] = statistics.median(paired[key])
        elif "torsh.step_s" in med and "native.step_s" in med:
            row["step torsh/native"] = med["torsh.step_s"] / med["native.step_s"]
        row["memory"] = "CUDA max allocated" if any(k.endswith(".cuda_max_allocated_mib") for k in med) else "RSS"
        if "torsh.peak_mib" in med and "native.peak_mib" in med:
            row["peak memory torsh/native"] = med["torsh.peak_mib"] / med["native.peak_mib"]
            row["initialize torsh - native (s)"] = med["torsh.init_s"] - med["native.init_s"]
        for torsh in ("torsh", "torsh-per-layer"):  # the engine's units, and one unit per block (memory first)
            if f"{torsh}.step_s" in med and "deepspeed.step_s" in med:
                row[f"step {torsh}/deepspeed"] = med[f"{torsh}.step_s"] / med["deepspeed.step_s"]
                row[f"peak memory {torsh}/deepspeed"] = med[f"{torsh}.peak_mib"] / med["deepspeed.peak_mib"]
        rows.append(row)
    return {"rows": rows}


def markdown(report: dict) -> str:
    cuda = any(row.get("memory") == "CUDA max allocated" for row in report["rows"])
    ranks = f"{report.get('nproc', 2)} ranks, {'nccl' if cuda else 'gloo'}"
    memory = "peak CUDA memory" if cuda else "peak RSS"
    peak = report.get("peak_tflops")
    lines = [f"Measured {report['date']} on {report['machine']} with `{report['command']}` "
             f"({report['repeats']} interleaved repeats, {report['steps']} timed steps each, {ranks}). "
             "Step times in ms, median (min–max) over the repeats; native and torsh side by side are the "
             "launch running both with alternating steps, torsh and DeepSpeed each their own launch. "
             "Tokens/s over all ranks (a row of an MLP's batch counts as a token); MFU = 6 x parameters x tokens "
             + (f"per step / step time / ({peak:g} TFLOP/s x ranks)." if peak else "per step / step time / peak "
                "(not computed: no --peak-tflops)."), "",
             "| shape | stage | precision | step native / torsh, one launch | torsh/native "
             f"| step torsh / DeepSpeed, own launches | torsh/DeepSpeed | {memory} torsh/DeepSpeed "
             f"| {memory} torsh/native | init torsh − native (s) | tokens/s torsh | MFU torsh |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def ms(row, impl):
        cell = row.get(f"{impl}.step_s")
        if not cell:
            return "–"
        spread = f" ({cell['min'] * 1e3:.1f}–{cell['max'] * 1e3:.1f})" if cell["n"] > 1 else ""
        return f"{cell['median'] * 1e3:.1f}{spread}"

    def ratio(row, key, fmt="{:.2f}"):
        return fmt.format(row[key]) if key in row else "–"

    def median(row, key, fmt):
        return fmt.format(row[key]["median"]) if key in row else "–"

    for row in report["rows"]:
        lines.append(f"| {row['shape']} | {row['stage']} | {row['precision']} | {ms(row, 'native (paired)')} / "
                     f"{ms(row, 'torsh (paired)')} | {ratio(row, 'step torsh/native')} | {ms(row, 'torsh')} / "
                     f"{ms(row, 'deepspeed')} | {ratio(row, 'step torsh/deepspeed')} | "
                     f"{ratio(row, 'peak memory torsh/deepspeed')} | {ratio(row, 'peak memory torsh/native')} | "
                     f"{ratio(row, 'initialize torsh - native (s)', '{:+.2f}')} | "
                     f"{median(row, 'torsh.tokens_per_s', '{:.0f}')} | {median(row, 'torsh.mfu', '{:.1%}')} |")
    per_layer = [row for row in report["rows"] if "torsh-per-layer.step_s" in row]
    if per_layer:
        lines += ["", f"| shape | stage | precision | step torsh per layer / DeepSpeed | torsh per layer/DeepSpeed "
                  f"| {memory} torsh per layer/DeepSpeed |", "|---|---|---|---|---|---|"]  # fmt: skip
        for row in per_layer:
            lines.append(f"| {row['shape']} | {row['stage']} | {row['precision']} | {ms(row, 'torsh-per-layer')} / "
                         f"{ms(row, 'deepspeed')} | {ratio(row, 'step torsh-per-layer/deepspeed')} | "
                         f"{ratio(row, 'peak memory torsh-per-layer/deepspeed')} |")  # fmt: skip
    cold = report.get("cold_start", {})
    if cold:
        lines += ["", "| cold start | median (s) | min–max (s) |", "|---|---|---|"]
        for name, s in cold.items():
            lines.append(f"| `{name}` | {s['median']:.3f} | {s['min']:.3f}–{s['max']:.3f} |")
    lines += ["", "Targets:"] + [f"- {line}" for line in report["targets"]]
    return "\n".join(lines) + "\n"


def check_targets(report: dict) -> list[str]:
    out = []
    for key, limit in TARGETS.items():
        if key == "convert cold start (s)":
            values = [report["cold_start"]["torsh-migrate convert"]["median"]] if report.get("cold_start") else []
        else:
            values = [row[key] for row in report["rows"] if key in row]
        if not values:
            out.append(f"{key} ≤ {limit}: not measured")
            continue
        worst = max(values)
        out.append(f"{key} ≤ {limit}: {'holds' if worst <= limit else 'MISSED'} (worst {worst:.3f})")
    return out


def check_results_page(page: Path = RESULTS_PAGE) -> str:
    """Where the new table shows: the results page includes ``latest.md``; an error if it no longer does."""
    latest = (RESULTS / "latest.md").relative_to(ROOT).as_posix()
    include = f'--8<-- "{latest}"'
    if not page.is_file() or include not in page.read_text():
        raise SystemExit(f"error: {page} does not include the results ({include}): add that line to the page")
    return f"{page.relative_to(ROOT).as_posix()} includes {latest}: `make docs` shows this run"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--impls", default=",".join(IMPL_NAMES),
                        help="of native, torsh, deepspeed and torsh-per-layer (torsh with one FSDP2 unit per block, "
                             "the memory-first setting, in a table of its own)")  # fmt: skip
    parser.add_argument("--stages", default="0,1,2,3,3+offload")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--shapes", default="compute,comm,transformer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="1 repeat, stages 0 and 3, fp32, the comm shape (unless --shapes is given)")
    parser.add_argument("--torsh-units", choices=["per_layer", "engine"], default="engine",
                        help="torsh's FSDP2 units and DDP buckets: the engine's own choice from the DeepSpeed config, "
                             "which the hand-written job copies (default), or one unit per block and DDP's default "
                             "buckets in the hand-written job")  # fmt: skip
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="one device's peak TFLOP/s in the measured precision (e.g. 989 for an H100 SXM in "
                             "bf16): the table then gives MFU")  # fmt: skip
    parser.add_argument("--update-readme", action="store_true",
                        help="check that the documentation's results page includes latest.md (the README no longer "
                             "holds the table)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        shapes_given = any(a == "--shapes" or a.startswith("--shapes=") for a in (argv or sys.argv[1:]))
        args.repeats, args.stages, args.precisions = 1, "0,3", "fp32"
        args.shapes = args.shapes if shapes_given else "comm"
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        parser.error(f"--peak-tflops must be a positive number of TFLOP/s, not {args.peak_tflops}")
    unknown = sorted(set(args.shapes.split(",")) - set(SHAPE_NAMES))
    if unknown:
        parser.error(f"--shapes: unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPE_NAMES)}")
    bad_impls = sorted(set(args.impls.split(",")) - set(IMPL_NAMES))
    if bad_impls:
        parser.error(f"--impls: unknown implementation(s) {', '.join(bad_impls)}; choose from {', '.join(IMPL_NAMES)}")
    cuda = cuda_available()
    impls = args.impls.split(",")
    if "deepspeed" in impls and not importlib.util.find_spec("deepspeed"):
        print("DeepSpeed is not installed: skipping it (pip install 'torsh-distributed[parity]')")
        impls.remove("deepspeed")
    compile_sources()
    cases = list(itertools.product(args.shapes.split(","), args.stages.split(","), args.precisions.split(",")))
    results = []
    for repeat in range(args.repeats):
        for shape, stage, precision in cases:
            # interleaved (A B C A B C ...), the order rotated each repeat so that no implementation always
            # runs right after the same one (page cache, CPU frequency, other load)
            launches = [[impl] for impl in impls[repeat % len(impls):] + impls[:repeat % len(impls)]]
            if "native" in impls and "torsh" in impls:
                launches.append(["native", "torsh"])
            for launch in launches:
                r = run_case(launch, stage, precision, shape, args.steps, args.warmup, args.nproc, cuda,
                             args.torsh_units)  # fmt: skip
                if "error" in r:
                    status = _last_error_line(r["error"])
                elif "paired" in r:
                    status = " / ".join(f"{v['step_s'] * 1e3:.1f}" for v in r["paired"].values()) + " ms"
                else:
                    status = f"{r['step_s'] * 1e3:.1f} ms"
                print(f"[{repeat + 1}/{args.repeats}] {shape:<7} stage {stage:<9} {precision} "
                      f"{'+'.join(launch):<12} {status}", flush=True)  # fmt: skip
                results.append(r)
    report = aggregate(results, args.peak_tflops)
    report["cold_start"] = {k: _summary(v) for k, v in cold_start(max(3, args.repeats * 2)).items()}
    report.update({
        "date": time.strftime("%Y-%m-%d"), "repeats": args.repeats, "steps": args.steps, "nproc": args.nproc,
        "peak_tflops": args.peak_tflops,
        "machine": _machine(),
        "command": " ".join(["python -m benchmarks", *(sys.argv[1:] if argv is None else argv)]),
        "errors": [r for r in results if "error" in r],
    })  # fmt: skip
    report["targets"] = check_targets(report)
    table = markdown(report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps({**report, "raw": results}, indent=1))
    (RESULTS / "latest.md").write_text(table)
    print(table)
    if args.update_readme:
        print(check_results_page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
