"""Launcher-side hang detection for training scripts without the in-process Wrapper.

NVRx's ``fault_tolerance`` client API under nvrx: a rank started by
``nvrx-supervise`` sends heartbeats or opens and closes sections through a
``RankMonitorClient``; its supervisor declares it hung when a timeout of the
``FaultToleranceConfig`` passes, records its stack and ends it (docs/fault_tolerance.md).
"""

from __future__ import annotations

from .client import RankMonitorClient, RankMonitorClientError
from .config import FaultToleranceConfig, FaultToleranceConfigError
from .data import WorkloadAction, WorkloadControlRequest
from .timeouts import Timeouts

__all__ = [
    "FaultToleranceConfig",
    "FaultToleranceConfigError",
    "RankMonitorClient",
    "RankMonitorClientError",
    "Timeouts",
    "WorkloadAction",
    "WorkloadControlRequest",
]
