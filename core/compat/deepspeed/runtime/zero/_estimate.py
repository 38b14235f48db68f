"""DeepSpeed's memory estimates for ZeRO-2 and ZeRO-3 model states (bytes per CPU and per GPU), which scripts
print at start-up; the arithmetic of DeepSpeed 0.19.8's estimators, shared by ``stage_1_and_2`` and ``stage3``."""

from __future__ import annotations

GIB = 2**30


def total_params(model) -> int:
    """Parameters of ``model``, a tied weight counted once."""
    return sum({id(p): p.numel() for p in model.parameters()}.values())


def largest_layer_params(model) -> int:
    """The most parameters one module holds itself (not its children's)."""
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


def report(stage: int, rows: list[tuple[int, int, str]], nodes: int, gpus: int, params: int,
           largest: int | None = None) -> None:  # fmt: skip
    """Print the estimates, one row per option set: bytes per CPU, bytes per GPU, the options."""
    layer = "" if largest is None else f", {largest / 1e6:.0f}M parameters in the largest layer"
    print(f"DeepSpeed ZeRO-{stage} estimate of the memory for parameters, gradients and optimizer states: "
          f"{nodes} node(s) x {gpus} GPU(s), {params / 1e6:.0f}M parameters{layer}")  # fmt: skip
    print("  per CPU  |  per GPU |   options")
    for cpu, gpu, options in rows:
        print(f"  {cpu / GIB:7.2f}GB | {gpu / GIB:6.2f}GB | {options}")
