"""``zero_to_fp32.py`` in every save directory, as DeepSpeed writes it: the script the transformers documentation
tells users to run on a DeepSpeed checkpoint (``python zero_to_fp32.py . output_dir``), here for torsh's checkpoints.

The script is small and delegates to ``torsh-migrate merge``'s logic
(:func:`torsh.engine.checkpoint.merge.merged_weights`), so it needs torsh installed where it runs (DeepSpeed's needs
DeepSpeed's ``torch`` only). Its command line and its three functions follow DeepSpeed 0.19.8's: ``checkpoint_dir
output_dir [-t TAG] [--safe_serialization] [--exclude_frozen_parameters] [--max_shard_size ..]``, writing ``pytorch_model.bin`` (``model.safetensors`` with
``--safe_serialization``) into ``output_dir``; an ``output_dir`` ending in ``.bin``/``.pt``/``.safetensors`` is the
output file (the older scripts' form). The weights are written in one file (``--max_shard_size`` is accepted and not
used).
"""

from __future__ import annotations

import os
from pathlib import Path

#: The file name DeepSpeed gives its recovery script in the save directory.
NAME = "zero_to_fp32.py"

SCRIPT = '''#!/usr/bin/env python
"""Written by torsh's engine.save_checkpoint into the save directory, as DeepSpeed writes its zero_to_fp32.py: the
model's full fp32 state dict from the sharded checkpoint, by ``torsh-migrate merge``'s logic (torsh must be installed).

    python zero_to_fp32.py . output_dir/                 # output_dir/pytorch_model.bin
    python zero_to_fp32.py . output_dir/ --safe_serialization   # output_dir/model.safetensors
    python zero_to_fp32.py . pytorch_model.bin           # a file name: that file
"""

import argparse
import os
from pathlib import Path


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False):
    """The model's full state dict (fp32 master weights when the job kept them, buffers as saved), on the CPU."""
    from torsh.engine.checkpoint.merge import merged_weights, resolve

    state, note, frozen = merged_weights(resolve(Path(checkpoint_dir), tag))
    if note:
        print(f"note: {note}")
    if exclude_frozen_parameters and frozen:
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """Write the state dict into ``output_dir`` (pytorch_model.bin, or model.safetensors), or to the file named."""
    from torsh.engine.checkpoint.merge import write

    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    output = Path(output_dir)
    if output.suffix not in (".bin", ".pt", ".pth", ".safetensors"):
        output.mkdir(parents=True, exist_ok=True)
        output = output / ("model.safetensors" if safe_serialization else "pytorch_model.bin")
    write(state, output, "safetensors" if output.suffix == ".safetensors" else "torch")
    print(f"saved {len(state)} tensors to {output}")
    return output


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Load the consolidated fp32 weights into ``model`` (moved to the CPU); returns the model."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint_dir", help="the save directory, e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="the output directory (or file: .bin, .pt, .safetensors)")
    parser.add_argument("--max_shard_size", default="5GB", help="accepted; the weights are written in one file")
    parser.add_argument("--safe_serialization", action="store_true", help="write model.safetensors")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted")
    args = parser.parse_args()
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                               args.safe_serialization, args.tag, args.exclude_frozen_parameters)
'''


def write_recovery_script(save_dir: str | os.PathLike) -> None:
    """Rank 0, after a checkpoint is published: ``save_dir/zero_to_fp32.py``, executable (DeepSpeed's
    ``_copy_recovery_script``). Written atomically; a failure to write it is logged, never fails the save."""
    import logging

    path = Path(save_dir) / NAME
    tmp = path.with_name(f".{NAME}.tmp")
    try:
        tmp.write_text(SCRIPT)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    except OSError as exc:
        logging.getLogger("torsh.engine").warning("could not write %s: %s", path, exc)
        tmp.unlink(missing_ok=True)
