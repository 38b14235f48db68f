"""``torsh-migrate merge CHECKPOINT -o model.safetensors``: a sharded checkpoint as one state dict.

Two kinds of checkpoint directory, both in DeepSpeed's layout (``save_dir/latest`` naming ``save_dir/<tag>/``):

* torsh's (``engine.save_checkpoint``): ``torch.distributed.checkpoint`` shards from any world size and ZeRO stage;
* DeepSpeed's (``mp_rank_00_model_states.pt``, ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, ZeRO 0-3),
  read with no DeepSpeed install.

Nothing in a checkpoint can run code. Only the model's weights and buffers are written, keyed by the module's
names: the fp32 master weights when the job kept them (bf16/fp16 training), as ``.safetensors`` or as a torch
``.pt`` / ``.bin`` file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from torsh.errors import MISSING, ConfigError, Problem

FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("merge", help="merge a sharded torsh or DeepSpeed checkpoint into one file",
                            description="Consolidate a checkpoint written by torsh's engine.save_checkpoint or by "
                            "DeepSpeed (ZeRO stages 0-3, any world size) into one state dict of the model's weights "
                            "(fp32 master weights when the job kept them), written as .safetensors or torch "
                            ".pt/.bin (by the output's suffix). Reading never runs code from the checkpoint.",
                            )  # fmt: skip
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="the save directory (holding 'latest' and one directory per tag) or one tag's directory")
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="output file: .safetensors, or .pt / .pth / .bin for torch.save")
    parser.add_argument("--tag", help="the checkpoint tag to merge (default: the one 'latest' names)")
    parser.add_argument("--force", action="store_true", help="overwrite the output file if it exists")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    output = Path(args.output)
    kind = _output_kind(output, args.force)
    _require_torch()
    from torsh.engine.checkpoint.merge import merged_weights, resolve, write

    path = resolve(Path(args.checkpoint), args.tag)
    state, note, _ = merged_weights(path)
    write(state, output, kind)
    count = sum(t.numel() for t in state.values() if hasattr(t, "numel"))
    print(f"merged {path}: {len(state)} tensors, {count:,} elements -> {output}")
    if note:
        print(f"note: {note}")
    return 0


def _output_kind(output: Path, force: bool) -> str:
    kind = FORMATS.get(output.suffix.lower())
    if kind is None:
        raise ConfigError([Problem("-o", str(output), f"the output must end in one of {', '.join(FORMATS)} "
                                   "(.safetensors, or a torch file)")])  # fmt: skip
    if output.exists() and not force:
        raise ConfigError([Problem("-o", str(output), "the output file exists; pass --force to overwrite it")])
    if not output.parent.is_dir():
        raise ConfigError([Problem("-o", str(output), f"the directory {output.parent} does not exist")])
    if kind == "safetensors":
        try:
            import safetensors  # noqa: F401
        except ModuleNotFoundError:
            raise ConfigError([Problem("-o", str(output), "writing .safetensors needs the safetensors package: "
                                       "pip install 'torsh-distributed[merge]' (or write a .pt file)")]) from None
    return kind


def _require_torch() -> None:
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError:
        raise ConfigError([Problem("CHECKPOINT", MISSING, "merging a checkpoint needs PyTorch: "
                                   "pip install 'torsh-distributed[merge]'")]) from None  # fmt: skip


