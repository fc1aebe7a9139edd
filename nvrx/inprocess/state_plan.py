"""Who restores what after a fault: the plan every rank derives from what every rank holds.

``KeptState.restore_agreed`` gathers one ``Held`` per rank of the round's group (the steps
it kept, the course and the shard they belong to, what it registered, the replica groups
it was given, its clock) and each rank computes the same ``HandOver`` from that list:

* only the commits of the current course count: a course begins whenever the job falls
  back to its checkpoint, stamped with the wall clock of that fallback, so that a rank
  that missed it (one that was inactive) does not pass commits of an abandoned course,
  numbered like the new course's steps, for the job's state. The current course is the
  newest any rank is on: until a rank commits in it, no rank holds a step of it, and the
  ranks fall back again rather than take up the abandoned one;
* a rank holds shard ``g`` only if it committed shard ``g``: under renumbered ranks a
  survivor may stand for another group than the one it committed for; it then serves
  the shard it holds to the ranks that need it, and receives its new group's shard;
* commits made before any agreement (no shard known yet) are taken for the shard of the
  group the rank is in now: no renumbering can have happened to a rank before it agreed;
* the step restored is the newest that some holder of every shard holds; holders without
  it are receivers too. When a rank of the current course holds a newer step (its shard's
  replicas had committed one more than another shard's), that newer step is abandoned and
  trained again, maybe to other bits: the agreement then begins a new course, as a
  fallback does, so that a replica that sat it out (inactive) and holds the abandoned
  commit is not taken for a holder of the step trained again. Its commits of the step
  restored and older no longer count either: where no rank of the new course holds its
  shard, the ranks fall back to the checkpoint. Where every holder of the newer step sat
  it out, no rank here knows of it, and no course begins;
* each receiver is served by a holder of its group's shard that has the step and can
  send it (pickle takes what the commit holds besides tensors; where no holder can, the
  ranks fall back to the checkpoint rather than fail in the middle of a hand-over),
  receivers spread over them in turn, so that a spare node's ranks are not all served
  by one rank. ``HandOver.transfers`` orders the transfers alike on every rank, so that
  a rank that both sends and receives never waits on a rank that waits on it.

No plan (``None``): some shard has no holder of a common step of the current course; the
ranks fall back to the user's checkpoint. Ranks that disagree on what they registered or
on the replica groups raise the same error on every rank, instead of hanging in a
hand-over that does not match.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Held:
    """What one rank brings to the agreement."""

    steps: tuple[int, ...]  # complete commits, newest first
    course: float  # the course they belong to (the wall clock of its fallback; 0: none yet)
    shard: int | None  # the replica group whose shard they are (None: not yet known)
    names: tuple[str, ...]  # the objects registered for hand-over (not per rank)
    groups: tuple[tuple[int, ...], ...]  # the replica groups this rank was given (): None
    now: float = 0.0  # this rank's wall clock when it joined the agreement
    unsendable: tuple[int, ...] = ()  # steps a hand-over cannot send (pickle refuses them)


@dataclass(frozen=True)
class HandOver:
    """The agreed step, its course, and for each receiving rank the rank that sends to it."""

    step: int
    course: float
    sources: dict[int, int]

    def receivers_of(self, rank: int) -> list[int]:
        return sorted(r for r, source in self.sources.items() if source == rank)

    def transfers(self) -> list[tuple[int, int]]:
        """(source, receiver) pairs in one order for every rank: each rank does its own in
        this order, so the first transfer not done always has both its ranks at it."""
        return sorted((source, receiver) for receiver, source in self.sources.items())


def replica_groups(groups: Sequence[Sequence[int]] | None, world: int) -> list[list[int]]:
    """``groups`` checked to cover ranks 0..world-1 once each; None means one group of all."""
    if groups is None:
        return [list(range(world))]
    listed = [r for ranks in groups for r in ranks]
    is_rank = [isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world for r in listed]
    wrong = sorted({_not_a_rank(r) for r, ok in zip(listed, is_rank, strict=True) if not ok})
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


def _not_a_rank(value: object) -> str:
    """``value`` as the error names it, with its type where it is no int (a NumPy int prints as one)."""
    if type(value) is int:
        return str(value)
    return f"{value!r} of type {type(value).__name__}, not int"


def check_alike(everyone: list[Held]) -> None:
    """Raise, on every rank alike, when the ranks registered different objects or were given
    different replica groups (None and one group of every rank are alike)."""
    every_rank = (tuple(range(len(everyone))),)
    for what, values in (
        ("registered different objects", [h.names for h in everyone]),
        ("passed different replica_groups", [h.groups or every_rank for h in everyone]),
    ):
        if len(set(values)) > 1:
            by_rank = {rank: list(v) for rank, v in enumerate(values)}
            raise ValueError(
                f"KeptState.restore_agreed: the ranks {what}: {by_rank}; every rank must "
                "register the same names and pass the same groups"
            )


def plan(everyone: list[Held], groups: list[list[int]]) -> HandOver | None:
    """The hand-over every rank derives from ``everyone`` (see the module)."""
    current = current_course(everyone)
    if current is None:
        return None
    shards = [_shard_of(h, r, groups) for r, h in enumerate(everyone)]
    holders = [
        [r for r, h in enumerate(everyone) if h.steps and h.course == current and shards[r] == g]
        for g in range(len(groups))
    ]
    common = set.intersection(*(set().union(*(everyone[r].steps for r in held)) for held in holders))
    if not common:
        return None
    step = max(common)
    sources: dict[int, int] = {}
    for ranks, held in zip(groups, holders, strict=True):
        having = [r for r in held if step in everyone[r].steps]
        senders = [r for r in having if step not in everyone[r].unsendable]
        receivers = [r for r in ranks if r not in having]
        if receivers and not senders:
            return None  # no holder can send it: the checkpoint, rather than a hand-over that fails
        sources.update({r: senders[i % len(senders)] for i, r in enumerate(receivers)})
    forks = step < max(max(h.steps) for h in everyone if h.steps and h.course == current)
    return HandOver(step, new_course(everyone) if forks else current, sources)


def current_course(everyone: list[Held]) -> float | None:
    """The newest course any rank is on, whether or not it holds commits of it: a rank on
    an older course missed the fallback that began this one, and its commits are of an
    abandoned course even while no rank has committed in this one yet. None for no rank."""
    return max((h.course for h in everyone), default=None)


def newest_step(everyone: list[Held]) -> int | None:
    """The newest step committed in the current course, by anyone."""
    current = current_course(everyone)
    return max((max(h.steps) for h in everyone if h.steps and h.course == current), default=None)


def new_course(everyone: list[Held]) -> float:
    """The course a fallback begins: its wall clock, later than every course the ranks knew."""
    return max(max(h.now for h in everyone), math.nextafter(max(h.course for h in everyone), math.inf))


def _shard_of(held: Held, rank: int, groups: list[list[int]]) -> int:
    """The shard ``rank``'s commits are of: the one it was told, else its group's now."""
    if held.shard is not None:
        return held.shard
    return next(g for g, ranks in enumerate(groups) if rank in ranks)


__all__ = ["HandOver", "Held", "check_alike", "current_course", "new_course", "newest_step", "plan", "replica_groups"]
