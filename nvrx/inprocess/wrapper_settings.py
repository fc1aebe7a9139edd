"""What a Wrapper call reads of its ``Wrapper``: the arguments it was given, checked.

``wrap.Wrapper`` has these attributes. The parts of a call (``call_wrapper``,
``rank_services``, ``round_run``) read them through this
type, which stands below ``wrap``: none of them imports the module that
starts them.
"""

from __future__ import annotations

from typing import Any, Protocol

from .abort import Abort
from .completion import Completion
from .finalize import Finalize
from .health_check_base import HealthCheck
from .initialize import Initialize
from .rank_assignment import RankAssignment
from .rank_filter import RankFilter
from .terminate import Terminate


class WrapperSettings(Protocol):
    """The Wrapper's plug-ins, store, files and timings (seconds), as ``Wrapper`` checked them."""

    store_factory: type
    store_kwargs: dict[str, Any]
    initialize: Initialize | None
    abort: Abort | None
    finalize: Finalize | None
    health_check: HealthCheck | None
    rank_assignment: RankAssignment
    rank_filter: RankFilter | None  # old style: runs after ``rank_assignment``
    completion: Completion | None
    terminate: Terminate | None
    monitor_process_logfile: str | None
    monitor_process_pidfile: str | None
    monitor_thread_interval: float
    monitor_process_interval: float
    heartbeat_interval: float
    progress_watchdog_interval: float
    soft_timeout: float
    hard_timeout: float
    heartbeat_timeout: float
    barrier_timeout: float
    completion_timeout: float
    termination_grace_time: float
    rejoin_timeout: float
