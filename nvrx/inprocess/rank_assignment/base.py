"""Rank assignments: the contract (context, base classes, shared checks), and the assignments
that need no topology.

Renumbering (``ShiftRanks``, ``FillGaps``) closes the gaps that terminated ranks leave, so
the healthy ranks are 0..n-1; filters (``ActivateAllRanks``, ``MaxActiveWorldSize``,
``ActiveWorldSizeDivisibleBy``) choose which of them run the function (active) and which
wait (spares). ``Tree`` (``tree``) does both from a topology.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from .. import exception
from ..state import Mode, State


class RankDiscarded(exception.RestartError):
    """Raised on a rank that the rank assignment removed from the job."""


@dataclasses.dataclass
class RankAssignmentCtx:
    """Input and output of a rank assignment step.

    Args:
        state: the Wrapper's state of this rank.
        store: the store of the current round (torch ``Store`` API).
        terminated_ranks: ranks (current ``state.rank`` numbering) that left.
        rejoined_ranks: ranks (same numbering) whose process died and whose replacement
            was taken back into this round (under a supervisor: ``rejoin``); on a
            replacement, its own rank only. An assignment that keeps what it learnt in
            earlier calls (``Tree``) hands it to them; the others may ignore it.
    """

    state: State
    store: Any
    terminated_ranks: set[int]
    rejoined_ranks: set[int] = dataclasses.field(default_factory=set)


def terminated_set(ranks: Iterable[Any]) -> set[int]:
    """``ranks`` as a set of ints; digit strings and bytes from a store are converted."""
    result: set[int] = set()
    for value in ranks:
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value.strip())
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"terminated_ranks must hold rank numbers >= 0, got {value!r}")
        result.add(value)
    return result


class RankAssignment(abc.ABC):
    """Base class of the Wrapper's ``rank_assignment``: ``__call__(ctx) -> ctx``.

    Reassigns ranks after terminations, computes the new world size and picks
    the active ranks; inactive ranks wait as spares for a later round.
    """

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        raise NotImplementedError

    def peer_wait_s(self, barrier_timeout: float) -> float:
        """Longest wait of this assignment for the rank's peers (a store exchange or
        barrier), in seconds. Between rounds the monitor process ends a rank that makes no
        progress in its assignment ``hard_timeout`` after that limit
        (``ProgressBoard.waiting``). ``barrier_timeout`` unless the plug-in says otherwise
        (one of the user's may wait); one that waits for no peer returns 0: a hang there
        is ended after ``hard_timeout``."""
        return barrier_timeout


class RankFilter(RankAssignment):
    """A rank assignment that only chooses active and inactive ranks (runs after renumbering)."""

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        raise NotImplementedError


def assignment_wait_s(assignment: Callable[..., Any], barrier_timeout: float) -> float:
    """Longest wait of the rank assignment ``assignment`` for the rank's peers: that of each
    part of a ``Compose``, added; a plug-in's ``peer_wait_s``; ``barrier_timeout`` for
    any other callable (it may wait)."""
    parts = getattr(assignment, "instances", None)  # a Compose: its parts run one after another
    if isinstance(parts, tuple):
        return sum(assignment_wait_s(part, barrier_timeout) for part in parts)
    own = getattr(assignment, "peer_wait_s", None)
    return float(own(barrier_timeout)) if callable(own) else barrier_timeout


def positive_int(owner: str, name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "an int >= 1" + (" or None" if allow_none else "")
        raise ValueError(f"{owner}: {name} must be {expected}, got {value!r}")


def group_key(key_or_fn: object | Callable[[State], object], state: State) -> str:
    key = key_or_fn(state) if callable(key_or_fn) else key_or_fn
    return str(key)


# -- renumbering -----------------------------------------------------------------------------
def _surviving(ctx: RankAssignmentCtx) -> tuple[int, set[int]]:
    """This rank and the terminated ones; ``RankDiscarded`` when this rank is one of them."""
    terminated = terminated_set(ctx.terminated_ranks)
    rank = ctx.state.rank
    if rank is None or rank in terminated:
        raise RankDiscarded(f"rank {rank} is terminated (terminated ranks: {sorted(terminated)})")
    return rank, terminated


class ShiftRanks(RankAssignment):
    """Close the gaps of terminated ranks by shifting the higher ranks down; order is kept.

    ``0 X 2 3 X X 6 7`` becomes ``0 2 3 6 7`` (new ranks 0..4).
    """

    def peer_wait_s(self, barrier_timeout: float) -> float:
        return 0.0  # (computed locally)

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        rank, terminated = _surviving(ctx)
        below = sum(1 for t in terminated if t < rank)
        ctx.state = dataclasses.replace(
            ctx.state, rank=rank - below, world_size=ctx.state.world_size - len(terminated)
        )
        ctx.terminated_ranks = set()
        return ctx


class FillGaps(RankAssignment):
    """Keep the lowest ranks in place; the highest healthy ranks move into the gaps.

    ``0 X 2 3 X X 6 7`` becomes ``0 6 2 3 7``: rank ``r >= new_world_size``
    takes the ``(r - new_world_size)``-th lowest terminated index.
    """

    def peer_wait_s(self, barrier_timeout: float) -> float:
        return 0.0  # (computed locally)

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        rank, terminated = _surviving(ctx)
        new_world_size = ctx.state.world_size - len(terminated)
        if rank >= new_world_size:
            gaps = sorted(t for t in terminated if t < new_world_size)
            movers = sorted(
                r for r in range(new_world_size, ctx.state.world_size) if r not in terminated
            )
            rank = gaps[movers.index(rank)]
        ctx.state = dataclasses.replace(ctx.state, rank=rank, world_size=new_world_size)
        ctx.terminated_ranks = set()
        return ctx


# -- filters --------------------------------------------------------------------------------
def _activate_below(ctx: RankAssignmentCtx, active_world_size: int) -> RankAssignmentCtx:
    state = ctx.state
    if state.rank is not None and state.rank < active_world_size:
        mode, active_rank = Mode.ACTIVE, state.rank
    else:
        mode, active_rank = Mode.INACTIVE, None
    ctx.state = dataclasses.replace(
        state, mode=mode, active_rank=active_rank, active_world_size=active_world_size
    )
    return ctx


def _current_active_world_size(state: State) -> int:
    if state.active_world_size is None:
        return state.world_size
    return min(state.active_world_size, state.world_size)


class ActivateAllRanks(RankFilter):
    """Every healthy rank is active: ``active_rank = rank``, ``active_world_size = world_size``."""

    def peer_wait_s(self, barrier_timeout: float) -> float:
        return 0.0  # (computed locally)

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        ctx.state = dataclasses.replace(
            ctx.state,
            mode=Mode.ACTIVE,
            active_rank=ctx.state.rank,
            active_world_size=ctx.state.world_size,
        )
        return ctx


class MaxActiveWorldSize(RankFilter):
    """At most ``max_active_world_size`` ranks are active (the lowest ranks); the rest are spares.

    Args:
        max_active_world_size: limit, None for no limit.
    """

    def peer_wait_s(self, barrier_timeout: float) -> float:
        return 0.0  # (computed locally)

    def __init__(self, max_active_world_size: int | None = None) -> None:
        positive_int("MaxActiveWorldSize", "max_active_world_size", max_active_world_size, True)
        self.max_active_world_size = max_active_world_size

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        size = _current_active_world_size(ctx.state)
        if self.max_active_world_size is not None:
            size = min(size, self.max_active_world_size)
        return _activate_below(ctx, size)


class ActiveWorldSizeDivisibleBy(RankFilter):
    """Round the active world size down to a multiple of ``divisor``; the rest are spares.

    Args:
        divisor: the active world size is made divisible by it.
    """

    def peer_wait_s(self, barrier_timeout: float) -> float:
        return 0.0  # (computed locally)

    def __init__(self, divisor: int = 1) -> None:
        positive_int("ActiveWorldSizeDivisibleBy", "divisor", divisor)
        self.divisor = divisor

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        size = _current_active_world_size(ctx.state)
        return _activate_below(ctx, size // self.divisor * self.divisor)
