"""Every rank's verdict on a check that may fail on some ranks only, so that all of them stop together.

A rank that raises while its peers go on into the next collective leaves them waiting for it forever. A check
whose outcome can differ between ranks (a path one node cannot write, a user object that is wrong on one rank)
gathers every rank's problem first (one ``all_gather_object`` over the default group, which every rank must
reach) and each rank then raises the same error. Without a process group, or on one rank, the rank's own
verdict is the answer.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def gather(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (one ``all_gather_object`` over ``group``, the default
    one unless given, whose every rank must call it); ``[value]`` without a process group or on one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def every_rank(problem: str | None, group: Any = None) -> list[tuple[int, str]]:
    """``(rank, problem)`` of every rank of ``group`` (the default one unless given) that has a problem, in rank
    order (ranks in the group); the same list on every rank (collective: each calls it, with None when it has no
    problem)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        return [] if problem is None else [(rank, problem)]
    return [(rank, str(p)) for rank, p in enumerate(gather(problem, group)) if p is not None]


def describe(bad: list[tuple[int, str]]) -> str:
    """One text for the problems of :func:`every_rank`, each named by the ranks that have it (``rank 1: ...``,
    ``ranks 0, 1: ...``), in the order of the first rank having it."""
    by_text: dict[str, list[int]] = {}
    for rank, problem in bad:
        by_text.setdefault(problem, []).append(rank)
    return "; ".join(f"{'ranks' if len(ranks) > 1 else 'rank'} {', '.join(map(str, ranks))}: {text}"
                     for text, ranks in by_text.items())  # fmt: skip


def agreed_problem(problem: str | None, rank: int, group: Any = None) -> str | None:
    """This rank's problem, or when it has none and another rank has, that rank's (``on rank R: ...``, R its rank in
    ``group``); None when no rank has one. Collective, as :func:`every_rank`."""
    bad = every_rank(problem, group)
    if not bad:
        return None
    first = next(((r, p) for r, p in bad if r != rank), bad[0])
    return problem or f"on rank {first[0]}: {first[1]}"
