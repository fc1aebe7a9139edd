"""A FIFO a test holds a reader on: the reader blocks in its read until the test writes."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def open_for_writing(fifo: Path, opened: list[int]) -> bool:
    """Whether some process has ``fifo`` open for reading: then its write end is opened,
    without blocking, into ``opened`` (a condition for ``wait_until``; the caller closes it)."""
    try:
        opened.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: nobody reads it yet
            raise
        return False
    return True
