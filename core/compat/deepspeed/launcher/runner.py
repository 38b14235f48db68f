"""``deepspeed.launcher.runner``: the module-level constants of DeepSpeed 0.19.8's ``deepspeed`` command.

Accelerate imports ``DEEPSPEED_ENVIRONMENT_NAME`` from here in ``accelerate launch`` for every DeepSpeed job (for a
multi-node job it appends the processes' environment to that file, which the deepspeed launcher exports on every
node). The values are DeepSpeed's. The ``deepspeed`` command (:func:`main`) is not provided: start the job with
``torsh run`` (torchrun's options), or translate the command with ``torsh-migrate launch "deepspeed ..." --to
torchrun``.
"""

from __future__ import annotations

import os

from .constants import PDSH_MAX_FAN_OUT

__all__ = ["DLTS_HOSTFILE", "EXPORT_ENVS", "DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS",
           "PDSH_MAX_FAN_OUT", "EXCLUDE_ENVS", "main"]  # fmt: skip

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
