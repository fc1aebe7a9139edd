"""In-process restart: re-run a distributed training function after a fault on any rank.

The public API follows ``nvidia_resiliency_ext.inprocess``: the same names
under the same module paths, with the same parameters and defaults, except
what the compatibility table of docs/inprocess.md marks ``internal`` (the
monitor process, the sibling monitor and ``param_utils``); the table also says
where behaviour differs on purpose (``fixed``).
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .compose import Compose
    from .kept_state import KeptState, RngState
    from .state import FrozenState, Mode, State
    from .wrap import CallWrapper, Wrapper

#: Public names and the submodule each comes from. Nothing is imported with the package:
#: the monitor process imports its own modules of it without torch (``nvrx.monitor_boot``).
_NAMES = {
    "CallWrapper": "wrap",
    "Compose": "compose",
    "FrozenState": "state",
    "KeptState": "kept_state",
    "Mode": "state",
    "RngState": "kept_state",
    "State": "state",
    "Wrapper": "wrap",
}

__all__ = [
    "CallWrapper",
    "Compose",
    "FrozenState",
    "KeptState",
    "Mode",
    "RngState",
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
    "kept_state",
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


def __getattr__(name: str) -> object:
    """A public name, or any submodule, imported when first asked for."""
    if name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
        globals()[name] = value  # asked for once
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the submodule exists, but something it imports does not
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
