"""``deepspeed.utils.numa``: the core lists of the deepspeed launcher's ``--bind_core_list`` (``"0,2-4,6"``), read
as DeepSpeed 0.19.8 reads them. torsh does not bind cores itself (``torsh run`` starts the processes as torchrun
does); scripts and launch wrappers that check a core list before passing it on get DeepSpeed's answer."""

from __future__ import annotations

import subprocess

__all__ = ["get_numa_cores", "parse_range", "parse_range_list"]


def get_numa_cores() -> list[list[int]]:
    """The CPU cores of each NUMA node, as ``numactl --hardware`` lists them ([] without numactl)."""
    try:
        output = subprocess.check_output(["numactl", "--hardware"], text=True)
    except (FileNotFoundError, subprocess.SubprocessError):
        return []
    nodes: dict[int, list[int]] = {}
    for line in output.splitlines():
        head, found, cores = line.partition(" cpus:")
        if found and head.startswith("node "):
            nodes[int(head.split()[1])] = [int(core) for core in cores.split()]
    return [nodes[n] for n in sorted(nodes)]


def parse_range(rng: str) -> range:
    """``"3"`` -> ``range(3, 4)``; ``"2-5"`` -> ``range(2, 6)`` (both ends included). A malformed or descending
    range is a ValueError."""
    try:
        value = int(rng)
    except ValueError:
        parts = rng.split("-")
        if len(parts) != 2:
            raise ValueError(f"Bad range: '{rng}', range must be either a number or two number separated by dash")
        start, end = int(parts[0]), int(parts[1])
        if start > end:
            raise ValueError(f"Bad range: '{rng}', range end must larger than or equal to start")
        return range(start, end + 1)
    return range(value, value + 1)


def parse_range_list(range_str: str) -> list[int]:
    """``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]``. The parts must ascend without overlapping (ValueError otherwise), as
    the deepspeed launcher requires of ``--bind_core_list``."""
    numbers: list[int] = []
    last = -1
    for part in range_str.split(","):
        cores = parse_range(part)
        if cores[0] <= last:
            raise ValueError(f"Bad range: '{range_str}', sub ranges must not overlap with each other and should be "
                             "in ascend order")  # fmt: skip
        last = cores[-1]
        numbers.extend(cores)
    return numbers
