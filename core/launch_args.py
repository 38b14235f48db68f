"""Let a training script accept its local rank however the launcher passes it.

The deepspeed launcher appends ``--local_rank=N``; ``python -m torch.distributed.launch`` appends
``--local-rank=N`` (torch 2.x; ``--local_rank`` before 2.0); torchrun appends nothing and sets ``LOCAL_RANK``;
horovodrun and mpirun set only their own variables. A script with ``parser.add_argument("--local_rank")`` then
fails with "unrecognized arguments: --local-rank=0" under one launcher and gets None under another. One call
fixes both::

    parser = argparse.ArgumentParser()
    torsh.launch_args.add_local_rank_argument(parser)
    args = parser.parse_args()
    device = torch.device("cuda", args.local_rank)

No torch import here.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from torsh.ranks import discover

__all__ = ["add_local_rank_argument", "local_rank_default"]


def local_rank_default(environ: Mapping[str, str] | None = None) -> int:
    """The local rank from the environment: ``LOCAL_RANK``, else whatever launcher is found, else 0."""
    environ = os.environ if environ is None else environ
    if environ.get("LOCAL_RANK", "").strip().isdigit():
        return int(environ["LOCAL_RANK"])
    return discover(environ, argv=[]).local_rank


def add_local_rank_argument(parser: argparse.ArgumentParser, *, dest: str = "local_rank",
                            environ: Mapping[str, str] | None = None) -> argparse.Action:  # fmt: skip
    """Add ``--local_rank`` / ``--local-rank`` (one option, both spellings) defaulting to the environment's value.

    Returns the argparse action. The value given on the command line wins over the environment, as the launchers
    that pass it intend.
    """
    return parser.add_argument(
        "--local_rank", "--local-rank", dest=dest, type=int, default=local_rank_default(environ),
        help="local rank of this process (set by the launcher; default: LOCAL_RANK or the launcher's variables)",
    )  # fmt: skip
