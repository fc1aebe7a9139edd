"""Filters: which of the renumbered ranks run the function (active) and which wait (spares)."""

from __future__ import annotations

import dataclasses

from ..state import Mode, State
from .base import RankAssignmentCtx, RankFilter, positive_int


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

    def __init__(self, divisor: int = 1) -> None:
        positive_int("ActiveWorldSizeDivisibleBy", "divisor", divisor)
        self.divisor = divisor

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        size = _current_active_world_size(ctx.state)
        return _activate_below(ctx, size // self.divisor * self.divisor)
