"""Launchers: what each one gives the processes it starts, and what it assumes when a command says nothing.

One table per fact, keyed by the launcher (``torchrun``, ``deepspeed``, ``horovodrun``, ``mpirun``, and
``accelerate`` where it reads like torchrun). The launch dialect reads and writes commands with these; the
variables are the ones ``torsh.ranks`` finds again in a worker.
"""

from __future__ import annotations

import re
from typing import Any

#: The rendezvous port torch.distributed and the deepspeed launcher use when none is given.
DEFAULT_PORT = 29500

#: Horovod's log levels (HOROVOD_LOG_LEVEL, ``horovodrun --log-level``, ``logging.level`` of its config file).
HOROVOD_LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")

#: The process count a launcher uses when the command gives none (said in notes).
DEFAULT_NPROC = {"torchrun": "1 per node", "deepspeed": "one per visible GPU", "horovodrun": "-np is required",
                 "mpirun": "one per slot"}  # fmt: skip

#: Where a script finds its local rank when the launcher appends no argument.
LOCAL_RANK_VARIABLE = {"torchrun": "LOCAL_RANK", "accelerate": "LOCAL_RANK", "deepspeed": "LOCAL_RANK",
                       "horovodrun": "HOROVOD_LOCAL_RANK (hvd.local_rank() or torsh.ranks.discover())",
                       "mpirun": "OMPI_COMM_WORLD_LOCAL_RANK (torsh.ranks.discover())"}  # fmt: skip

#: The local-rank argument a launcher program appends to the script's arguments by default.
DEFAULT_LOCAL_RANK_ARGV = {"deepspeed": "--local_rank", "python -m torch.distributed.launch": "--local-rank"}

#: The variables each launcher sets in every worker, as templates over the worker's place in the job: ``rank``,
#: ``local`` (local rank), ``world``, ``nproc`` (processes on its node), ``node`` (node rank), ``nnodes``,
#: ``host``, ``devices``, ``addr``, ``port``, ``run_id``, ``max_restarts``. In the order the launcher sets them.
WORKER_ENV = {
    "torchrun": {"RANK": "{rank}", "LOCAL_RANK": "{local}", "WORLD_SIZE": "{world}", "LOCAL_WORLD_SIZE": "{nproc}",
                 "GROUP_RANK": "{node}", "GROUP_WORLD_SIZE": "{nnodes}", "ROLE_RANK": "{rank}",
                 "ROLE_WORLD_SIZE": "{world}", "ROLE_NAME": "default", "MASTER_ADDR": "{addr}",
                 "MASTER_PORT": "{port}", "TORCHELASTIC_RUN_ID": "{run_id}", "TORCHELASTIC_RESTART_COUNT": "0",
                 "TORCHELASTIC_MAX_RESTARTS": "{max_restarts}"},
    "deepspeed": {"RANK": "{rank}", "LOCAL_RANK": "{local}", "WORLD_SIZE": "{world}", "LOCAL_SIZE": "{nproc}",
                  "CROSS_RANK": "{node}", "CROSS_SIZE": "{nnodes}", "MASTER_ADDR": "{addr}", "MASTER_PORT": "{port}",
                  "CUDA_VISIBLE_DEVICES": "{devices}"},
    "horovodrun": {"HOROVOD_RANK": "{rank}", "HOROVOD_SIZE": "{world}", "HOROVOD_LOCAL_RANK": "{local}",
                   "HOROVOD_LOCAL_SIZE": "{nproc}", "HOROVOD_CROSS_RANK": "{node}", "HOROVOD_CROSS_SIZE": "{nnodes}",
                   "HOROVOD_HOSTNAME": "{host}", "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"},
    "mpirun": {"OMPI_COMM_WORLD_RANK": "{rank}", "OMPI_COMM_WORLD_SIZE": "{world}",
               "OMPI_COMM_WORLD_LOCAL_RANK": "{local}", "OMPI_COMM_WORLD_LOCAL_SIZE": "{nproc}",
               "MASTER_ADDR": "{addr}", "MASTER_PORT": "{port}"},
}  # fmt: skip


def worker_env(launcher: str, **place: Any) -> dict[str, str]:
    """The variables ``launcher`` sets in one worker (see ``WORKER_ENV`` for the names of ``place``)."""
    return {name: template.format(**place) for name, template in WORKER_ENV[launcher].items()}


_SHELL_REFERENCE = re.compile(r"\$(\w+|[@*#?]|\{[^{}]+\}|\(\([^()]*\)\)|\([^()]*\))")


def shell_references(value: Any) -> list[str]:
    """The shell variables and substitutions in a value of a command line (a text or a list of texts), in order;
    such a value is only known when the shell runs the command."""
    items = value if isinstance(value, (list, tuple)) else [value]
    found: list[str] = []
    for item in items:
        if isinstance(item, str):
            found += [m.group(0) for m in _SHELL_REFERENCE.finditer(item) if m.group(0) not in found]
    return found


#: sbatch's options (Slurm 23.x-25.x man page): long name -> its short spelling, or "" when it has none. A Slurm
#: script torsh writes uses only these, and a script torsh reads may use any of them.
SBATCH_OPTIONS = {
    "account": "A", "acctg-freq": "", "array": "a", "batch": "", "bb": "", "bbf": "", "begin": "b", "chdir": "D",
    "cluster-constraint": "", "clusters": "M", "comment": "", "constraint": "C", "container": "",
    "container-id": "", "contiguous": "", "core-spec": "S", "cores-per-socket": "", "cpu-freq": "",
    "cpus-per-gpu": "", "cpus-per-task": "c", "deadline": "", "delay-boot": "", "dependency": "d",
    "distribution": "m", "error": "e", "exclude": "x", "exclusive": "", "export": "", "export-file": "",
    "extra": "", "extra-node-info": "B", "get-user-env": "", "gid": "", "gpu-bind": "", "gpu-freq": "",
    "gpus": "G", "gpus-per-node": "", "gpus-per-socket": "", "gpus-per-task": "", "gres": "", "gres-flags": "",
    "help": "h", "hint": "", "hold": "H", "ignore-pbs": "", "input": "i", "job-name": "J",
    "kill-on-invalid-dep": "", "licenses": "L", "mail-type": "", "mail-user": "", "mcs-label": "", "mem": "",
    "mem-bind": "", "mem-per-cpu": "", "mem-per-gpu": "", "mincpus": "", "network": "", "nice": "",
    "no-kill": "k", "no-requeue": "", "nodefile": "F", "nodelist": "w", "nodes": "N", "ntasks": "n",
    "ntasks-per-core": "", "ntasks-per-gpu": "", "ntasks-per-node": "", "ntasks-per-socket": "", "open-mode": "",
    "output": "o", "overcommit": "O", "oversubscribe": "s", "parsable": "", "partition": "p", "power": "",
    "prefer": "", "priority": "", "profile": "", "propagate": "", "qos": "q", "quiet": "Q", "reboot": "",
    "requeue": "", "reservation": "", "signal": "", "sockets-per-node": "", "spread-job": "", "switches": "",
    "test-only": "", "thread-spec": "", "threads-per-core": "", "time": "t", "time-min": "", "tmp": "",
    "tres-per-task": "", "uid": "", "usage": "", "use-min-nodes": "", "verbose": "v", "version": "V", "wait": "W",
    "wait-all-nodes": "", "wckey": "", "wrap": "",
}  # fmt: skip
