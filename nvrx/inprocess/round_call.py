"""What a restart round reads and changes of the call it belongs to.

``call_wrapper.CallWrapper`` is such a call. ``round_run`` (one round) and
``between_rounds`` (what follows a round) work on it through this type,
which stands below ``call_wrapper``: the call runs its rounds, and the rounds
do not import the call.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from nvrx import events

from .monitor_thread import Delivery
from .rank_assignment import RankAssignment
from .rank_services import RankServices
from .state import State
from .wrapper_settings import WrapperSettings


class RoundCall(Protocol):
    """One call of a wrapped function, as its rounds see it."""

    wrapper: WrapperSettings
    assignment: RankAssignment  # the rank assignment, then an old-style rank filter
    state: State
    initial_rank: int
    initial_world_size: int
    writer: events.EventWriter
    services: RankServices
    delivery: Delivery
    store: Any  # the store of the current round
    round: int
    generation: int
    pending_latency_from: float | None  # when the fault behind a restart was seen

    def emit(self, kind: str, **fields: Any) -> None: ...

    def phase(self, phase: str) -> AbstractContextManager[None]: ...

    def enter_round(self, round_: int) -> None: ...

    def arguments_for(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]: ...


def forged_reporter(call: RoundCall) -> Callable[[str, int], None]:
    """What a barrier or a signal of the round protocol calls when this rank's own value took
    the place of a forged one (``rounds.OnForged``): one ``rejected_write`` event."""

    def report(key: str, value_bytes: int) -> None:
        call.emit(
            "rejected_write",
            key=key,
            reason="a barrier's value with no valid seal: not written by this job's "
            "processes here (forged, or copied from another key, round or run)",
            value_bytes=value_bytes,
        )

    return report
