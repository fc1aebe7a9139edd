"""Who restores what after a fault: the plan every rank derives from what every rank holds.

``KeptState.restore_agreed`` gathers one ``Held`` per rank of the round's group (the steps
it kept, the course and the shard they belong to, what it registered and the replica
groups it was given) and each rank computes the same ``HandOver`` from that list:

* only the commits of the current course count: a course begins whenever the job falls
  back to its checkpoint, so a rank that missed that (one that was inactive) and holds
  commits numbered like the new course's is not taken for a holder;
* a rank holds its replica group's shard only if it committed that shard: under
  renumbered ranks a survivor may hold another group's shard, and is then a receiver;
* the step restored is the newest that some holder of every replica group holds;
  holders without it are receivers too;
* each receiver is served by a holder of its group that has the step, receivers spread
  over them in turn, so that a spare node's ranks are not all served by one rank.

No plan (``None``): some group has no holder of a common step; the ranks fall back to the
user's checkpoint. Ranks that disagree on what they registered or on the replica groups
raise the same error on every rank, instead of hanging in a hand-over that does not match.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Held:
    """What one rank brings to the agreement."""

    steps: tuple[int, ...]  # complete commits, newest first
    course: int  # the course they belong to
    shard: int | None  # the replica group whose shard they are (None: not yet known)
    names: tuple[str, ...]  # the objects registered for hand-over (not per rank)
    groups: tuple[tuple[int, ...], ...]  # the replica groups this rank was given


@dataclass(frozen=True)
class HandOver:
    """The agreed step, its course, and for each receiving rank the rank that sends to it."""

    step: int
    course: int
    sources: dict[int, int]

    def receivers_of(self, rank: int) -> list[int]:
        return sorted(r for r, source in self.sources.items() if source == rank)


def replica_groups(groups: Sequence[Sequence[int]] | None, world: int) -> list[list[int]]:
    """``groups`` checked to cover ranks 0..world-1 once each; None means one group of all."""
    if groups is None:
        return [list(range(world))]
    listed = [r for ranks in groups for r in ranks]
    is_rank = [isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world for r in listed]
    wrong = sorted({str(r) for r, ok in zip(listed, is_rank, strict=True) if not ok})
    counts = Counter(r for r, ok in zip(listed, is_rank, strict=True) if ok)
    twice = sorted(r for r, n in counts.items() if n > 1)
    missing = sorted(set(range(world)) - set(counts))
    if wrong or twice or missing or not all(groups):
        raise ValueError(
            f"KeptState.restore_agreed: replica_groups must cover the group's ranks 0..{world - 1} "
            f"once each, in non-empty groups; got {[list(g) for g in groups]}"
            + (f" (not ranks: {', '.join(wrong)})" if wrong else "")
            + (f" (more than once: {twice})" if twice else "")
            + (f" (missing: {missing})" if missing else "")
        )
    return [list(ranks) for ranks in groups]


def check_alike(everyone: list[Held]) -> None:
    """Raise, on every rank alike, when the ranks registered different objects or were given
    different replica groups."""
    for what, values in (
        ("registered different objects", [h.names for h in everyone]),
        ("passed different replica_groups", [h.groups for h in everyone]),
    ):
        if len(set(values)) > 1:
            by_rank = {rank: list(v) for rank, v in enumerate(values)}
            raise ValueError(
                f"KeptState.restore_agreed: the ranks {what}: {by_rank}; every rank must "
                "register the same names and pass the same groups"
            )


def plan(everyone: list[Held], groups: list[list[int]]) -> HandOver | None:
    """The hand-over every rank derives from ``everyone`` (see the module)."""
    current = max((h.course for h in everyone if h.steps), default=None)
    if current is None:
        return None
    holders = [_holders(everyone, g, ranks, current) for g, ranks in enumerate(groups)]
    common = set.intersection(*(set().union(*(everyone[r].steps for r in held)) for held in holders))
    if not common:
        return None
    step = max(common)
    sources: dict[int, int] = {}
    for ranks, held in zip(groups, holders, strict=True):
        senders = [r for r in held if step in everyone[r].steps]
        receivers = [r for r in ranks if r not in senders]
        sources.update({r: senders[i % len(senders)] for i, r in enumerate(receivers)})
    return HandOver(step, current, sources)


def _holders(everyone: list[Held], shard: int, ranks: list[int], course: int) -> list[int]:
    """The ranks of group ``shard`` whose commits are of that shard, in the current course."""
    return [
        r
        for r in ranks
        if everyone[r].steps and everyone[r].course == course and everyone[r].shard in (None, shard)
    ]


__all__ = ["HandOver", "Held", "check_alike", "plan", "replica_groups"]
