"""``deepspeed.launcher.runner``: the module-level constants of DeepSpeed 0.19.8's ``deepspeed`` command.

Accelerate imports ``DEEPSPEED_ENVIRONMENT_NAME`` from here in ``accelerate launch`` for every DeepSpeed job (for a
multi-node job it appends the processes' environment to that file, which the deepspeed launcher exports on every
node). The values are DeepSpeed's. The ``deepspeed`` command (:func:`main`) is not provided: start the job with
``torsh run`` (torchrun's options), or translate the command with ``torsh-migrate launch "deepspeed ..." --to
torchrun``.

Its hostfile and ``--include``/``--exclude`` helpers are provided (:func:`fetch_hostfile`,
:func:`parse_resource_filter`, :func:`parse_inclusion_exclusion`), for scripts and launch wrappers that read a
DeepSpeed hostfile themselves: the filters are the ones ``torsh-migrate launch`` applies when it translates a
deepspeed command, so the hosts and slots they give are those the translated torchrun command runs on.
"""

from __future__ import annotations

import collections
import logging
import os
import re

from .constants import PDSH_MAX_FAN_OUT

__all__ = ["DLTS_HOSTFILE", "EXPORT_ENVS", "DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS",
           "PDSH_MAX_FAN_OUT", "EXCLUDE_ENVS", "fetch_hostfile", "parse_resource_filter",
           "parse_inclusion_exclusion", "main"]  # fmt: skip

DLTS_HOSTFILE = "/job/hostfile"
#: Prefixes of the variables the deepspeed launcher forwards to the other nodes.
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX"]
#: The file of extra variables the deepspeed launcher exports on every node (``DS_ENV_FILE`` overrides the name).
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
#: Where the deepspeed launcher looks for that file: the home directory, then the working directory.
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
#: Variables the deepspeed launcher does not forward when the job name variable is set.
EXCLUDE_ENVS = {"AISC_JOB_NAME": ["NCCL_IB_HCA", "UCX_NET_DEVICES"]}


def main(args=None):
    """DeepSpeed's ``deepspeed`` command: not provided by torsh (the job's processes are started by torchrun)."""
    raise SystemExit("the deepspeed launcher is not provided by torsh: start the job with `torsh run` (torchrun's "
                     "options; every `import deepspeed` in it resolves to torsh), or translate the command with "
                     "`torsh-migrate launch \"deepspeed ...\" --to torchrun`")


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
