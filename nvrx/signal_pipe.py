"""Signals as bytes on a self-pipe: handlers do nothing, the main loop does the work.

``signal.set_wakeup_fd`` makes the C-level handler write each signal's number
to a pipe; the Python handlers installed here are no-ops, so no work ever runs
inside a handler and a blocked ``select`` wakes up at once. Both matter: the kernel
hands a signal sent to a process to any of its threads, and Python runs its handler
only on the main thread once that thread runs Python again (never, for a main thread
blocked in a lock); and a handler that takes a lock (``threading.Event.set``) deadlocks
when a second signal comes while it holds it. The supervisor's loop and the store
service wait on this pipe.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from types import FrameType

#: Signals that stop the supervisor's job: scancel, time limit, preemption, Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Signals a supervisor passes on to its children unchanged (SLURM's --signal warnings).
FORWARD_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """Python-level handler that does nothing: the wakeup fd already carries the signal."""


class SignalPipe:
    """Route ``signals`` to a non-blocking pipe; ``fileno()`` to select on, ``read()`` to drain."""

    def __init__(self, signals: Iterable[int]) -> None:
        self._signals = tuple(signals)
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._previous: dict[int, object] = {}
        self._previous_fd: int | None = None

    def install(self) -> SignalPipe:
        """Install the handlers (main thread only)."""
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for signum in self._signals:
            self._previous[signum] = signal.signal(signum, _ignore)
        return self

    def fileno(self) -> int:
        return self._read_fd

    def read(self) -> list[int]:
        """Signals received since the last read, in order."""
        received: list[int] = []
        while True:
            try:
                chunk = os.read(self._read_fd, 512)
            except BlockingIOError:
                break
            if not chunk:
                break
            received.extend(chunk)
        return received

    def restore(self) -> None:
        """Put the previous handlers back and close the pipe."""
        for signum, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if self._previous_fd is not None:
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._previous_fd)
            self._previous_fd = None
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
