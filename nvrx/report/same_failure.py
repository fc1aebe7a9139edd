"""When two records tell one failure: a monitor's fault and a supervisor's record of a
process end, or a process end and a node loss, close in time."""

from __future__ import annotations

from .model import ProcessRestart
from .parts import LocalFault

#: A child's exit and a fault event of the same signature and host this close are one failure.
SAME_FAILURE_WINDOW_S = 30.0


def same_process_end(fault: LocalFault, p: ProcessRestart) -> bool:
    """Whether a monitor's fault (``dead``, ``unresponsive``) and a supervisor's record of a
    process end are one failure: same host, same rank when both know it, close in time."""
    if fault.host != p.host or fault.wall is None or p.wall is None:
        return False
    if fault.rank is not None and p.rank is not None and fault.rank != p.rank:
        return False
    return abs(fault.wall - p.wall) <= SAME_FAILURE_WINDOW_S
