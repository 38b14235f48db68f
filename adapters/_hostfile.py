"""Hostfiles, host lists and DeepSpeed's node/slot filters: parsing, resolving and writing.

Grammars read (one host per line, in any mix):

* DeepSpeed / Open MPI / Horovod ``--hostfile``: ``host slots=N`` (Open MPI's ``max_slots=M`` is accepted and
  ignored);
* Horovod ``-H`` style in a file: ``host:N``;
* a bare ``host`` (MPI machinefile): slots unknown, the launcher decides.

``#`` starts a comment anywhere on a line; blank lines are skipped. (Horovod's own parser crashes on both;
DeepSpeed's skips only whole-line comments.) A repeated host or an unreadable line is a ConfigError naming the
line number. Written hostfiles use ``host slots=N``, the one grammar DeepSpeed, Horovod and Open MPI all read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torsh.errors import ConfigError, Problem

_LINE = re.compile(
    r"^(?P<host>[^\s:=#]+)(?::(?P<colon>\d+)|\s+slots\s*=\s*(?P<slots>\d+)(?:\s+max_slots\s*=\s*\d+)?)?$")
_HOST_LIST_ITEM = re.compile(r"^(?P<host>[^\s:,]+)(?::(?P<slots>\d+|\$\w+|\$\{[^{}]+\}))?$")


@dataclass(frozen=True)
class Node:
    """One node of a resolved job: its host (None when unnamed), its process count and device ids."""

    host: str | None
    """Host name, or None when the command does not name hosts (torchrun)."""
    nproc: int
    """Processes started on this node."""
    devices: tuple[int, ...] | None = None
    """Accelerator ids the processes use (DeepSpeed ``--include host:0,2``); None: the first ``nproc``."""


def parse_hostfile(text: str, *, source: str = "hostfile") -> list[tuple[str, int | None]]:
    """``(host, slots)`` per host line, in file order; slots None for a bare host."""
    hosts: list[tuple[str, int | None]] = []
    seen: dict[str, int] = {}
    problems = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if not match:
            problems.append(Problem(f"{source}:{number}", line, "expected 'host slots=N', 'host:N' or 'host'"))
            continue
        host = match.group("host")
        slots = match.group("slots") or match.group("colon")
        if host in seen:
            problems.append(Problem(f"{source}:{number}", line, f"host {host} is listed twice (first on line "
                                    f"{seen[host]}); list each host once with its total slots"))  # fmt: skip
            continue
        if slots is not None and int(slots) < 1:
            problems.append(Problem(f"{source}:{number}", line, "slots must be at least 1"))
            continue
        seen[host] = number
        hosts.append((host, int(slots) if slots is not None else None))
    if problems:
        raise ConfigError(problems, source=source)
    return hosts


def parse_host_list(text: str, *, source: str = "-H") -> list[tuple[str, int | str | None]]:
    """Horovod / Open MPI ``-H host1:4,host2:4`` (slots optional; a shell variable ``host:$N`` stays text)."""
    hosts: list[tuple[str, int | None]] = []
    for item in text.split(","):
        match = _HOST_LIST_ITEM.match(item.strip())
        if not match:
            raise ConfigError([Problem(source, text, f"cannot read host entry {item!r}; expected host[:slots]")])
        slots = match.group("slots")
        hosts.append((match.group("host"), int(slots) if slots is not None and slots.isdigit() else slots))
    names = [h for h, _ in hosts]
    repeated = sorted({h for h in names if names.count(h) > 1})
    if repeated:
        raise ConfigError([Problem(source, text, f"host(s) {', '.join(repeated)} listed twice")])
    return hosts


def format_hostfile(hosts: list[tuple[str, int | None]]) -> str:
    """A hostfile every launcher reads (``host slots=N``; a bare host when slots are unknown)."""
    return "".join(f"{h} slots={s}\n" if s is not None else f"{h}\n" for h, s in hosts)


def format_host_list(hosts: list[tuple[str, int | None]]) -> str:
    """``host1:4,host2:4`` for ``horovodrun -H`` / ``mpirun -H``."""
    return ",".join(f"{h}:{s}" if s is not None else h for h, s in hosts)


def parse_node_spec(text: str, *, source: str) -> dict[str, list[int]]:
    """DeepSpeed ``--include``/``--exclude``: ``NAME[:SLOT[,SLOT...]][@NAME...]`` -> host -> slots ([] = all)."""
    spec: dict[str, list[int]] = {}
    for part in text.split("@"):
        host, _, slots = part.partition(":")
        if not host or (slots and not re.fullmatch(r"\d+(,\d+)*", slots)):
            raise ConfigError([Problem(source, text, f"cannot read {part!r}; expected host or host:slot,slot")])
        spec.setdefault(host, [])
        spec[host] = sorted(set(spec[host]) | {int(s) for s in slots.split(",") if s})
    return spec


def resolve_nodes(hosts: list[tuple[str, int | None]], *, include: str | None = None, exclude: str | None = None,
                  num_nodes: int | None = None, nproc_per_node: int | None = None,
                  world_size: int | None = None) -> list[Node]:  # fmt: skip
    """The nodes a launcher starts processes on, following DeepSpeed's rules for filters and Horovod/MPI's
    for ``-np`` (fill hosts in order, up to their slots). Raises ConfigError for impossible requests."""
    pool = {h: list(range(s)) if s is not None else None for h, s in hosts}
    for flag, text in (("include", include), ("exclude", exclude)):
        if text:
            pool = _filtered(pool, flag, text)
    items = list(pool.items())
    if num_nodes is not None:
        if num_nodes > len(items):
            raise ConfigError([Problem("launch.nnodes", num_nodes, f"only {len(items)} host(s) are available")])
        items = items[:num_nodes]
    return _fill(items, nproc_per_node, world_size)


def _filtered(pool: dict[str, list[int] | None], flag: str, text: str) -> dict[str, list[int] | None]:
    """DeepSpeed's --include (only these hosts / slots) or --exclude (all but these) applied to host -> slots."""
    spec = parse_node_spec(text, source=f"launch.{flag}")
    for host, slots in spec.items():
        _check_known(pool, host, slots, flag, text)
    if flag == "include":
        return {h: (spec[h] or pool[h]) for h in pool if h in spec}
    left = {h: _without(pool[h], spec[h]) if h in spec else pool[h] for h in pool}
    return {h: s for h, s in left.items() if s is None or s}


def _check_known(pool: dict[str, list[int] | None], host: str, slots: list[int], flag: str, text: str) -> None:
    if host not in pool:
        raise ConfigError([Problem(f"launch.{flag}", text, f"host {host} is not in the hostfile "
                                   f"({', '.join(pool) or 'no hosts given'})")])  # fmt: skip
    missing = [s for s in slots if pool[host] is not None and s not in pool[host]]
    if missing:
        raise ConfigError([Problem(f"launch.{flag}", text, f"{host} has no slot(s) {missing}")])


def _without(slots: list[int] | None, excluded: list[int]) -> list[int]:
    """A host's slots less the excluded ones (all of them when none are named)."""
    return [] if not excluded else [s for s in slots or [] if s not in excluded]


def _per_host(slots: list[int] | None, nproc_per_node: int | None, even: int | None, remaining: int | None
              ) -> int | None:  # fmt: skip
    """One host's process count: the per-node count, its slots or an even share, capped by what -np leaves."""
    count = nproc_per_node if nproc_per_node is not None else (len(slots) if slots is not None else even)
    if remaining is None:
        return count
    return remaining if count is None else min(count, remaining)


def _devices(slots: list[int] | None, count: int) -> tuple[int, ...] | None:
    """The device ids of a host's first ``count`` slots; None when they are the first ids (nothing to select)."""
    return tuple(slots[:count]) if slots is not None and slots != list(range(len(slots))) else None


def _fill(items: list[tuple[str, list[int] | None]], nproc_per_node: int | None, world_size: int | None
          ) -> list[Node]:  # fmt: skip
    """Processes per host: the per-node count or the host's slots, up to ``world_size`` in host order."""
    nodes = []
    remaining = world_size
    # Hosts without slots share -np evenly (Open MPI gives a bare -H entry one slot; -np N over N hosts).
    even = world_size // len(items) if world_size and items and world_size % len(items) == 0 else None
    for host, slots in items:
        count = _per_host(slots, nproc_per_node, even, remaining)
        remaining = None if remaining is None else remaining - count
        if count is None:
            raise ConfigError([Problem("launch.hosts", host, "the number of processes on this host is unknown; "
                                       "give slots in the hostfile or a process count")])  # fmt: skip
        if count <= 0:
            break
        nodes.append(Node(host, count, _devices(slots, count)))
    if remaining:
        raise ConfigError([Problem("launch.world_size", world_size, "more processes than slots: "
                                   f"{world_size - remaining} slot(s) on {', '.join(h for h, _ in items)}")])
    return nodes
