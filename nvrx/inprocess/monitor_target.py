"""The rank process as its monitor process sees it: alive or not, and its stack.

The rank is not the monitor's child (the monitor is the rank's child), so it
cannot be reaped or waited for with ``waitpid``: its exit is awaited on a
pidfd, and a zombie counts as dead. It is signalled alone, never as a group:
it need not lead a process group (``torchrun`` or ``srun`` may have started it
in theirs), so ``nvrx.processes.signal_group`` would reach other processes
(the monitor ends it with ``nvrx.processes.stop_foreign``).
"""

from __future__ import annotations

import contextlib
import os
import select
import time

from nvrx import processes

_STACK_WAIT_S = 2.0  # longest wait for the first bytes of a stack dump
_STACK_TAIL_S = 0.2  # a dump is complete when no more bytes come for this long


def open_pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits; None where pidfds are missing."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


alive = processes.alive


def _drain(fd: int) -> None:
    """Drop leftovers of an earlier dump."""
    with contextlib.suppress(OSError):
        while select.select([fd], [], [], 0)[0] and os.read(fd, 65536):
            pass


def dump_stack(pid: int, fd: int | None, signum: int) -> str:
    """Every thread's stack of ``pid``: its faulthandler writes it into our pipe ``fd`` on ``signum``."""
    if fd is None:
        return ""
    _drain(fd)
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return ""
    chunks: list[bytes] = []
    deadline = time.monotonic() + _STACK_WAIT_S
    while True:
        wait = _STACK_TAIL_S if chunks else max(0.0, deadline - time.monotonic())
        if not select.select([fd], [], [], wait)[0]:
            break
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace")
