"""In-process restart: re-run a distributed training function after a fault on any rank.

The public API follows ``nvidia_resiliency_ext.inprocess`` (same names,
parameters and defaults), so code written for it runs after changing the
import. See docs/inprocess.md for the differences (fixed reference bugs).
"""

from . import (
    abort,
    completion,
    exception,
    finalize,
    health_check,
    initialize,
    monitor_thread,
    nested_restarter,
    rank_assignment,
    state,
    store,
    terminate,
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
    "completion",
    "exception",
    "finalize",
    "health_check",
    "initialize",
    "monitor_thread",
    "nested_restarter",
    "rank_assignment",
    "state",
    "store",
    "terminate",
]
