"""Renumbering: close the gaps that terminated ranks leave, so the healthy ranks are 0..n-1."""

from __future__ import annotations

import dataclasses

from .base import RankAssignment, RankAssignmentCtx, RankDiscarded, terminated_set


class ShiftRanks(RankAssignment):
    """Close the gaps of terminated ranks by shifting the higher ranks down; order is kept.

    ``0 X 2 3 X X 6 7`` becomes ``0 2 3 6 7`` (new ranks 0..4).
    """

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        terminated = terminated_set(ctx.terminated_ranks)
        rank = ctx.state.rank
        if rank is None or rank in terminated:
            raise RankDiscarded(
                f"rank {rank} is terminated (terminated ranks: {sorted(terminated)})"
            )
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

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        terminated = terminated_set(ctx.terminated_ranks)
        rank = ctx.state.rank
        if rank is None or rank in terminated:
            raise RankDiscarded(
                f"rank {rank} is terminated (terminated ranks: {sorted(terminated)})"
            )
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
