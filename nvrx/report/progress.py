"""Progress of reading a job's event files, on a terminal: ``read 1200/5000 event files``.

A report over thousands of files takes a while; a person at a terminal should see
that it moves. Nothing is written when the stream is not a terminal (a pipe, a
file, a test), so scripts that parse the report's stderr see only its messages.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

#: Least time between two progress lines.
EVERY_S = 0.5


class Progress:
    """Counts files read out of ``total``; rewrites one line of ``stream`` when it is a tty."""

    def __init__(
        self, total: int, stream: TextIO | None = None, every_s: float | None = None
    ) -> None:
        self.total = total
        self.done = 0
        self._stream = sys.stderr if stream is None else stream
        self._on = _is_tty(self._stream) and total > 0
        self._every_s = EVERY_S if every_s is None else every_s
        self._next = time.monotonic() + self._every_s
        self._shown = False

    def advance(self, files: int) -> None:
        """``files`` more were read; a line at most every ``every_s``."""
        self.done += files
        if self._on and time.monotonic() >= self._next:
            self._write(f"\rnvrx-report: read {self.done}/{self.total} event files")
            self._next = time.monotonic() + self._every_s

    def finish(self) -> None:
        """Clear the line, so that what comes next starts at its beginning."""
        if self._shown:
            self._write("\r\033[K")
            self._shown = False

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
            self._shown = True
        except (OSError, ValueError):  # a closed or broken terminal: stop showing
            self._on = False


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
