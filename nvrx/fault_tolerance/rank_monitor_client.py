"""NVRx's module path of the client: ``fault_tolerance.rank_monitor_client.RankMonitorClient``."""

from __future__ import annotations

from .client import RankMonitorClient, RankMonitorClientError

__all__ = ["RankMonitorClient", "RankMonitorClientError"]
