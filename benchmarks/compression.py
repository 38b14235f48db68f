"""Step time and bytes per step of each gradient compression method, 2 ranks, gloo, CPU.

A communication-heavy job: an MLP of ``--layers`` square ``--width`` layers (4 x 1024 x 1024 = 4.2M parameters,
16.8 MB of fp32 gradients by default) trained with a batch of ``--batch`` samples per rank, so each step
computes little and reduces a lot. Every method gets its own DDP model (same initial weights, same data),
all built in one run; the methods are timed in interleaved rounds (the order rotates each round) so that
the machine's background load falls on all of them alike, and the table reports medians and the ratio of
each method's median step time to the uncompressed one measured in the same run. ``local`` is the same step
without DDP (no communication): the floor no compression can beat.

    python -m benchmarks.compression                      # loopback between two processes
    python -m benchmarks.compression --slow-link 1gbit    # two network namespaces joined by a veth pair
                                                          # rate-limited with tc (needs root, iproute2)

Prints a markdown table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

METHODS: dict[str, dict] = {
    "none": {},
    "fp16": {"method": "fp16"},
    "bf16": {"method": "bf16"},
    "powersgd-r2": {"method": "powersgd", "rank": 2},
    "topk-1%": {"method": "topk", "ratio": 0.01},
    "quantize-8": {"method": "quantize", "bits": 8},
    "quantize-4": {"method": "quantize", "bits": 4},
}
WORLD = 2
#: Steps every model runs before timing: PowerSGD with memory compresses from the third step on.
WARMUP_STEPS = 3


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=1024, help="features of each square layer")
    p.add_argument("--layers", type=int, default=4, help="number of square layers")
    p.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=4, help="timed steps per method per round")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (medians are over these)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    p.add_argument("--slow-link", metavar="RATE", help="tc rate of an emulated link between the ranks (1gbit, ...)")
    p.add_argument("--json", type=Path, help="where to write the results (default: benchmarks/results/...)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # internal: run one rank
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# one rank


def _worker(rank: int, settings: dict, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from torsh.config import CompressionConfig
    from torsh.engine.compression import apply_compression

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    width, layers, methods = settings["width"], settings["layers"], settings["methods"]

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])

    data = torch.Generator().manual_seed(rank)
    x = torch.randn(settings["batch"], width, generator=data)
    y = torch.randn(settings["batch"], width, generator=data)

    runs = {}
    local = mlp()
    runs["local"] = (local, None, torch.optim.SGD(local.parameters(), lr=1e-3))
    for name in methods:
        ddp = DistributedDataParallel(mlp())
        state = apply_compression(ddp, CompressionConfig(**METHODS[name]))
        runs[name] = (ddp, state, torch.optim.SGD(ddp.parameters(), lr=1e-3))

    def step(model, opt) -> None:
        opt.zero_grad(set_to_none=True)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()

    for model, _, opt in runs.values():
        for _ in range(WARMUP_STEPS):
            step(model, opt)

    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(settings["rounds"]):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            model, _, opt = runs[name]
            dist.barrier()  # both ranks start the block together
            started = time.perf_counter()
            for _ in range(settings["steps"]):
                step(model, opt)
            times[name].append((time.perf_counter() - started) / settings["steps"])

    if rank == 0:
        result = {"step_seconds": times, "bytes": {}}
        for name, (_, state, _) in runs.items():
            if state is not None:
                last = state.stats.last
                result["bytes"][name] = {"dense": last.dense_bytes, "sent": last.sent_bytes,
                                         "compressed": last.compressed}  # fmt: skip
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# launching


def _spawn_loopback(settings: dict, tmp: str) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_spawn_entry, args=(settings, f"{tmp}/store", f"{tmp}/result.json"), nprocs=WORLD)


def _spawn_entry(rank: int, settings: dict, store: str, out: str) -> None:
    _worker(rank, settings, store, out)


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def _slow_link(rate: str) -> Iterator[list[tuple[str, str]]]:
    """Two network namespaces joined by a veth pair, each end shaped to ``rate``; yields (namespace, device)."""
    tag = f"tsc{os.getpid() % 100000}"
    ends = [(f"{tag}n{i}", f"{tag}v{i}", f"10.213.{os.getpid() % 250}.{i + 1}") for i in range(WORLD)]
    try:
        for ns, _, _ in ends:
            _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", ends[0][1], "type", "veth", "peer", "name", ends[1][1]])
        for ns, dev, addr in ends:
            _run(["ip", "link", "set", dev, "netns", ns])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                  "burst", "256kb", "latency", "100ms"])  # fmt: skip
        yield [(ns, dev) for ns, dev, _ in ends]
    finally:
        for ns, _, _ in ends:
            # Deleting a namespace also deletes its end of the veth pair, and with it the other end.
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _launch_namespaced(settings: dict, tmp: str, rate: str) -> None:
    with _slow_link(rate) as ends:
        procs = []
        for rank, (ns, dev) in enumerate(ends):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1"}
            cmd = ["ip", "netns", "exec", ns, sys.executable, str(Path(__file__).resolve()), "--worker", str(rank),
                   "--store", f"{tmp}/store", "--out", f"{tmp}/result.json", "--methods", ",".join(settings["methods"]),
                   "--width", str(settings["width"]), "--layers", str(settings["layers"]),
                   "--batch", str(settings["batch"]), "--steps", str(settings["steps"]),
                   "--rounds", str(settings["rounds"])]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a rank failed (exit codes {codes})")


# --------------------------------------------------------------------------------------------------
# report


def _summarise(raw: dict, settings: dict) -> dict:
    medians = {name: statistics.median(ts) for name, ts in raw["step_seconds"].items()}
    rows = []
    for name, median in medians.items():
        row = {"method": name, "median_step_ms": median * 1e3, "step_time_ratio": median / medians["none"]}
        if name in raw["bytes"]:
            b = raw["bytes"][name]
            row.update(sent_bytes_per_step=b["sent"], dense_bytes_per_step=b["dense"],
                       byte_ratio=b["sent"] / b["dense"])  # fmt: skip
        rows.append(row)
    return {"settings": settings, "rows": rows, "samples_seconds": raw["step_seconds"]}


def _markdown(summary: dict) -> str:
    s = summary["settings"]
    params = s["layers"] * (s["width"] * s["width"] + s["width"])
    link = f"veth pair shaped to {s['slow_link']}" if s["slow_link"] else "loopback"
    lines = [
        (
            f"{params / 1e6:.1f}M parameters, batch {s['batch']} per rank, 2 ranks (gloo, CPU, {link}); "
            f"medians of {s['rounds']} interleaved rounds of {s['steps']} steps"
        ),
        "",
        "| method | median step (ms) | step time / none | MB sent per step | sent / dense |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in summary["rows"]:
        sent = f"{row['sent_bytes_per_step'] / 1e6:.3f}" if "sent_bytes_per_step" in row else "0 (no DDP)"
        ratio = f"{row['byte_ratio']:.4f}" if "byte_ratio" in row else "-"
        lines.append(f"| {row['method']} | {row['median_step_ms']:.1f} | {row['step_time_ratio']:.2f} | {sent} | "
                     f"{ratio} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with the internal ``--worker``, one rank of it)."""
    args = _parse(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or "none" not in methods:
        raise SystemExit(f"--methods must include 'none' and only names from {list(METHODS)} (got {methods})")
    settings = {"width": args.width, "layers": args.layers, "batch": args.batch, "steps": args.steps,
                "rounds": args.rounds, "methods": methods, "slow_link": args.slow_link}  # fmt: skip
    if args.worker is not None:
        _worker(args.worker, settings, args.store, args.out)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        if args.slow_link:
            _launch_namespaced(settings, tmp, args.slow_link)
        else:
            _spawn_loopback(settings, tmp)
        raw = json.loads(Path(tmp, "result.json").read_text())
    summary = _summarise(raw, settings)
    print(_markdown(summary))
    suffix = f"-{args.slow_link}" if args.slow_link else ""
    out = args.json or Path(__file__).resolve().parent / "results" / f"compression{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
