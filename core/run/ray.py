"""``torsh run --on ray``: the job ``torsh run`` starts, as a Ray Train ``TorchTrainer`` job.

``torsh run --on ray [torchrun options] train.py [args]`` takes torchrun's options (parsed by torchrun's own
parser): ``--nnodes N --nproc-per-node M`` become ``N*M`` Ray Train workers, one process each, GPUs when the
machine (or cluster) has them; ``--max-restarts`` becomes Ray's ``max_failures``. What the flags leave out
comes from the launch section of ``--ray-config FILE`` (any config torsh reads), else torchrun's defaults. Each
worker installs the ``deepspeed`` alias, as ``torsh run`` does, and runs the unchanged script as ``__main__``.
Ray Train has set up ``torch.distributed`` (gloo on CPU, NCCL on GPU) and the variables torchrun would set
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...), so ``torsh.initialize`` / ``deepspeed.initialize`` inside the
script runs as under torchrun.
Every checkpoint the script saves (``engine.save_checkpoint``) is reported to Ray and persisted under its storage
path (``--ray-storage``, Ray's default otherwise), named by its tag.

The same from Python: :func:`run`. Ray itself is an extra: ``pip install "torsh-distributed[ray]"``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

#: The variables a worker takes from the launching shell (the rest of the environment is the Ray node's own, and
#: the rank variables are Ray Train's).
FORWARDED_PREFIXES = ("TORSH_", "DS_", "NCCL_", "TORCH_", "OMP_", "GLOO_", "HF_", "TRANSFORMERS_", "PYTHON")


class RayRunError(RuntimeError):
    """The Ray job could not start or a worker failed; the message says which and what to do."""


class RayUsageError(RayRunError):
    """The options do not describe a job Ray Train can run (exit code 2)."""


def _ray_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options ``--on ray`` adds, taken out of ``argv`` before torchrun's parser reads the rest."""
    parser = argparse.ArgumentParser(prog="torsh run --on ray", add_help=False)
    parser.add_argument("--ray-address", default=None, help="a running Ray cluster (default: start a local one)")
    parser.add_argument("--ray-storage", default=None, help="where Ray persists checkpoints (a path or URI)")
    parser.add_argument("--ray-name", default=None, help="the run's name under the storage path")
    parser.add_argument("--ray-config", default=None, help="a config (any dialect torsh reads) whose launch section "
                        "gives the processes and restarts the flags leave out")  # fmt: skip
    ours, rest = [], list(argv)
    while rest and rest[0].startswith("--ray-"):  # torsh's options come before torchrun's and the script's
        ours.append(rest.pop(0))
        if "=" not in ours[-1] and rest:
            ours.append(rest.pop(0))
    return parser.parse_args(ours), rest


def _workers(args: argparse.Namespace) -> tuple[int, bool]:
    """The worker count and whether they use GPUs, from torchrun's ``--nnodes`` and ``--nproc-per-node``."""
    nnodes = str(args.nnodes)
    low, _, high = nnodes.partition(":")
    nnodes = low if high in ("", low) else nnodes  # torchrun's default is 1:1
    if not nnodes.isdigit() or int(nnodes) < 1:
        raise RayUsageError(f"--nnodes {nnodes}: torsh run --on ray needs a fixed node count (Ray Train starts "
                          "--nnodes x --nproc-per-node workers)")  # fmt: skip
    nproc = str(args.nproc_per_node)
    import torch

    gpus = torch.cuda.device_count()
    if nproc == "gpu" or (nproc == "auto" and gpus):
        if not gpus:
            raise RayUsageError("--nproc-per-node gpu: this machine has no GPU; give a number of processes")
        return int(nnodes) * gpus, True
    if nproc in ("auto", "cpu"):
        return int(nnodes) * ((os.cpu_count() or 1) if nproc == "cpu" else 1), False
    if not nproc.isdigit() or int(nproc) < 1:
        raise RayUsageError(f"--nproc-per-node {nproc}: expected a number of processes, gpu, cpu or auto")
    return int(nnodes) * int(nproc), gpus > 0


def run(script: str, args: list[str] | tuple[str, ...] = (), *, num_workers: int, module: bool = False,
        use_gpu: bool | None = None, address: str | None = None, storage_path: str | None = None,
        name: str | None = None, max_failures: int = 0, env: dict[str, str] | None = None) -> Any:  # fmt: skip
    """Run ``script`` (or ``-m`` ``module``) with ``args`` on ``num_workers`` Ray Train workers; returns Ray's
    ``Result`` (its ``checkpoint`` is the last one the script saved). ``use_gpu`` None: when CUDA is available.
    ``env``: variables for every worker (default: the launching shell's, see ``FORWARDED_PREFIXES``).
    Raises RayRunError when Ray is missing, cannot start, or a worker fails."""
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError as exc:
        raise RayRunError(f"Ray Train is not installed ({exc.name}): pip install 'torsh-distributed[ray]'") from None
    import torch

    if use_gpu is None:
        use_gpu = torch.cuda.is_available()
    if env is None:
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}
    script_path = script if module else os.path.abspath(script)
    if not module and not os.path.isfile(script_path):
        raise RayUsageError(f"{script}: no such training script")
    config = {"target": script_path, "args": list(args), "module": module, "cwd": os.getcwd(), "env": env}
    started = False
    if not ray.is_initialized():
        options: dict[str, Any] = {"address": address, "include_dashboard": False, "log_to_driver": True}
        if address is None:  # a local cluster: room for every worker, whatever the core count
            options["num_cpus"] = max(os.cpu_count() or 1, num_workers)
        try:
            ray.init(**options)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayRunError(f"Ray did not start{f' at {address}' if address else ''}: {exc}") from None
        started = True
    trainer = TorchTrainer(
        _worker_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker=None if use_gpu else {"CPU": 1}),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures)),
    )  # fmt: skip
    try:
        return trainer.fit()
    except Exception as exc:  # Ray's TrainingFailedError and its worker errors
        raise RayRunError(f"the Ray Train job failed: {exc}") from exc
    finally:
        if started:
            ray.shutdown()


def _worker_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: the variables, the ``deepspeed`` alias, the checkpoint reports, then the script."""
    import runpy

    from torsh.compat import install_deepspeed_alias
    from torsh.engine.checkpoint import save_load as checkpoint

    os.environ.update(config["env"])
    os.chdir(config["cwd"])
    install_deepspeed_alias()
    checkpoint.after_save(_report_checkpoint)
    target, args = config["target"], config["args"]
    sys.argv = [target, *args]
    try:
        if config["module"]:
            sys.path.insert(0, config["cwd"])  # as `python -m`
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(target))  # as `python script.py`
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise RuntimeError(f"{target} exited with {exc.code}") from None
    finally:
        checkpoint.after_save(_report_checkpoint, remove=True)


def _report_checkpoint(directory: str, tag: str) -> None:
    """Every rank: report a complete checkpoint to Ray Train, whose storage then holds it as ``<tag>/``. The first
    process of each node uploads the node's files (Ray merges them); the others report without files."""
    import ray.train

    context = ray.train.get_context()
    files = ray.train.Checkpoint.from_directory(directory) if context.get_local_rank() == 0 else None
    ray.train.report({"tag": tag}, checkpoint=files, checkpoint_dir_name=tag,
                     delete_local_checkpoint_after_upload=False)  # fmt: skip


#: torchrun's options that size the job, with torchrun's defaults: a ``--ray-config`` fills those not given.
_SIZING = {"nnodes": "1:1", "nproc_per_node": "1", "max_restarts": 0}


def parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """torsh's ``--ray-*`` options and torchrun's (parsed by its own parser), the job's size taken from the flags,
    else from the ``--ray-config`` file's launch section, else torchrun's defaults."""
    from torch.distributed import run as torchrun

    ours, rest = _ray_options(argv)
    parser = torchrun.get_args_parser()
    parser.prog = "torsh run --on ray"
    for action in parser._actions:
        if action.dest in _SIZING:
            action.default = None  # to tell a flag given from one left out
    args = parser.parse_args(rest)
    if ours.ray_config is not None:
        _size_from_config(args, ours.ray_config)
    for dest, default in _SIZING.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    return ours, args


def _size_from_config(args: argparse.Namespace, path: str) -> None:
    """The node count, processes per node and restarts of a config's launch section, where no flag gave them."""
    from torsh import adapters
    from torsh.errors import ConfigError

    try:
        launch = adapters.load(path).result.launch
    except ConfigError as exc:
        raise RayUsageError(f"--ray-config {path}: {exc}") from None
    nnodes = launch.nnodes if isinstance(launch.nnodes, int) else 1
    if args.nnodes is None and launch.nnodes is not None:
        args.nnodes = str(launch.nnodes)
    if args.nproc_per_node is None and launch.nproc_per_node is not None:
        args.nproc_per_node = str(launch.nproc_per_node)
    elif args.nproc_per_node is None and isinstance(launch.world_size, int) and launch.world_size % nnodes == 0:
        args.nproc_per_node = str(launch.world_size // nnodes)
    if args.max_restarts is None and isinstance(launch.max_restarts, int):
        args.max_restarts = launch.max_restarts


def main(argv: list[str]) -> int:
    """``torsh run --on ray [--ray-address A] [--ray-storage S] [--ray-name N] [--ray-config F] [torchrun options]
    script [args]``."""
    try:
        ours, args = parse(argv)
        num_workers, use_gpu = _workers(args)
        if args.no_python:
            raise RayUsageError("--no-python: Ray Train workers run Python; give the training script")
        run(args.training_script, args.training_script_args, num_workers=num_workers, module=args.module,
            use_gpu=use_gpu, address=ours.ray_address, storage_path=ours.ray_storage, name=ours.ray_name,
            max_failures=args.max_restarts)  # fmt: skip
    except RayRunError as exc:
        print(f"torsh run --on ray: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, RayUsageError) else 1
    return 0
