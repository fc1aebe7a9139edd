"""Deprecated rank filters, kept so that older code runs; use ``rank_assignment`` instead.

Each class warns with ``DeprecationWarning`` when constructed and forwards to
its ``rank_assignment`` counterpart. Old-style filters take and return a State.
``Wrapper(rank_filter=...)`` runs one after every rank assignment through
``AfterAssignment``.
"""

from __future__ import annotations

import abc
import warnings

from . import rank_assignment
from .state import State


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"nvrx.inprocess.rank_filter.{old} is deprecated; use nvrx.inprocess.rank_assignment.{new}",
        DeprecationWarning,
        stacklevel=3,
    )


class RankFilter(abc.ABC):
    """Deprecated: ``__call__(State) -> State`` choosing active ranks; see ``rank_assignment.RankFilter``."""

    @abc.abstractmethod
    def __call__(self, state: State) -> State:
        raise NotImplementedError


class _Forwarding(RankFilter):
    impl: rank_assignment.RankFilter

    def __call__(self, state: State) -> State:
        ctx = rank_assignment.RankAssignmentCtx(state=state, store=None, terminated_ranks=set())
        return self.impl(ctx).state


class MaxActiveWorldSize(_Forwarding):
    """Deprecated alias of ``rank_assignment.MaxActiveWorldSize``."""

    def __init__(self, max_active_world_size: int | None = None) -> None:
        _deprecated("MaxActiveWorldSize", "MaxActiveWorldSize")
        self.impl = rank_assignment.MaxActiveWorldSize(max_active_world_size)


class ActiveWorldSizeDivisibleBy(_Forwarding):
    """Deprecated alias of ``rank_assignment.ActiveWorldSizeDivisibleBy``."""

    def __init__(self, divisor: int = 1) -> None:
        _deprecated(type(self).__name__, "ActiveWorldSizeDivisibleBy")
        self.impl = rank_assignment.ActiveWorldSizeDivisibleBy(divisor)


class WorldSizeDivisibleBy(ActiveWorldSizeDivisibleBy):
    """Deprecated older name of ``ActiveWorldSizeDivisibleBy``."""


class AfterAssignment(rank_assignment.RankAssignment):
    """Run ``assignment``, then the old-style ``rank_filter`` on the State it produced.

    This is how ``Wrapper(rank_filter=...)`` runs the filter: after every rank
    assignment (the first one and the one of each restart), as the reference did.
    """

    def __init__(self, assignment: rank_assignment.RankAssignment, rank_filter: RankFilter) -> None:
        self.assignment = assignment
        self.rank_filter = rank_filter

    def peer_wait_s(self, barrier_timeout: float) -> float:
        """That of ``assignment``: an old-style ``rank_filter`` sees only the State."""
        return rank_assignment.assignment_wait_s(self.assignment, barrier_timeout)

    def __call__(self, ctx: rank_assignment.RankAssignmentCtx) -> rank_assignment.RankAssignmentCtx:
        ctx = self.assignment(ctx)
        state = self.rank_filter(ctx.state)
        if not isinstance(state, State):
            raise TypeError(f"rank_filter {self.rank_filter!r} must return a State, got {state!r}")
        ctx.state = state
        return ctx


def with_rank_filter(
    assignment: rank_assignment.RankAssignment, rank_filter: RankFilter | None
) -> rank_assignment.RankAssignment:
    """``assignment``, followed by the old-style ``rank_filter`` when there is one: the rank
    assignment a Wrapper runs (its ``rank_assignment`` attribute stays the one it was given,
    as in the reference)."""
    return assignment if rank_filter is None else AfterAssignment(assignment, rank_filter)


__all__ = [
    "ActiveWorldSizeDivisibleBy",
    "AfterAssignment",
    "MaxActiveWorldSize",
    "RankFilter",
    "WorldSizeDivisibleBy",
    "with_rank_filter",
]
