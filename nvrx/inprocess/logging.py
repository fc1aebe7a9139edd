"""Human-readable logs of the Wrapper (events go through ``nvrx.events`` instead).

During a Wrapper call the ``nvrx.inprocess`` logger has its own stream handler
and does not propagate to the root logger, so the application's logging setup
neither swallows nor duplicates the Wrapper's messages; when the call ends the
logger is put back as it was (``release_logger``). The monitor process logs only
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


#: Wrapper calls in progress that set the logger up; the last to end puts it back.
_users = 0
#: The logger's ``propagate`` and level before the first of them.
_before: tuple[bool, int] | None = None


def setup_logger(level: int | None = None) -> logging.Logger:
    """Configure the non-propagating ``nvrx.inprocess`` logger for one Wrapper call;
    ``release_logger()`` undoes it when the call ends."""
    global _users, _before
    logger = logging.getLogger(LOGGER_NAME)
    if not any(getattr(h, "_nvrx_inprocess", False) for h in logger.handlers):
        _before = (logger.propagate, logger.level)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.addFilter(_RankFilter())
        handler._nvrx_inprocess = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    _users += 1
    if level is not None:
        logger.setLevel(level)
    return logger


def release_logger() -> None:
    """End one ``setup_logger()``: after the last call in progress, the logger has no handler of
    nvrx and its ``propagate`` and level are what they were before."""
    global _users, _before
    _users = max(0, _users - 1)
    if _users:
        return
    logger = logging.getLogger(LOGGER_NAME)
    for handler in [h for h in logger.handlers if getattr(h, "_nvrx_inprocess", False)]:
        logger.removeHandler(handler)
        handler.close()
    if _before is not None:
        logger.propagate, level = _before
        logger.setLevel(level)
        _before = None


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
