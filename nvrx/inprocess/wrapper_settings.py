"""What a Wrapper call reads of its ``Wrapper``: the arguments it was given, checked.

``wrap.Wrapper`` has these attributes. The parts of a call (``call_wrapper``,
``rank_services``, ``round_run``) read them through this
type, which stands below ``wrap``: none of them imports the module that
starts them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from .abort import Abort
from .completion import Completion
from .finalize import Finalize
from .health_check_base import HealthCheck
from .initialize import Initialize
from .rank_assignment import RankAssignment
from .rank_filter import RankFilter
from .terminate import Terminate


@dataclasses.dataclass
class Timings:
    """The Wrapper's periods and timeouts in seconds, as its call reads them. The Wrapper's
    attributes of the same names are ``timedelta``s, as the reference's are."""

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
    last_call_wait: float
    rejoin_timeout: float


class WrapperSettings(Protocol):
    """The Wrapper's plug-ins, store, files and timings (``seconds``), as ``Wrapper`` checked them."""

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
    seconds: Timings
