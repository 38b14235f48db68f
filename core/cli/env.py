"""``torsh-migrate env``: what a bug report needs: versions, PyTorch's backends and devices, the launcher
variables set (as ``ds_report`` and ``accelerate env`` do for their users).

Versions come from the installed distributions' metadata, so nothing is imported to print them; torch is
imported only here, and only for what needs it (CUDA, NCCL, gloo, MPI, devices).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

#: Distributions whose versions are reported, as (label, distribution name).
PACKAGES = [("torch", "torch"), ("deepspeed", "deepspeed"), ("accelerate", "accelerate"),
            ("fairscale", "fairscale"), ("horovod", "horovod"), ("safetensors", "safetensors"), ("numpy", "numpy"),
            ("pydantic", "pydantic")]  # fmt: skip
#: Launcher variables reported when set: exact names, then prefixes.
LAUNCHER_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "CROSS_RANK",
                  "CROSS_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                  "PMI_RANK", "PMI_SIZE")  # fmt: skip
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "HOROVOD_", "OMPI_", "PMIX_", "MV2_", "SLURM_", "NCCL_", "GLOO_", "TORSH_")
#: Launcher programs looked up on PATH.
LAUNCHERS = ("torchrun", "deepspeed", "accelerate", "horovodrun", "mpirun", "srun")
NOT_INSTALLED = "not installed"


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("env", help="report versions, PyTorch backends, devices and launcher variables",
                            description="Report what a bug report needs: torsh and framework versions, PyTorch's "
                            "CUDA/NCCL/gloo/MPI support and devices, launchers on PATH and the launcher "
                            "environment variables set.")  # fmt: skip
    parser.add_argument("--report", choices=["table", "json"], default="table",
                        help="output format (default: table; json is one document)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.report == "json":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(report))
    return 0


def collect(environ: Any = None) -> dict[str, Any]:
    """The whole report as JSON-ready data; a missing package's version is None."""
    import platform

    from torsh import __version__

    environ = os.environ if environ is None else environ
    versions = {"torsh": __version__, **{label: _version(dist) for label, dist in PACKAGES}}
    return {
        "versions": versions,
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},  # fmt: skip
        "platform": platform.platform(),
        "torch": _torch_report() if versions["torch"] else None,
        "launchers_on_path": {name: _which(name) for name in LAUNCHERS},
        "environment": launcher_environment(environ),
    }


def _version(dist: str) -> str | None:
    from importlib import metadata  # here, not at import: every torsh-migrate start imports this module

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _which(program: str) -> str | None:
    """``program`` on PATH, else next to this interpreter (a virtualenv's scripts when it is not activated)."""
    import shutil

    return shutil.which(program) or shutil.which(program, path=os.path.dirname(sys.executable))


def launcher_environment(environ: Any) -> dict[str, str]:
    """The launcher and rendezvous variables set in ``environ``, sorted by name."""
    return {name: environ[name] for name in sorted(environ)
            if name in LAUNCHER_NAMES or name.startswith(LAUNCHER_PREFIXES)}  # fmt: skip


def _torch_report() -> dict[str, Any]:
    """PyTorch's build and backends, and the devices it sees (imports torch)."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # noqa: BLE001 - a broken install is reported, not raised
        return {"error": f"import torch failed: {type(exc).__name__}: {exc}"}
    report: dict[str, Any] = {"cuda_built": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    distributed = dist.is_available()
    report["distributed_available"] = distributed
    for backend in ("nccl", "gloo", "mpi", "ucc"):
        check = getattr(dist, f"is_{backend}_available", None)
        report[f"{backend}_available"] = bool(distributed and check is not None and check())
    report["nccl_version"] = _nccl_version(torch) if report["nccl_available"] else None
    report["devices"] = _devices(torch)
    return report


def _nccl_version(torch: Any) -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a build without NCCL, or no driver
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _devices(torch: Any) -> list[dict[str, Any]]:
    """CPU first, then every CUDA (and MPS/XPU) device torch sees."""
    import platform

    devices: list[dict[str, Any]] = [{"type": "cpu", "name": platform.processor() or platform.machine(),
                                      "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}]  # fmt: skip
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append({"type": "cuda", "index": index, "name": props.name,
                            "memory_gib": round(props.total_memory / 2**30, 1),
                            "capability": f"{props.major}.{props.minor}"})  # fmt: skip
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append({"type": "mps", "name": "Apple Metal"})
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        devices.extend({"type": "xpu", "index": i, "name": xpu.get_device_name(i)} for i in range(xpu.device_count()))
    return devices


def render(report: dict[str, Any]) -> str:
    """The report as aligned plain text (for pasting into an issue)."""
    lines = ["Versions"]
    rows = [(name, version or NOT_INSTALLED) for name, version in report["versions"].items()]
    py = report["python"]
    rows += [("python", f"{py['version']} ({py['implementation']}, {py['executable']})"),
             ("platform", report["platform"])]  # fmt: skip
    lines += _rows(rows)
    lines.append("PyTorch")
    torch = report["torch"]
    if torch is None:
        lines += _rows([("torch", f"{NOT_INSTALLED}: pip install 'torsh-distributed[engine]'")])
    elif "error" in torch:
        lines += _rows([("torch", torch["error"])])
    else:
        cuda = "yes" if torch["cuda_available"] else "no"
        built = f"built with CUDA {torch['cuda_built']}" if torch["cuda_built"] else "CPU-only build"
        nccl = _yes_no(torch["nccl_available"]) + (f" (NCCL {torch['nccl_version']})" if torch["nccl_version"] else "")
        lines += _rows([("CUDA available", f"{cuda} ({built})"),
                        ("torch.distributed", _yes_no(torch["distributed_available"])), ("NCCL", nccl),
                        ("gloo", _yes_no(torch["gloo_available"])), ("MPI", _yes_no(torch["mpi_available"])),
                        ("UCC", _yes_no(torch["ucc_available"]))])  # fmt: skip
        lines.append("Devices")
        lines += _rows([(_device_label(d), _device_text(d)) for d in torch["devices"]])
    lines.append("Launchers on PATH")
    lines += _rows([(name, path or "-") for name, path in report["launchers_on_path"].items()])
    lines.append("Launcher environment")
    env = report["environment"]
    lines += _rows(list(env.items())) if env else ["  (none of RANK, WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_*, "
                                                     "HOROVOD_*, OMPI_*, SLURM_*, ... is set)"]  # fmt: skip
    return "\n".join(lines) + "\n"


def _rows(rows: list[tuple[str, str]]) -> list[str]:
    width = max((len(k) for k, _ in rows), default=0)
    return [f"  {k.ljust(width)}  {v}" for k, v in rows]


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _device_label(device: dict[str, Any]) -> str:
    return device["type"] + (f":{device['index']}" if "index" in device else "")


def _device_text(device: dict[str, Any]) -> str:
    if device["type"] == "cpu":
        return f"{device['name'] or 'cpu'}, {device['cores']} cores, torch uses {device['torch_threads']} threads"
    extra = [f"{device['memory_gib']} GiB"] if "memory_gib" in device else []
    extra += [f"compute capability {device['capability']}"] if "capability" in device else []
    return ", ".join([device["name"], *extra])

