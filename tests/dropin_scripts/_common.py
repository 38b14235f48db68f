"""Shared by the drop-in scripts (each script also runs under real DeepSpeed): the output record."""

import json
import os
import sys


def write_result(path, losses, **extra):
    """Rank 0 writes the per-step losses and which ``deepspeed`` module ran (torsh's or DeepSpeed's)."""
    import deepspeed

    if int(os.environ.get("RANK", "0")) != 0:
        return
    real = [m for m in sys.modules if m.split(".")[0] == "deepspeed"
            and "site-packages" in str(getattr(sys.modules[m], "__file__", ""))]
    record = {"losses": losses, "deepspeed_file": deepspeed.__file__, "deepspeed_version": deepspeed.__version__,
              "real_deepspeed_modules": len(real)}
    record.update(extra)
    with open(path, "w") as f:
        json.dump(record, f)
