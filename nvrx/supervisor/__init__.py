"""Per-node supervision of training processes: ``nvrx-supervise`` and ``fork_and_monitor``.

Importing this package imports no torch.
"""

from .exit_codes import CLEAN_STOP_EXIT, ExitCode
from .fork_and_monitor import fork_and_monitor

__all__ = ["CLEAN_STOP_EXIT", "ExitCode", "fork_and_monitor"]
