"""The rank process as its monitor process sees it: alive or not, its stack, its termination.

The rank is not the monitor's child (the monitor is the rank's child), so it
cannot be reaped or waited for with ``waitpid``: its exit is awaited on a
pidfd, and a zombie counts as dead. It is signalled alone, never as a group:
it need not lead a process group (``torchrun`` or ``srun`` may have started it
in theirs), so ``nvrx.processes.signal_group`` would reach other processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import time

log = logging.getLogger(__name__)

_STACK_WAIT_S = 2.0  # longest wait for the first bytes of a stack dump
_STACK_TAIL_S = 0.2  # a dump is complete when no more bytes come for this long
_POLL_S = 0.1  # without a pidfd there is no blocking wait for a non-child


def open_pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits; None where pidfds are missing."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, waiting for its parent to reap it, is dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_exit(pid: int, pidfd: int | None, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``pid`` to exit; whether it did."""
    if pidfd is not None:
        return bool(select.select([pidfd], [], [], timeout)[0]) or not alive(pid)
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return not alive(pid)


def _send(pid: int, *signums: int) -> None:
    for signum in signums:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def terminate(pid: int, pidfd: int | None, grace_s: float) -> None:
    """SIGCONT+SIGTERM, wait up to ``grace_s`` for the exit, then SIGKILL until it is gone.

    SIGCONT first, so that a stopped rank can act on the SIGTERM.
    """
    _send(pid, signal.SIGCONT, signal.SIGTERM)
    if wait_exit(pid, pidfd, grace_s):
        return
    log.warning("rank process %d still runs %.1f s after SIGTERM: SIGKILL", pid, grace_s)
    while alive(pid):
        _send(pid, signal.SIGCONT, signal.SIGTERM, signal.SIGKILL)
        wait_exit(pid, pidfd, 1.0)


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
