"""In-process restart: re-run a distributed training function after a fault on any rank.

The public API follows ``nvidia_resiliency_ext.inprocess``: the same names
under the same module paths, with the same parameters and defaults, except
what the compatibility table of docs/inprocess.md marks ``internal`` (the
monitor thread and process, the sibling monitor, the store's round protocol,
``param_utils`` and ``utils``) or ``missing`` (the chained NVML/NIC health
checks); the table also says where behaviour differs on purpose.
"""

from . import (
    abort,
    attribution,
    completion,
    compose,
    exception,
    finalize,
    health_check,
    initialize,
    monitor_thread,
    nested_restarter,
    progress_watchdog,
    rank_assignment,
    rank_filter,
    state,
    store,
    terminate,
    tools,
)
from .compose import Compose
from .state import FrozenState, Mode, State
from .wrap import CallWrapper, Wrapper

__all__ = [
    "CallWrapper",
    "Compose",
    "FrozenState",
    "Mode",
    "State",
    "Wrapper",
    "abort",
    "attribution",
    "completion",
    "compose",
    "exception",
    "finalize",
    "health_check",
    "initialize",
    "monitor_thread",
    "nested_restarter",
    "progress_watchdog",
    "rank_assignment",
    "rank_filter",
    "state",
    "store",
    "terminate",
    "tools",
]
