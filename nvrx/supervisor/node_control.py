"""What the parts of a supervisor ask of the supervisor itself: starts, stops, events.

The parts (``node_messages``, ``job_end``, ``failover``, ``hang_watch``,
``job_restart``, ``workload_control``, ``restart_standby``) each own one
concern; starting a child (while the job does not stop), deciding on its end,
stopping the job and recording an event stay with the supervisor, which hands
itself to them as this protocol.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class NodeControl(Protocol):
    """The supervisor, as its parts see it."""

    kill_at: float | None  # when children still running get SIGKILL
    exit_code: int  # what the supervisor will exit with
    stop_reason: str | None  # why the job stops, once it does
    signalled: int | None  # the last stop signal received

    @property
    def node_rank(self) -> int | None:
        """The training node rank this slot holds; None while it waits as a spare."""
        ...

    def emit(self, kind: str, **fields: object) -> None:
        """Record one supervisor event."""
        ...

    def request_stop(self, reason: str, exit_code: int, broadcast: bool) -> None:
        """Stop every local child; tell the other nodes if ``broadcast``."""
        ...

    def declare_lost(self, report: dict[str, Any]) -> None:
        """Declare the slot of ``report`` lost as its node agent's ``node_silent`` report
        would have it (``NodeMessages``), for the ``cause`` the report names."""
        ...

    def store_unavailable(self, exc: Exception) -> None:
        """The store cannot be used (and nothing fails over): stop this node."""
        ...

    def start_child(self, local_rank: int, flag: str | None = None) -> None:
        """Start (or restart) the child of ``local_rank``; ``flag``: a jobenv variable set to 1."""
        ...

    def reap(self) -> None:
        """Record the children that ended, and decide on each."""
        ...
