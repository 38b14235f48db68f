"""``torsh-migrate launch "COMMAND" --to LAUNCHER``: translate a launch command line, with a report."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("launch", help="translate a launch command (torchrun, deepspeed, horovodrun, mpirun, "
                            "an sbatch script, a Kubeflow PyTorchJob)",
                            description="Read a torchrun / python -m torch.distributed.run / deepspeed / horovodrun "
                            "/ mpirun / accelerate launch command (or an sbatch script or PyTorchJob manifest file) "
                            "and write the same job for another launcher or scheduler. Quote the command as one "
                            "argument, or put it after --.")  # fmt: skip
    parser.add_argument("command", nargs="+", help="the launch command (one quoted string, or words after --)")
    parser.add_argument("--to", default="torchrun", metavar="LAUNCHER",
                        help="torchrun, deepspeed, horovodrun, mpirun, all (those four), slurm (an sbatch "
                        "script) or kubernetes (a Kubeflow PyTorchJob manifest); default: torchrun")
    parser.add_argument("--hostfile", metavar="FILE", help="hostfile to read the hosts from (DeepSpeed or Horovod "
                        "grammar); default: none is read")  # fmt: skip
    parser.add_argument("--show-env", action="store_true", help="also list the variables every worker gets")
    parser.add_argument("--strict", action="store_true", help="exit 1 if anything is approximated, dropped or "
                        "unsupported")  # fmt: skip
    parser.add_argument("--report", choices=["table", "json"], default="table", help="report format")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from torsh.adapters import launch
    from torsh.cli._common import print_report
    from torsh.errors import ConfigError, Problem, did_you_mean
    from torsh.translate import ErrorLevel

    targets = [t for t in launch.VERSIONS if t not in launch.SCHEDULERS] if args.to == "all" else [args.to]
    if args.to not in (*launch.VERSIONS, "all"):
        raise ConfigError([Problem("--to", args.to, f"expected one of {', '.join(launch.VERSIONS)}, all",
                                   did_you_mean(args.to, launch.VERSIONS))])  # fmt: skip
    hostfile = None
    if args.hostfile:
        from torsh.formats import read_text

        try:
            hostfile = read_text(args.hostfile, what="hostfile")
        except ConfigError as exc:
            raise ConfigError([Problem("--hostfile", args.hostfile, p.reason) for p in exc.problems]) from None
    command = args.command[0] if len(args.command) == 1 else args.command
    if isinstance(command, str) and not any(c.isspace() for c in command) and Path(command).is_file():
        from torsh.formats import read_text

        command = read_text(command, what="launch script")  # an sbatch script (or a one-line shell script)
    read = launch.read(command, hostfile=hostfile)
    written = {t: launch.write(read.result, version=t) for t in targets}
    if args.report == "json":
        json.dump({"read": read.to_dict(), "write": {t: _payload(launch, read.result, w) for t, w in written.items()}},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        # stdout is a shell script (``launch ... > run.sh``): commands, the files they need as here-documents, and
        # comments; the reports go to stderr.
        print_report(read, "table", sys.stderr, title=f"read ({read.result.launch.script})")
        for k, (target, translation) in enumerate(written.items()):
            print(f"{'' if k == 0 else chr(10)}# ---- {target}")
            for name, text in translation.result.files.items():
                print(f"# ---- file {name}:")
                print(_here_document(name, text), end="")
            print(translation.result)
            if args.show_env:
                _print_env(launch, read.result, target)
            print_report(translation, "table", sys.stderr, title=f"write {target}")
    if args.strict:
        read.check(ErrorLevel.RAISE)
        for translation in written.values():
            translation.check(ErrorLevel.RAISE)
    return 0


def _here_document(name: str, text: str) -> str:
    """Shell lines that write ``text`` to the file ``name`` (a quoted here-document: nothing is expanded)."""
    import shlex

    delimiter = "TORSH_EOF"
    while delimiter in text.splitlines():
        delimiter += "_"
    body = text if text.endswith("\n") or not text else text + "\n"
    return f"cat > {shlex.quote(name)} <<'{delimiter}'\n{body}{delimiter}\n"


#: Most workers whose environments are listed (each is a dict of ~10 variables; 2**20 of them would take gigabytes).
MAX_LISTED_WORKERS = 4096


def _too_many_workers(cfg) -> str | None:
    """Why the worker environments are not listed (too many processes), or None."""
    launch = cfg.launch
    sizes = [launch.world_size, sum(h.slots or 1 for h in launch.hosts)]
    if isinstance(launch.nnodes, int) and isinstance(launch.nproc_per_node, int):
        sizes.append(launch.nnodes * launch.nproc_per_node)
    largest = max((n for n in sizes if isinstance(n, int)), default=0)
    if largest > MAX_LISTED_WORKERS:
        return f"{largest} workers: environments are listed for at most {MAX_LISTED_WORKERS}"
    return None


def _payload(launch, cfg, translation) -> dict:
    from torsh.errors import ConfigError

    try:
        env = _too_many_workers(cfg) or launch.worker_environments(cfg, translation.target)
    except ConfigError as exc:
        env = str(exc)
    return {"command": str(translation.result), "argv": [list(c.argv) for c in translation.result.commands],
            "files": dict(translation.result.files), "worker_env": env, "report": translation.to_dict()}


def _print_env(launch, cfg, target: str) -> None:
    from torsh.errors import ConfigError

    too_many = _too_many_workers(cfg)
    if too_many:
        print(f"# worker environment: {too_many}")
        return
    try:
        envs = launch.worker_environments(cfg, target)
    except ConfigError as exc:
        print(f"# worker environment: {exc}")
        return
    for env in envs:
        print("# worker: " + " ".join(f"{k}={v}" for k, v in env.items()))
