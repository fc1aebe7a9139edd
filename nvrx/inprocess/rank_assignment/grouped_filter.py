"""Terminate whole groups of ranks (a node, a rack) whose count of healthy ranks fails a condition."""

from __future__ import annotations

import datetime
from collections.abc import Callable

from nvrx.store.barrier import barrier

from ..finalize import as_seconds
from ..state import State
from .base import RankAssignment, RankAssignmentCtx, group_key, terminated_set


class FilterCountGroupedByKey(RankAssignment):
    """Mark whole groups terminated when their count of healthy ranks fails ``condition``.

    Ranks are grouped by ``key_or_fn`` (a key, or a function of the State);
    each healthy rank counts itself into its group, and every rank of a group
    whose count makes ``condition(count)`` false is added to
    ``terminated_ranks``. A later step (e.g. ``ShiftRanks``) discards them.
    Coordination uses ``add``/``set``/``get``/``wait``/``multi_get`` and
    ``nvrx.store.barrier.barrier``, not the store object's own ``barrier``
    method (which a store class such as ``StoreMixin`` redefines).

    Args:
        key_or_fn: grouping key, or a function ``State -> str``; a key that is not a
            string (an int, say) groups by its ``str()``, as in the reference.
        condition: ``int -> bool``; False terminates the group's ranks.
        timeout: limit for each of the two barriers (timedelta or seconds).
    """

    instance_count = 0

    def __init__(
        self,
        key_or_fn: object | Callable[[State], object],
        condition: Callable[[int], bool],
        timeout: datetime.timedelta | float = datetime.timedelta(seconds=60),
    ) -> None:
        if not callable(condition):
            raise TypeError(
                f"FilterCountGroupedByKey: condition must be callable, got {condition!r}"
            )
        self._timeout_s = as_seconds(timeout, "FilterCountGroupedByKey timeout")
        self._key_of_state = key_or_fn
        self.key_or_fn = key_or_fn
        self.condition = condition
        self.timeout = timeout
        self.name = f"{type(self).__name__}_{type(self).instance_count}"
        type(self).instance_count += 1

    def peer_wait_s(self, barrier_timeout: float) -> float:
        return 2 * self._timeout_s  # its two barriers

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        terminated = terminated_set(ctx.terminated_ranks)
        rank = ctx.state.rank
        if rank is None or rank in terminated:
            ctx.terminated_ranks = terminated
            return ctx
        store = ctx.store
        alive = [r for r in range(ctx.state.world_size) if r not in terminated]
        ns = f"nvrx_filter/{self.name}/it{ctx.state.iteration}"
        key = group_key(self._key_of_state, ctx.state)

        store.add(f"{ns}/count/{key}", 1)
        barrier(store, f"{ns}/counted", rank, len(alive), self._timeout_s, participants=alive)
        count = int(store.add(f"{ns}/count/{key}", 0))
        if not self.condition(count):
            slot = int(store.add(f"{ns}/bad_n", 1))
            store.set(f"{ns}/bad/{slot}", str(rank))
        barrier(store, f"{ns}/judged", rank, len(alive), self._timeout_s, participants=alive)
        n_bad = int(store.add(f"{ns}/bad_n", 0))
        bad: set[int] = set()
        if n_bad:
            bad = terminated_set(store.multi_get([f"{ns}/bad/{i}" for i in range(1, n_bad + 1)]))
        ctx.terminated_ranks = terminated | bad
        return ctx


class FilterGroupedByKey(FilterCountGroupedByKey):
    """The older name of ``FilterCountGroupedByKey``, whose ``key_or_fn`` takes ``(rank, world_size)``.

    Args:
        key_or_fn: grouping key, or a function ``(rank, world_size) -> str``.
        condition: ``int -> bool``; False terminates the group's ranks.
        timeout: limit for each of the two barriers (timedelta or seconds).
    """

    def __init__(
        self,
        key_or_fn: object | Callable[[int, int], object],
        condition: Callable[[int], bool],
        timeout: datetime.timedelta | float = datetime.timedelta(seconds=60),
    ) -> None:
        if callable(key_or_fn):
            by_rank = key_or_fn

            def key_of(state: State) -> str:
                return by_rank(state.rank, state.world_size)

            super().__init__(key_of, condition, timeout)
        else:
            super().__init__(key_or_fn, condition, timeout)
        self.key_or_fn = key_or_fn
