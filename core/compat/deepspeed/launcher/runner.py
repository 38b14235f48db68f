"""``deepspeed.launcher.runner``: the module-level constants of DeepSpeed 0.19.8's ``deepspeed`` command, and its argument parser.

Accelerate imports ``DEEPSPEED_ENVIRONMENT_NAME`` from here in ``accelerate launch`` for every DeepSpeed job (for a
multi-node job it appends the processes' environment to that file, which the deepspeed launcher exports on every
node). The values are DeepSpeed's. The ``deepspeed`` command (:func:`main`) reads and checks its arguments as
DeepSpeed does (:func:`parse_args`) but does not start the job: start it with ``torsh run`` (torchrun's options), or
translate the command with ``torsh-migrate launch "deepspeed ..." --to torchrun``.

Its hostfile and ``--include``/``--exclude`` helpers are provided (:func:`fetch_hostfile`,
:func:`parse_resource_filter`, :func:`parse_inclusion_exclusion`), for scripts and launch wrappers that read a
DeepSpeed hostfile themselves: the filters are the ones ``torsh-migrate launch`` applies when it translates a
deepspeed command, so the hosts and slots they give are those the translated torchrun command runs on.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import re
import shlex
import sys

from .constants import PDSH_LAUNCHER, PDSH_MAX_FAN_OUT

__all__ = ["DLTS_HOSTFILE", "EXPORT_ENVS", "DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS",
           "PDSH_MAX_FAN_OUT", "EXCLUDE_ENVS", "fetch_hostfile", "parse_resource_filter",
           "parse_inclusion_exclusion", "parse_args", "main"]  # fmt: skip

DLTS_HOSTFILE = "/job/hostfile"
#: Prefixes of the variables the deepspeed launcher forwards to the other nodes.
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX"]
#: The file of extra variables the deepspeed launcher exports on every node (``DS_ENV_FILE`` overrides the name).
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
#: Where the deepspeed launcher looks for that file: the home directory, then the working directory.
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
#: Variables the deepspeed launcher does not forward when the job name variable is set.
EXCLUDE_ENVS = {"AISC_JOB_NAME": ["NCCL_IB_HCA", "UCX_NET_DEVICES"]}


class _UsageError(Exception):
    """An argument the ``deepspeed`` command's parser refuses (raised instead of exiting, for :func:`main`)."""


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(message)


def parse_args(args=None) -> argparse.Namespace:
    """The ``deepspeed`` command's arguments, with DeepSpeed 0.19.8's options and defaults (the script and its own
    arguments are ``user_script`` and ``user_args``); a bad argument exits with the usage, as argparse does."""
    return _parser(argparse.ArgumentParser).parse_args(args=args)


def _parser(cls: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = cls(description="DeepSpeed's launcher options (under torsh, jobs start with `torsh run`)",
                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("-H", "--hostfile", type=str, default=DLTS_HOSTFILE, help="hostfile: `host slots=N` lines")
    add("-i", "--include", type=str, default="", help="NAME[:SLOT[,SLOT...]][@NAME...]: the resources to use")
    add("-e", "--exclude", type=str, default="", help="the resources not to use (same form as --include)")
    add("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    add("--num_gpus", "--num_accelerators", type=int, default=-1, help="devices 0..N-1 of each node")
    add("--master_port", type=int, default=29500, help="the rendezvous port")
    add("--master_addr", type=str, default="", help="the rendezvous address (the first host's when empty)")
    add("--node_rank", type=int, default=-1, help="this node's rank (with --no_ssh)")
    add("--launcher", type=str, default=PDSH_LAUNCHER, help="the multi-node back-end: pdsh, openmpi, mvapich, "
        "mpich, impi or slurm")
    add("--launcher_args", type=str, default="", help="extra arguments of the back-end's command")
    add("--module", action="store_true", help="run the script as a module (python -m)")
    add("--no_python", action="store_true", help="run the script without python")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank to the script")
    add("--no_ssh", action="store_true", help="start this node only (run the command on each node)")
    add("--no_ssh_check", action="store_true", help="do not check that the other nodes answer ssh")
    add("--force_multi", action="store_true", help="a multi-node launch on a single node")
    add("--save_pid", action="store_true", help="write the launcher's pid to a file")
    add("--enable_each_rank_log", type=str, default="None", help="a directory for one log per rank")
    add("--autotuning", type=str, default="", choices=["tune", "run"], help="DeepSpeed's autotuner")
    add("--bind_cores_to_rank", action="store_true", help="bind each rank to its own CPU cores")
    add("--bind_core_list", type=str, default=None, help="the cores to bind to (e.g. 0-7,16-23)")
    add("--ssh_port", type=int, default=None, help="the ssh port of the other nodes")
    add("--venv_script", type=str, default=None, help="a script each node sources first")
    add("--log_level", type=str, default="info", choices=["debug", "info", "warning", "error", "critical"],
        help="the launcher's log level")
    add("-q", "--quiet", action="store_true", help="--log_level error")
    add("user_script", type=str, help="the training script (or module, or program)")
    add("user_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser


def main(args=None):
    """DeepSpeed's ``deepspeed`` command. Its arguments are read and checked as DeepSpeed checks them first
    (``--num_nodes``/``--num_gpus`` with ``--include``/``--exclude`` is a ValueError); the job itself is not started
    by torsh: start it with ``torsh run`` (torchrun's options), or translate the command with ``torsh-migrate
    launch``."""
    argv = sys.argv[1:] if args is None else list(args)
    try:
        parsed = _parser(_RaisingParser).parse_args(args=argv)
    except _UsageError as exc:
        problem = f" (and its arguments are not the deepspeed command's: {exc})"
    else:
        if (parsed.num_nodes >= 0 or parsed.num_gpus >= 0) and (parsed.include != "" or parsed.exclude != ""):
            raise ValueError("Cannot specify num_nodes/gpus with include/exclude")
        problem = ""
    command = shlex.join(["deepspeed", *argv])
    raise SystemExit(f"the deepspeed launcher is not provided by torsh{problem}: start the job with `torsh run` "
                     "(torchrun's options; every `import deepspeed` in it resolves to torsh), or translate the "
                     f"command with `torsh-migrate launch {shlex.quote(command)} --to torchrun`")


log = logging.getLogger("torsh.compat")
_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")


def fetch_hostfile(hostfile_path):
    """The hosts of a DeepSpeed hostfile and their slot counts (in file order); None when there is no such file
    (DeepSpeed then runs on the local machine)."""
    if not os.path.isfile(hostfile_path):
        log.warning("Unable to find hostfile, will proceed with training with local resources only.")
        return None
    with open(hostfile_path) as handle:
        return _parse_hostfile(handle.readlines())


def _parse_hostfile(hostfile_lines):
    """``host slots=N`` lines (blank lines and ``#`` comments skipped) as host -> N, in order. As DeepSpeed, any
    other line, a host listed twice and a file without hosts are a ValueError."""
    pool: collections.OrderedDict[str, int] = collections.OrderedDict()
    for line in hostfile_lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOSTFILE_LINE.search(line)
        if not match:
            raise ValueError(f"Hostfile contains a bad entry: {line}, unable to proceed with launching")
        host = match.group(1)
        if host in pool:
            raise ValueError(f"Hostfile contains multiple entries for {host}, unable to proceed with launching")
        pool[host] = int(match.group(2))
    if not pool:
        raise ValueError("Hostfile is empty or not formatted correctly, unable to proceed with launching.")
    return pool


def parse_resource_filter(host_info, include_str="", exclude_str=""):
    """``host_info`` (host -> its slots ``[0, ..., n-1]``) filtered by a deepspeed ``--include`` or
    ``--exclude`` string (``NAME[:SLOT[,SLOT...]][@NAME...]``), in host order, hosts left without slots dropped.
    Both strings given, an unknown host or slot, or a malformed string is a ValueError, as in DeepSpeed. The
    filter is torsh's launch translation's (:func:`torsh.adapters._hostfile.resolve_nodes`)."""
    if include_str and exclude_str:
        raise ValueError("include_str and exclude_str are mutually exclusive.")
    if not include_str and not exclude_str:
        return host_info
    from torsh.adapters._hostfile import resolve_nodes

    nodes = resolve_nodes([(host, len(slots)) for host, slots in host_info.items()], include=include_str or None,
                          exclude=exclude_str or None)  # fmt: skip
    return collections.OrderedDict(
        (node.host, list(node.devices) if node.devices is not None else list(range(node.nproc))) for node in nodes)


def parse_inclusion_exclusion(resource_pool, inclusion, exclusion):
    """:func:`parse_resource_filter` over a hostfile's pool (host -> slot count), as the deepspeed launcher does."""
    slots = collections.OrderedDict((host, list(range(count))) for host, count in resource_pool.items())
    return parse_resource_filter(slots, include_str=inclusion, exclude_str=exclusion)
