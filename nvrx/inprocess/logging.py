"""Human-readable logs of the Wrapper (events go through ``nvrx.events`` instead).

The ``nvrx.inprocess`` logger gets its own stream handler and does not
propagate to the root logger, so the application's logging setup neither
swallows nor duplicates the Wrapper's messages. The monitor process logs only
to its own file (``monitor_process_logfile``, ``{rank}`` is replaced by the
initial rank), or nowhere when none is given.
"""

from __future__ import annotations

import logging
import os
import sys

from nvrx import jobenv

LOGGER_NAME = "nvrx.inprocess"
_FORMAT = "%(asctime)s nvrx.inprocess [rank %(nvrx_rank)s] %(levelname)s %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "nvrx_rank"):
            record.nvrx_rank = os.environ.get("RANK", "?")
        return True


def setup_logger(level: int | None = None) -> logging.Logger:
    """Configure the non-propagating ``nvrx.inprocess`` logger once per process."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(getattr(h, "_nvrx_inprocess", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.addFilter(_RankFilter())
        handler._nvrx_inprocess = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    if level is not None:
        logger.setLevel(level)
    return logger


def monitor_logfile_path(template: str | None, rank: int) -> str | None:
    """The monitor process's log file for ``rank``, or None when logging is off."""
    if template is None:
        return None
    return template.replace("{rank}", str(rank))


def setup_monitor_logging(path: str | None) -> None:
    """Send the monitor process's logs to ``path`` only (nothing when None)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    if path is None:
        root.addHandler(logging.NullHandler())
        return
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s nvrx.monitor %(levelname)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if jobenv.flag_in(None, jobenv.MONITOR_DEBUG) else logging.INFO)
