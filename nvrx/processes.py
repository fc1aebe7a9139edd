"""Process lifetime: start a process in a group of its own, stop that group, tell whether it lives.

Every process nvrx starts (training children, the store service, the node
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
import ctypes
import functools
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, Protocol

from nvrx import jobenv

log = logging.getLogger(__name__)

#: Variable naming SLURM's warning signal (``--signal=...``); default USR2, as NCCL owns USR1.
WARNING_SIGNAL_ENV = jobenv.PREEMPT_SIGNAL
DEFAULT_WARNING_SIGNAL = "USR2"
#: Seconds a stop waits after asking, and after SIGKILL, unless told otherwise.
DEFAULT_GRACE_S = 5.0
#: Seconds a stop waits at least for a SIGKILLed process to be gone.
KILL_WAIT_S = 5.0
#: Linux prctl(2) option: the signal a process gets when its parent thread dies.
_PR_SET_PDEATHSIG = 1
#: Without a pidfd there is no blocking wait for a non-child: how often to look.
_FOREIGN_POLL_S = 0.1


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


#: The signals SLURM may warn a job with (``sbatch --signal``): one that stops it (TERM) would
#: be ignored by every process nvrx starts, and one outside the supervisor's would end it.
WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def warning_signal(env: Mapping[str, str] | None = None) -> int:
    """SLURM's warning signal for this job: ``$NVRX_PREEMPT_SIGNAL``, default SIGUSR2;
    ValueError naming the variable for anything but USR1 or USR2."""
    env = os.environ if env is None else env
    name = env.get(WARNING_SIGNAL_ENV) or DEFAULT_WARNING_SIGNAL
    signum = signal_from_name(name)
    if signum not in WARNING_SIGNALS:
        raise ValueError(
            f"{WARNING_SIGNAL_ENV}={name!r}: the warning signal must be USR1 or USR2 (the one of "
            "sbatch --signal=USR2@SECONDS); TERM, INT and HUP stop the job"
        )
    return signum


def ignore_warning_signal() -> None:
    """Ignore the warning signal here and, through exec, in what this process runs.

    Runs between fork and exec (``preexec_fn``), so it touches nothing but the
    signal disposition; a bad ``NVRX_PREEMPT_SIGNAL`` falls back to USR2 there.
    A program started with ``ignore_warning=False`` may call it first thing.
    """
    try:
        signum = warning_signal()
    except ValueError:
        signum = signal.SIGUSR2
    signal.signal(signum, signal.SIG_IGN)


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, looked up before any fork (None where there is none)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _setup_child(
    ignore_warning: bool,
    parent: int | None,
    prctl: Callable[..., int] | None,
    ignored: tuple[int, ...] = (),
) -> None:
    """Between fork and exec: signal dispositions, and death with ``parent``."""
    if ignore_warning:
        ignore_warning_signal()
    for signum in ignored:
        signal.signal(signum, signal.SIG_IGN)
    if parent is not None and prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGKILL)


def start(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    ignore_warning: bool = True,
    die_with_parent: bool = False,
    ignore_signals: tuple[int, ...] = (),
    **popen_args: Any,
) -> subprocess.Popen[Any]:
    """Start ``argv`` leading a new process group (see the module docstring).

    ``popen_args`` go to ``subprocess.Popen`` (stdin, stdout, pass_fds, cwd, ...).
    Raises OSError when the command cannot be started. ``ignore_warning`` runs
    ``ignore_warning_signal`` as a ``preexec_fn``, which makes CPython fork()
    and run Python in the child before exec: from a threaded process, pass
    False and have the program ignore the signal itself. ``die_with_parent``
    has the kernel SIGKILL the process when the thread that started it dies
    (Linux ``PR_SET_PDEATHSIG``), so a supervisor killed with SIGKILL leaves no
    training process behind; ``ignore_signals`` are ignored in the process (a
    command that must finish while its job is being ended); also ``preexec_fn``.
    """
    setup = None
    if ignore_warning or die_with_parent or ignore_signals:
        parent = os.getpid() if die_with_parent else None
        setup = functools.partial(
            _setup_child,
            ignore_warning,
            parent,
            _prctl() if die_with_parent else None,
            tuple(ignore_signals),
        )
    return subprocess.Popen(
        list(argv),
        env=dict(env) if env is not None else None,
        start_new_session=True,
        preexec_fn=setup,
        **popen_args,
    )


def fork(*, ignore_warning: bool = True, die_with_parent: bool = False) -> int:
    """``os.fork`` with the rules of ``start``: 0 in the child, which leads a new process group.

    Both sides set the group, so it exists whichever runs first. ``die_with_parent``
    as for ``start``: the kernel SIGKILLs the child when the forking thread dies, and a
    child whose parent died before the request took effect ends at once.
    """
    parent = os.getpid() if die_with_parent else None
    prctl = _prctl() if die_with_parent else None  # looked up before the fork
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        _setup_child(ignore_warning, parent, prctl)
        return 0
    with contextlib.suppress(PermissionError, ProcessLookupError):
        os.setpgid(pid, pid)
    return pid


def exit_now(code: int | None) -> NoReturn:
    """End a helper program whose work is done, without the interpreter's teardown.

    With torch imported the teardown takes about half a second, and the parent
    (a rank stopping its monitor, a monitor stopping its store) waits for it.
    Our files are written with ``os.write``; stdio and log handlers are flushed here.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(0 if code is None else int(code))


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


def _orphaned_group(pgid: int) -> bool:
    """Whether group ``pgid`` lives on without a process of pid ``pgid`` (its reaped leader's).

    While any member lives, the kernel hands the id to no new process, so such
    a group is the leader's own. A process of that pid means the id was reused
    (the leader was reaped and its group emptied): not ours to signal.
    Without /proc, whether the group exists.
    """
    if not group_alive(pgid):
        return False
    if not os.path.isdir("/proc/self"):
        return True
    return not os.path.exists(f"/proc/{pgid}")


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
        while pending and deadline > time.monotonic():
            pending.difference_update(_readable(pending, deadline - time.monotonic()))
    finally:
        for fd in fds:
            os.close(fd)
    return [proc for proc in procs if proc.poll() is None]


#: ``poll`` takes at most this many milliseconds (about 24.8 days).
_POLL_MAX_MS = 2**31 - 1


def _readable(fds: Iterable[int], timeout: float) -> list[int]:
    """The descriptors of ``fds`` readable within ``timeout`` seconds (poll(2): no FD_SETSIZE
    limit; a wait longer than one ``poll`` takes is waited in several)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        left_ms = max(0.0, deadline - time.monotonic()) * 1000
        ready = poller.poll(min(left_ms, _POLL_MAX_MS))
        if ready or left_ms <= _POLL_MAX_MS:
            return [fd for fd, _ in ready]


def stop_all(
    procs: Sequence[Process],
    *,
    ask: int | None = signal.SIGTERM,
    grace_s: float = DEFAULT_GRACE_S,
    exit_by: float | None = None,
) -> list[int | None]:
    """Stop several processes and their groups together: ask, bounded wait, SIGKILL, reap.

    ``exit_by`` (a ``time.monotonic()`` instant) first gives them until then
    to exit on their own (they were told another way, e.g. a checkpoint flag).
    ``ask`` is the signal sent to each group (None: they were already asked
    another way, so only wait ``grace_s``; SIGKILL asks for an immediate end).
    Members of a group that outlive its leader are killed too, but only in a
    group that still existed when the stop began and that no process with the
    leader's pid leads once the leader is reaped: a group id whose members
    are all gone may name someone else's group by then. Returns each leader's
    return code (negative: the signal that ended it; None: it survived
    SIGKILL for ``KILL_WAIT_S``, stuck in the kernel, and is left to be reaped later).
    """
    sweep = [proc for proc in procs if proc.poll() is None or group_alive(proc.pid)]
    running = [proc for proc in procs if proc.poll() is None]
    if exit_by is not None:
        running = wait_all(running, exit_by - time.monotonic())
    if running:
        for proc in running if ask is not None else ():
            signal_group(proc.pid, ask)
        running = wait_all(running, grace_s)
    for proc in running:
        signal_group(proc.pid, signal.SIGKILL)
    for proc in wait_all(running, max(grace_s, KILL_WAIT_S)):
        # In uninterruptible sleep (a hung file system, a GPU driver): waiting on
        # would hang the caller too; its exit is reaped whenever it comes.
        log.error("process %d survived SIGKILL for %.0f s; not waiting for it", proc.pid, max(grace_s, KILL_WAIT_S))
    for proc in sweep:
        if _orphaned_group(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group
    return [proc.returncode for proc in procs]


def stop(
    proc: Process,
    *,
    ask: int | Callable[[], None] | None = signal.SIGTERM,
    grace_s: float = DEFAULT_GRACE_S,
) -> int | None:
    """Stop one process and its group (see ``stop_all``); ``ask`` may also be a callable that
    asks in its own way (closing a pipe the process reads)."""
    if callable(ask):
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                ask()
        ask = None
    return stop_all([proc], ask=ask, grace_s=grace_s)[0]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, waiting for its parent to reap it, is dead)."""
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


def boot_id() -> str | None:
    """This host's boot (the kernel's ``boot_id``): processes that share it share a host and
    its pids; None where the kernel does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _pid_namespace(pid: int | str = "self") -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def _proc_is_ours() -> bool:
    """Whether ``/proc`` shows this process's pid namespace (not one mounted for another)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _stat(pid: int) -> tuple[str, str, int] | None:
    """Process ``pid``'s state letter, start time (clock ticks since boot) and number of
    threads (fields 3, 22 and 20 of proc(5)); None when they cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return fields[0], fields[19], int(fields[17])
    except (OSError, IndexError, ValueError):
        return None


_own_identity: tuple[int, str] | None = None  # (pid, its identity): read once per process


def identity(pid: int | None = None) -> str | None:
    """A name of process ``pid`` (this one by default) that no other process has, on any host
    or at any time: its host's boot, its pid namespace, its pid and its start time. None
    where ``/proc`` does not say (``gone`` then cannot tell either). This process's own is
    read once (a forked child, another pid, reads its own)."""
    global _own_identity
    if pid is not None:
        return _identity_of(pid)
    own = _own_identity
    if own is None or own[0] != os.getpid():
        name = _identity_of(os.getpid())
        if name is None:
            return None
        own = _own_identity = (os.getpid(), name)
    return own[1]


def _identity_of(pid: int) -> str | None:
    boot, namespace, stat = boot_id(), _pid_namespace(pid), _stat(pid)
    if boot is None or namespace is None or stat is None or not _proc_is_ours():
        return None
    return f"{boot}/{namespace}/{pid}/{stat[1]}"


def gone(name: str) -> bool:
    """Whether the process of ``identity`` ``name`` is known to have ended: one of this
    host's boot and pid namespace whose pid no process has now, whose process is a zombie
    (and no thread of it runs), or a later process. False wherever that cannot be told
    here: another host or namespace, a ``/proc`` that cannot be read (another user's
    process it hides), a name that is no identity."""
    boot, namespace, pid, start = (name.split("/") + ["", "", "", ""])[:4]
    if not (pid.isdigit() and start.isdigit()) or not _proc_is_ours():
        return False
    if (boot, namespace) != (boot_id(), str(_pid_namespace())):
        return False
    stat = _stat(int(pid))
    if stat is None:
        return _no_process(int(pid))
    state, started, threads = stat
    return started != start or (state in ("Z", "X") and threads <= 1)


def _no_process(pid: int) -> bool:
    """Whether no process has ``pid`` (not: one this process may not signal)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def wait_exit(pid: int, pidfd: int | None, timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``pid`` (not necessarily our child) to exit; whether it did.

    On its pidfd when there is one; without pidfds there is no blocking wait
    for a non-child, so then it looks every ``_FOREIGN_POLL_S``.
    """
    if pidfd is not None:
        return bool(_readable([pidfd], timeout)) or not alive(pid)
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(_FOREIGN_POLL_S)
    return not alive(pid)


def stop_foreign(pid: int, pidfd: int | None, grace_s: float) -> None:
    """Stop a process that is not our child, alone (not its group): SIGCONT+SIGTERM, wait up
    to ``grace_s``, then SIGKILL until it is gone. It cannot be reaped here; its parent does.

    For a monitor ending the rank it watches: the rank need not lead a process
    group (torchrun or srun may have started it in theirs), so its group is not ours.
    SIGCONT first, so that a stopped process can act on the SIGTERM.
    """
    _send(pid, signal.SIGCONT, signal.SIGTERM)
    if wait_exit(pid, pidfd, grace_s):
        return
    log.warning("process %d still runs %.1f s after SIGTERM: SIGKILL", pid, grace_s)
    while alive(pid):
        _send(pid, signal.SIGCONT, signal.SIGTERM, signal.SIGKILL)
        wait_exit(pid, pidfd, 1.0)


def _send(pid: int, *signums: int) -> None:
    for signum in signums:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


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
                if not _readable([fd], timeout):
                    raise subprocess.TimeoutExpired(str(self.pid), timeout)
            finally:
                os.close(fd)
        _, wait_status = os.waitpid(self.pid, 0)
        return self._set(wait_status)
