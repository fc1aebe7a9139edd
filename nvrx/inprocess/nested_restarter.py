"""Nested-restarter notifications: tell an outer restarter which in-process restart phase a rank is in.

An outer, log-parsing orchestrator (NVRx's in-job restarter) follows lines
``[NestedRestarter] name=[InProcess] state=<state> stage=<stage>`` on stdout.
``NestedRestarterCallback`` prints such a line through ``NestedRestarterLogger``
and also writes an nvrx ``restarter_state`` event (fields ``state``, ``stage``,
``active_rank``), on the rank whose ``initial_rank`` is ``special_rank`` (0 by
default; None: every rank). Wire the steps as the reference's example does:
``NestedRestarterHandlingCompleted`` in ``initialize``,
``NestedRestarterHandlingStarting`` in ``abort``, ``NestedRestarterFinalized``
in ``completion``, ``NestedRestarterAborted`` in ``terminate``.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys

from nvrx import events

from .abort import Abort
from .completion import Completion
from .initialize import Initialize
from .state import FrozenState
from .terminate import Terminate


class _StdoutHandler(logging.StreamHandler):
    """Writes to the ``sys.stdout`` of the moment (it may be replaced after the handler exists)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout  # not setStream: that flushes the previous, maybe closed, stream
        super().emit(record)


class NestedRestarterLogger(logging.Logger):
    """Logger of the nested-restarter lines: every line goes to stdout, whatever the log levels.

    Not registered with ``logging.getLogger`` and not propagating, so the
    application's logging setup neither hides nor duplicates the lines.
    """

    def __init__(self) -> None:
        super().__init__("InprocessRestarter", logging.DEBUG)
        self.hostname = socket.gethostname()
        self.rank: int | None = None
        self.propagate = False
        self._handler = _StdoutHandler(sys.stdout)
        self.addHandler(self._handler)
        self.set_connected_rank(None)

    def set_connected_rank(self, rank: int | None) -> None:
        """The rank the lines are about (kept in ``rank``; the lines name the reference's
        restarter logger, ``<name>.Restarter``, not the rank, as the reference's do)."""
        self.rank = rank
        who = f"{self.name}.Restarter"
        self._handler.setFormatter(logging.Formatter(f"[%(asctime)s] [ALWAYS] [{who}] %(message)s"))

    def log_for_restarter(self, message: str, *args: object, **kwargs: object) -> None:
        """Print one line for the outer restarter."""
        self.log(logging.CRITICAL, message, *args, **kwargs)  # type: ignore[arg-type]


_shared: NestedRestarterLogger | None = None


def shared_logger() -> NestedRestarterLogger:
    """The logger every callback uses unless given one (created on first use, not at import)."""
    global _shared
    if _shared is None:
        _shared = NestedRestarterLogger()
    return _shared


@dataclasses.dataclass
class NestedRestarterCallback:
    """Reports ``restarter_state``/``restarter_stage`` for the outer restarter on each call.

    Args:
        restarter_state: the state to report.
        restarter_stage: the stage to report, or None.
        logger: where the line goes; None: the shared ``NestedRestarterLogger``.
        special_rank: the ``initial_rank`` that reports; None: every rank.
    """

    restarter_state: str
    restarter_stage: str | None = None
    logger: NestedRestarterLogger | None = None
    special_rank: int | None = 0

    def report(self, state: FrozenState, restarter_state: str, stage: str | None) -> None:
        if self.special_rank is not None and state.initial_rank != self.special_rank:
            return
        logger = self.logger if self.logger is not None else shared_logger()
        logger.set_connected_rank(state.initial_rank)
        line = f"[NestedRestarter] name=[InProcess] state={restarter_state}"
        logger.log_for_restarter(line if stage is None else f"{line} stage={stage}")
        events.emit(
            "restarter_state", state=restarter_state, stage=stage, active_rank=state.active_rank
        )

    def __call__(self, state: FrozenState) -> FrozenState:
        self.report(state, self.restarter_state, self.restarter_stage)
        return state


#: The older name of ``NestedRestarterCallback``.
NestedRestarter = NestedRestarterCallback


class NestedRestarterHandlingCompleted(NestedRestarterCallback, Initialize):
    """Initialize step: ``initialize`` on the first round, then ``handling``/``completed``."""

    def __init__(self, special_rank: int | None = 0) -> None:
        super().__init__("initialize", None, None, special_rank)
        self.first = True

    def __call__(self, state: FrozenState) -> FrozenState:
        if self.first:
            self.first = False
            self.report(state, "initialize", None)
        else:
            self.restarter_state, self.restarter_stage = "handling", "completed"
            self.report(state, "handling", "completed")
        return state


@dataclasses.dataclass
class NestedRestarterHandlingStarting(NestedRestarterCallback, Abort):
    """Abort step: ``handling``/``starting`` when a fault is being handled."""

    restarter_state: str = "handling"
    restarter_stage: str | None = "starting"


@dataclasses.dataclass
class NestedRestarterFinalized(NestedRestarterCallback, Completion):
    """Completion step: ``finalized`` after the function returned on every rank."""

    restarter_state: str = "finalized"


@dataclasses.dataclass
class NestedRestarterAborted(NestedRestarterCallback, Terminate):
    """Terminate step: ``aborted`` when the rank leaves the restart loop."""

    restarter_state: str = "aborted"


__all__ = [
    "NestedRestarter",
    "NestedRestarterAborted",
    "NestedRestarterCallback",
    "NestedRestarterFinalized",
    "NestedRestarterHandlingCompleted",
    "NestedRestarterHandlingStarting",
    "NestedRestarterLogger",
    "shared_logger",
]
