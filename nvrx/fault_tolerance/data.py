"""Workload-control requests a rank sends its supervisor (NVRx's ``fault_tolerance.data`` names)."""

from __future__ import annotations

import dataclasses
import enum


class WorkloadAction(enum.Enum):
    """What a rank asks the launcher side to do."""

    Continue = 0  # nothing: carry on
    ExcludeThisNode = 1  # this node leaves the job; it is treated as lost (spare or stop)
    ShutdownWorkload = 2  # every node stops its ranks cleanly; the job ends with exit 0


@dataclasses.dataclass(frozen=True)
class WorkloadControlRequest:
    """``action``, and ``description``: why (recorded in the events and the job's stop reason)."""

    action: WorkloadAction
    description: str = ""


__all__ = ["WorkloadAction", "WorkloadControlRequest"]
