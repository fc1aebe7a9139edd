"""Process lifetime: start a process in a group of its own, stop that group, tell whether it lives.

Every process nvrx starts (training children, the store service, the store
agent, the monitor process, SLURM commands, a submitted supervisor) goes
through here, so that three rules hold everywhere:

- a started process leads a new session, so its whole group (grandchildren
  included) can be signalled and killed at once;
- SLURM's warning signal is ignored in it unless asked otherwise: SLURM sends
  ``--signal`` to every process of a job step, the default action of USR2 is to
  terminate, and only the supervisor acts on the warning;
- a stop asks first, waits a bounded time, then SIGKILLs the group and reaps
  the leader, so no zombie and no straggler is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from nvrx import jobenv

log = logging.getLogger(__name__)

#: Variable naming SLURM's warning signal (``--signal=...``); default USR2, as NCCL owns USR1.
WARNING_SIGNAL_ENV = jobenv.PREEMPT_SIGNAL
DEFAULT_WARNING_SIGNAL = "USR2"
#: Seconds a stop waits after asking, and after SIGKILL, unless told otherwise.
DEFAULT_GRACE_S = 5.0


class Process(Protocol):
    """What ``stop`` needs: ``subprocess.Popen`` or ``ForkedProcess``."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def signal_from_name(name: str, what: str = WARNING_SIGNAL_ENV) -> int:
    """``USR2``, ``SIGUSR2`` or ``12`` -> the signal number; ValueError naming ``what`` otherwise."""
    text = name.strip().upper()
    try:
        if text.isdigit():
            return int(signal.Signals(int(text)))
        return int(signal.Signals[text if text.startswith("SIG") else "SIG" + text])
    except (KeyError, ValueError):
        raise ValueError(f"{what}={name!r} is not a signal name (e.g. USR2)") from None


def warning_signal(env: Mapping[str, str] | None = None) -> int:
    """SLURM's warning signal for this job: ``$NVRX_PREEMPT_SIGNAL``, default SIGUSR2."""
    env = os.environ if env is None else env
    return signal_from_name(env.get(WARNING_SIGNAL_ENV) or DEFAULT_WARNING_SIGNAL)


def ignore_warning_signal() -> None:
    """Ignore the warning signal here and, through exec, in what this process runs.

    Runs between fork and exec (``preexec_fn``), so it touches nothing but the
    signal disposition; a bad ``NVRX_PREEMPT_SIGNAL`` falls back to USR2 there.
    """
    try:
        signum = warning_signal()
    except ValueError:
        signum = signal.SIGUSR2
    signal.signal(signum, signal.SIG_IGN)


def start(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    ignore_warning: bool = True,
    **popen_args: Any,
) -> subprocess.Popen[Any]:
    """Start ``argv`` leading a new process group (see the module docstring).

    ``popen_args`` go to ``subprocess.Popen`` (stdin, stdout, pass_fds, cwd, ...).
    Raises OSError when the command cannot be started.
    """
    return subprocess.Popen(
        list(argv),
        env=dict(env) if env is not None else None,
        start_new_session=True,
        preexec_fn=ignore_warning_signal if ignore_warning else None,
        **popen_args,
    )


def fork(*, ignore_warning: bool = True) -> int:
    """``os.fork`` with the rules of ``start``: 0 in the child, which leads a new process group.

    Both sides set the group, so it exists whichever runs first.
    """
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        if ignore_warning:
            ignore_warning_signal()
        return 0
    with contextlib.suppress(PermissionError, ProcessLookupError):
        os.setpgid(pid, pid)
    return pid


def signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to process group ``pgid``; False when the group is gone or not ours."""
    try:
        os.killpg(pgid, signum)
        return True
    except ProcessLookupError:
        return False
    except PermissionError as exc:
        log.warning("cannot signal process group %d: %s", pgid, exc)
        return False


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` still exists (an unreaped leader counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait(proc: Process, timeout: float | None) -> int | None:
    """Reap ``proc`` within ``timeout`` seconds (None: no bound); its return code, or None if still running."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def wait_all(procs: Sequence[Process], timeout: float) -> list[Process]:
    """Block until every process of ``procs`` exited, at most ``timeout`` seconds; reap them.

    Returns those still running. One blocking wait on all of them (pidfds), not a poll.
    """
    fds: dict[int, Process] = {}
    try:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    fds[os.pidfd_open(proc.pid)] = proc
        deadline = time.monotonic() + timeout
        pending = set(fds)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select(list(pending), [], [], left)
            pending.difference_update(ready)
    finally:
        for fd in fds:
            os.close(fd)
    return [proc for proc in procs if proc.poll() is None]


def stop_all(
    procs: Sequence[Process],
    *,
    ask: int | None = signal.SIGTERM,
    grace_s: float = DEFAULT_GRACE_S,
    exit_by: float | None = None,
) -> list[int]:
    """Stop several processes and their groups together: ask, bounded wait, SIGKILL, reap.

    ``exit_by`` (a ``time.monotonic()`` instant) first gives them until then
    to exit on their own (they were told another way, e.g. a checkpoint flag).
    ``ask`` is the signal sent to each group (None: they were already asked
    another way, so only wait ``grace_s``; SIGKILL asks for an immediate end).
    Members of a group that outlive its leader are killed too. Returns each
    leader's return code (negative: the signal that ended it).
    """
    running = [proc for proc in procs if proc.poll() is None]
    if exit_by is not None:
        running = wait_all(running, exit_by - time.monotonic())
    if running:
        for proc in running if ask is not None else ():
            signal_group(proc.pid, ask)
        running = wait_all(running, grace_s)
    for proc in running:
        signal_group(proc.pid, signal.SIGKILL)
    for proc in wait_all(running, grace_s):
        log.error("process %d survived SIGKILL for %.0f s; waiting for it", proc.pid, grace_s)
        proc.wait()
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group
    return [int(proc.returncode) for proc in procs if proc.returncode is not None]


def stop(
    proc: Process,
    *,
    ask: int | Callable[[], None] | None = signal.SIGTERM,
    grace_s: float = DEFAULT_GRACE_S,
) -> int:
    """Stop one process and its group (see ``stop_all``); ``ask`` may also be a callable that
    asks in its own way (closing a pipe the process reads)."""
    if callable(ask):
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                ask()
        ask = None
    return stop_all([proc], ask=ask, grace_s=grace_s)[0]


class ForkedProcess:
    """A child made by ``os.fork``, with the ``poll``/``wait`` of ``subprocess.Popen``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def _set(self, wait_status: int) -> int:
        self.returncode = os.waitstatus_to_exitcode(wait_status)
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, wait_status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self._set(wait_status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the child exits; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        if self.returncode is not None:
            return self.returncode
        if timeout is not None:
            fd = os.pidfd_open(self.pid)
            try:
                if not select.select([fd], [], [], max(0.0, timeout))[0]:
                    raise subprocess.TimeoutExpired(str(self.pid), timeout)
            finally:
                os.close(fd)
        _, wait_status = os.waitpid(self.pid, 0)
        return self._set(wait_status)
