"""Nested-restarter notifications: tell an outer restarter which in-process restart phase a rank is in.

The reference prints ``[NestedRestarter] name=[InProcess] state=... stage=...``
log lines for a log-parsing orchestrator. Here each transition is an nvrx
``restarter_state`` event (fields ``state``, ``stage``, ``active_rank``),
written on ``special_rank`` only (rank 0 by default; None: every rank).
Wire them as the reference's example does: ``NestedRestarterHandlingCompleted``
in ``initialize``, ``NestedRestarterHandlingStarting`` in ``abort``,
``NestedRestarterFinalized`` in ``completion``, ``NestedRestarterAborted`` in ``terminate``.
"""

from __future__ import annotations

from nvrx import events

from .abort import Abort
from .completion import Completion
from .initialize import Initialize
from .state import FrozenState
from .terminate import Terminate


class NestedRestarter:
    """Emits one ``restarter_state`` event per call on the chosen rank.

    Args:
        restarter_state: the state to report.
        restarter_stage: the stage to report, or None.
        special_rank: the rank (``state.rank``) that reports; None: every rank.
    """

    def __init__(
        self,
        restarter_state: str,
        restarter_stage: str | None = None,
        special_rank: int | None = 0,
    ) -> None:
        self.restarter_state = restarter_state
        self.restarter_stage = restarter_stage
        self.special_rank = special_rank

    def report(self, state: FrozenState, restarter_state: str, stage: str | None) -> None:
        if self.special_rank is not None and state.rank != self.special_rank:
            return
        events.emit(
            "restarter_state", state=restarter_state, stage=stage, active_rank=state.active_rank
        )

    def __call__(self, state: FrozenState) -> FrozenState:
        self.report(state, self.restarter_state, self.restarter_stage)
        return state


class NestedRestarterHandlingCompleted(NestedRestarter, Initialize):
    """Initialize step: ``initialize`` on the first round, then ``handling``/``completed``."""

    def __init__(self, special_rank: int | None = 0) -> None:
        super().__init__("handling", "completed", special_rank)
        self.first = True

    def __call__(self, state: FrozenState) -> FrozenState:
        if self.first:
            self.first = False
            self.report(state, "initialize", None)
        else:
            self.report(state, "handling", "completed")
        return state


class NestedRestarterHandlingStarting(NestedRestarter, Abort):
    """Abort step: ``handling``/``starting`` when a fault is being handled."""

    def __init__(self, special_rank: int | None = 0) -> None:
        super().__init__("handling", "starting", special_rank)


class NestedRestarterFinalized(NestedRestarter, Completion):
    """Completion step: ``finalized`` after the function returned on every rank."""

    def __init__(self, special_rank: int | None = 0) -> None:
        super().__init__("finalized", None, special_rank)


class NestedRestarterAborted(NestedRestarter, Terminate):
    """Terminate step: ``aborted`` when the rank leaves the restart loop."""

    def __init__(self, special_rank: int | None = 0) -> None:
        super().__init__("aborted", None, special_rank)


__all__ = [
    "NestedRestarter",
    "NestedRestarterAborted",
    "NestedRestarterFinalized",
    "NestedRestarterHandlingCompleted",
    "NestedRestarterHandlingStarting",
]
