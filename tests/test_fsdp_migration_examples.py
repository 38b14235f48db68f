"""migration_examples/{fsdp,accelerate,fairscale}: each input converted again and compared with its golden file.

Regenerate the goldens after an intended change with ``make goldens``
and review the diff.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from golden import check_golden

from torsh import adapters
from torsh.adapters.fsdp import snippet
from torsh.formats import dump_text, load_file

EXAMPLES = Path(__file__).resolve().parent.parent / "migration_examples"

#: (input, target dialect, version, golden); a golden ending in .py is the FSDP2 snippet.
CONVERSIONS = [
    ("fsdp/llama_fsdp1.json", "fsdp", "fsdp2", "fsdp/llama_fsdp1.expected.json"),
    ("fsdp/llama_fsdp1.json", "fsdp", "fsdp2", "fsdp/llama_fsdp1.expected.py"),
    ("fsdp/hsdp_offload_fsdp2.json", "fsdp", "fsdp1", "fsdp/hsdp_offload_fsdp2.expected.json"),
    ("fsdp/hsdp_offload_fsdp2.json", "accelerate", None, "fsdp/hsdp_offload_fsdp2.expected.yaml"),
    ("accelerate/fsdp1_to_fsdp2.yaml", "accelerate", "fsdp2", "accelerate/fsdp1_to_fsdp2.expected.yaml"),
    ("accelerate/deepspeed_zero3_to_fsdp2.yaml", "fsdp", "fsdp2", "accelerate/deepspeed_zero3_to_fsdp2.expected.json"),
    ("accelerate/fsdp1_to_deepspeed.yaml", "deepspeed", None, "accelerate/fsdp1_to_deepspeed.expected.json"),
    # ... and back: the DeepSpeed JSON written above, read and written as an Accelerate FSDP v1 YAML again.
    ("accelerate/fsdp1_to_deepspeed.expected.json", "accelerate", "fsdp1",
     "accelerate/fsdp1_to_deepspeed.back.expected.yaml"),
    ("fairscale/oss_sdp_to_fsdp2.json", "fsdp", "fsdp2", "fairscale/oss_sdp_to_fsdp2.expected.json"),
    ("fairscale/fsdp_mixed_precision_to_accelerate.json", "accelerate", None,
     "fairscale/fsdp_mixed_precision_to_accelerate.expected.yaml"),
]


def _convert(source: str, target: str, version: str | None, golden: str) -> str:
    read = adapters.load(EXAMPLES / source)
    if golden.endswith(".py"):
        return snippet(read.result)
    written = adapters.write(read.result, target, version=version)
    fmt = {".json": "json", ".yaml": "yaml"}[Path(golden).suffix]
    return dump_text(written.result, fmt)


@pytest.mark.parametrize("source, target, version, golden", CONVERSIONS, ids=[c[3] for c in CONVERSIONS])
def test_conversion_matches_its_golden_file(source, target, version, golden):
    text = _convert(source, target, version, golden)
    check_golden(EXAMPLES / golden, text)


def test_every_example_input_has_a_golden_and_every_golden_an_input():
    inputs = {p.relative_to(EXAMPLES).as_posix() for d in ("fsdp", "accelerate", "fairscale")
              for p in (EXAMPLES / d).iterdir() if ".expected" not in p.name and p.suffix in (".json", ".yaml")}
    goldens = {p.relative_to(EXAMPLES).as_posix() for d in ("fsdp", "accelerate", "fairscale")
               for p in (EXAMPLES / d).iterdir() if ".expected" in p.name}  # fmt: skip
    assert inputs == {c[0] for c in CONVERSIONS if ".expected" not in c[0]}
    listed = {c[3] for c in CONVERSIONS}
    assert listed <= goldens


def test_accelerate_fsdp1_quirk_example_keeps_its_meaning_in_fsdp2():
    """The v1 YAML names SHARD_GRAD_OP only under fsdp_reshard_after_forward: read as ZeRO-2, with a note."""
    read = adapters.load(EXAMPLES / "accelerate" / "fsdp1_to_deepspeed.yaml")
    assert read.result.sharding.stage == 2
    v2, _ = load_file(EXAMPLES / "accelerate" / "fsdp1_to_fsdp2.expected.yaml")
    assert v2["fsdp_config"]["fsdp_version"] == 2 and "fsdp_backward_prefetch" not in v2["fsdp_config"]
