"""The contract of a rank assignment: its context, base classes and the shared checks."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from .. import exception
from ..state import State


class RankDiscarded(exception.RestartError):
    """Raised on a rank that the rank assignment removed from the job."""


@dataclasses.dataclass
class RankAssignmentCtx:
    """Input and output of a rank assignment step.

    Args:
        state: the Wrapper's state of this rank.
        store: the store of the current round (torch ``Store`` API).
        terminated_ranks: ranks (current ``state.rank`` numbering) that left.
    """

    state: State
    store: Any
    terminated_ranks: set[int]


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


class RankFilter(RankAssignment):
    """A rank assignment that only chooses active and inactive ranks (runs after renumbering)."""

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        raise NotImplementedError


def positive_int(owner: str, name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "an int >= 1" + (" or None" if allow_none else "")
        raise ValueError(f"{owner}: {name} must be {expected}, got {value!r}")


def group_key(key_or_fn: object | Callable[[State], object], state: State) -> str:
    key = key_or_fn(state) if callable(key_or_fn) else key_or_fn
    return str(key)
