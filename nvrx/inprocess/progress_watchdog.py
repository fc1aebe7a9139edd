"""Progress of the main thread, shared with the monitor process through a small mmap.

``ProgressBoard`` is a small shared file both processes map: the main
process writes progress timestamps, its round/rank, its phase (flags: user
code, between rounds) and the limit of a wait it is in, the monitor process
reads them. The file has no name: it is an anonymous memory file (``memfd_create``)
that the rank holds open, and the monitor process opens it through the rank's
descriptor (``/proc/<pid>/fd/<n>``, the board's ``path``). Its memory lives while a
descriptor or a mapping does and goes with the last of them, so no end of the two
processes, a SIGKILL of both included, leaves anything in ``/dev/shm`` or elsewhere.
A ``ping()`` is one 8-byte store into shared memory, with no message, lock or system
call.

``ProgressWatchdog`` proves that the main thread executes bytecode: every
``interval`` it schedules a pending call (``Py_AddPendingCall``), which the
interpreter runs in the main thread only between bytecodes; the call stamps
the board. A main thread blocked in C (a hang, with or without the GIL) stops
the stamps, and the monitor process sees their age grow. It takes the
reference's ``(rank, monitor_process, interval)``: ``monitor_process`` is the
board, or any object with ``send_timestamp(Timestamp)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import mmap
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

SIZE = 128
# The board's 8-byte fields, by index (offset / 8): each is written and read as one aligned
# 8-byte store or load through a memoryview (``struct.pack_into`` zero-fills a field before
# writing it, so a concurrent read could see 0.0 there).
AUTO, MANUAL, ROUND, RANK, WORLD_SIZE, INITIAL_RANK, FLAGS, USER_SINCE = range(8)
GENERATION = 8
WAIT_UNTIL = 9  # the limit (monotonic) of the wait the rank is in; 0.0: none
SEQUENCE = 10  # odd while the main thread changes several fields at once (a seqlock)
#: Reads a ``read`` tries for a consistent view before it yields the CPU to the writer, and
#: the time it tries for (a writer thread switched out in the middle of a change, a writer
#: that died there) before it takes the last one.
READ_TRIES = 1000
READ_WAIT_S = 0.05

FLAG_USER = 1  # the main thread runs user code (soft and hard timeouts apply)
FLAG_TIMEOUTS_OFF = 2  # disable_hang_protection() is active
FLAG_SHUTDOWN = 4  # the Wrapper ended normally: the monitor process exits quietly
# the round's iteration barrier released the rank into the next round, not started yet
FLAG_RELEASED = 8
# between two rounds (finalize, restart health check, iteration barrier, rejoin, rank
# assignment): the hard timeout applies, counted from the limit of a wait
FLAG_BETWEEN = 16
# the rank left the job and waits on at the termination barrier because its monitor hosts
# the store: the monitor beats no more (its bye: the host's agent counts it ended, and the
# job is seen moving by the others' beats only), and keeps the store should the rank die
FLAG_KEEPING = 32


def released_into_next(flags: int) -> bool:
    """Whether a board's ``flags`` say the round's iteration barrier released the rank into
    the next round, which it has not started yet: a death or a leave then belongs to that
    round (``nvrx.store.rounds.place_in_next_round``)."""
    return bool(flags & FLAG_RELEASED)


class ProgressBoard:
    """Shared progress record of one rank (see module doc); 128 bytes, 8-byte fields.

    Every field is one aligned 8-byte store or load (``memoryview`` casts of the map). The
    main thread changes several fields at once inside a sequence (``_changing``: a
    seqlock), and ``read`` retries until no such change overlapped it: the monitor never
    sees the end of a wait without the progress stamped as it ended. Stamps of one field
    alone (the watchdog's, ``ping``) need none.
    """

    def __init__(self, path: str | None = None) -> None:
        """A new board (``path`` None), or the board another process made, at its ``path``."""
        self.owner = path is None
        self._fd: int | None = None  # the maker's descriptor, open while the board is
        if path is None:
            self._fd = os.memfd_create(f"nvrx-progress-{os.getpid()}", os.MFD_CLOEXEC)
            path = f"/proc/{os.getpid()}/fd/{self._fd}"
        fd = os.open(path, os.O_RDWR) if self._fd is None else self._fd
        self.path = path
        try:
            if self.owner:
                os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        if fd != self._fd:
            os.close(fd)
        self._d = memoryview(self._map).cast("d")  # (a page-aligned map: aligned fields)
        self._q = memoryview(self._map).cast("q")
        self._flags_lock = threading.Lock()  # (only this process writes the flags)
        if self.owner:
            q = self._q
            q[ROUND], q[RANK], q[WORLD_SIZE], q[INITIAL_RANK] = 0, -1, 0, -1

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """The block changes several fields: a ``read`` meanwhile tries again."""
        self._q[SEQUENCE] += 1
        try:
            yield
        finally:
            self._q[SEQUENCE] += 1

    def read(self) -> dict[str, float]:
        """The fields, as of one moment where the main thread changed none of several fields
        (after ``READ_WAIT_S`` of tries, the last read). The flags first, the wait's limit
        before the progress stamp: a flag or the end of a wait seen comes with the
        progress stamped before it."""
        q, d, tries, deadline = self._q, self._d, 0, None
        while True:
            sequence = q[SEQUENCE]
            flags, wait_until = q[FLAGS], d[WAIT_UNTIL]
            info = {"flags": flags, "wait_until": wait_until, "auto": d[AUTO], "manual": d[MANUAL]}
            for name, i in (("round", ROUND), ("rank", RANK), ("world_size", WORLD_SIZE)):
                info[name] = q[i]
            info["initial_rank"], info["user_since"] = q[INITIAL_RANK], d[USER_SINCE]
            if not sequence & 1 and q[SEQUENCE] == sequence:
                return info
            tries += 1
            if tries % READ_TRIES:
                continue
            # a writer switched out in the middle of a change: let it run, up to READ_WAIT_S
            now = time.monotonic()
            deadline = now + READ_WAIT_S if deadline is None else deadline
            if now >= deadline:
                return info
            os.sched_yield()

    # single fields (8-byte aligned stores) ----------------------------------
    def stamp_auto(self, now: float | None = None) -> None:
        self._d[AUTO] = time.monotonic() if now is None else now

    def stamp_manual(self, now: float | None = None) -> None:
        self._d[MANUAL] = time.monotonic() if now is None else now

    def set_round(self, round_: int, rank: int | None, world_size: int, initial_rank: int) -> None:
        q = self._q
        with self._changing():
            q[ROUND], q[RANK] = round_, -1 if rank is None else rank
            q[WORLD_SIZE], q[INITIAL_RANK] = world_size, initial_rank

    def set_generation(self, generation: int) -> None:
        self._q[GENERATION] = generation

    def generation(self) -> int:
        return self._q[GENERATION]

    def _flags(self) -> int:
        return self._q[FLAGS]

    def set_flag(self, flag: int, on: bool) -> None:
        """Set or clear ``flag``; threads of the process may do so at once (the main thread
        between rounds, a user thread in ``disable_hang_protection()``): none loses
        another's change."""
        with self._flags_lock:
            flags = self._flags()
            self._q[FLAGS] = (flags | flag) if on else (flags & ~flag)

    def enter_user(self) -> None:
        """The main thread starts running user code: progress counts from now."""
        now = time.monotonic()
        with self._changing():
            self._d[MANUAL] = 0.0  # manual ping inactive until the first ping()
            self._d[AUTO] = self._d[USER_SINCE] = now
            self.set_flag(FLAG_USER, True)

    def leave_user(self) -> None:
        self.set_flag(FLAG_USER, False)

    @contextlib.contextmanager
    def between_rounds(self) -> Iterator[None]:
        """The block takes the rank from one round to the next (after a restart): progress
        counts from its start, and the monitor process ends a rank that makes none for
        ``hard_timeout`` (counted from the limit of a wait for its peers: ``waiting``)."""
        with self._changing():
            self._d[MANUAL] = 0.0  # a ping is user code's
            self._d[AUTO] = time.monotonic()
            self.set_flag(FLAG_BETWEEN, True)
        try:
            yield
        finally:
            self.set_flag(FLAG_BETWEEN, False)

    @contextlib.contextmanager
    def waiting(self, limit_s: float) -> Iterator[None]:
        """The block waits for the rank's peers (a barrier) or the round's monitor thread,
        ``limit_s`` seconds at most: no progress in it is a hang only ``hard_timeout`` after
        that limit. Progress is stamped
        as the block ends, with the limit going: a wait that outlasted ``hard_timeout`` is
        no hang the moment it ends."""
        with self._changing():
            self._d[WAIT_UNTIL] = time.monotonic() + limit_s
        try:
            yield
        finally:
            with self._changing():
                self.stamp_auto()
                self._d[WAIT_UNTIL] = 0.0

    def close(self) -> None:
        """Unmap the board; its maker also closes its descriptor (its monitor process opened
        the board before the rank's first round)."""
        self._d.release()
        self._q.release()
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_PENDING_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)

#: Bound of the pending calls in flight (the reference's name; here at most one is).
MAX_PENDING = 1024


@dataclasses.dataclass
class Timestamp:
    """Last progress seen: ``auto`` from the watchdog, ``manual`` from ``ping()`` (None: inactive).

    Times are ``time.monotonic()`` seconds.
    """

    auto: float | None = None
    manual: float | None = None

    def is_timed_out(self, timeout: datetime.timedelta | float) -> bool:
        """Whether either active timestamp is older than ``timeout``."""
        limit = (
            timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        )
        now = time.monotonic()
        return any(t is not None and now - t > limit for t in (self.auto, self.manual))


class ProgressWatchdog(threading.Thread):
    """Proves every ``interval`` that the main thread executes bytecode, and reports it.

    Args:
        rank: the rank, for the thread's name (None: unknown).
        monitor_process: where progress goes: a ``ProgressBoard`` (stamped from
            the main thread, as the Wrapper uses it), or any object with
            ``send_timestamp(Timestamp)`` (called from the watchdog thread
            after each probe, and by ``reset``/``ping``), as in the reference.
        interval: period of the probe (timedelta or seconds, > 0).
    """

    def __init__(
        self,
        rank: int | None,
        monitor_process: Any,
        interval: datetime.timedelta | float,
    ) -> None:
        super().__init__(name=f"nvrx-progress-watchdog-{rank}", daemon=True)
        if not isinstance(monitor_process, ProgressBoard) and not callable(
            getattr(monitor_process, "send_timestamp", None)
        ):
            raise TypeError(
                "ProgressWatchdog: monitor_process must be a ProgressBoard or have a "
                f"send_timestamp(Timestamp) method, got {monitor_process!r}"
            )
        seconds = interval.total_seconds() if isinstance(interval, datetime.timedelta) else interval
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            raise ValueError(f"ProgressWatchdog: interval must be > 0 seconds, got {interval!r}")
        self.rank = rank
        self.monitor_process = monitor_process
        self.interval = interval
        self._interval_s = float(seconds)
        self.board = monitor_process if isinstance(monitor_process, ProgressBoard) else None
        self.timestamp = Timestamp(auto=time.monotonic())
        self.num_scheduled = 0
        self.num_completed = 0
        self._cond = threading.Condition(threading.RLock())  # the probe may run while held
        self._pause_requested = False
        self._stop_requested = False
        self.paused = threading.Event()
        self._callback = _PENDING_CB(self._on_main_thread)

    # -- what the main thread runs --------------------------------------------------
    def _on_main_thread(self, _arg: int) -> int:
        now = time.monotonic()
        self.timestamp.auto = now
        if self.board is not None:
            self.board.stamp_auto(now)
        with self._cond:
            self.num_completed += 1
            self._cond.notify_all()
        return 0

    # -- reporting ----------------------------------------------------------------------
    def send(self) -> None:
        """Report the current timestamp (a board keeps its own; only a sink is sent to)."""
        if self.board is None:
            self.monitor_process.send_timestamp(dataclasses.replace(self.timestamp))

    def reset(self) -> None:
        """Progress starts now; the manual timestamp becomes inactive until the next ``ping``."""
        self.timestamp = Timestamp(auto=time.monotonic())
        if self.board is not None:
            self.board.stamp_auto(self.timestamp.auto)
            self.board.stamp_manual(0.0)
        self.send()

    def ping(self) -> None:
        """Manual progress: stamps (and activates) the manual timestamp."""
        self.timestamp.manual = time.monotonic()
        if self.board is not None:
            self.board.stamp_manual(self.timestamp.manual)
        self.send()

    # -- the thread -----------------------------------------------------------------------
    def run(self) -> None:
        add_pending = ctypes.pythonapi.Py_AddPendingCall
        add_pending.argtypes = [_PENDING_CB, ctypes.c_void_p]
        add_pending.restype = ctypes.c_int
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop_requested, self._interval_s)
                # paused: wait (no probe) until resumed or stopped
                self._cond.wait_for(lambda: not self._pause_requested or self._stop_requested)
                if self._stop_requested:
                    return
                # Only schedule when the previous call ran: a stalled main thread
                # must not fill the interpreter's pending-call queue.
                if self.num_completed == self.num_scheduled:
                    if add_pending(self._callback, None) == 0:
                        self.num_scheduled += 1
            if self.board is None:
                self.send()

    def pause_and_synchronize(self) -> None:
        """Stop probing, and return once no probe is pending (the timestamp is then reset).

        From the main thread the pending probe is run here; from another
        thread this waits until the main thread ran it.
        """
        with self._cond:
            self._pause_requested = True
            self._cond.notify_all()
        if threading.current_thread() is threading.main_thread():
            ctypes.pythonapi.Py_MakePendingCalls()
        with self._cond:
            self._cond.wait_for(lambda: self.num_completed == self.num_scheduled)
        self.paused.set()
        self.reset()

    def spin_till_paused(self) -> None:
        """Main thread: wait until another thread paused the watchdog.

        Waits in slices of the switch interval: the pause needs the main thread
        to run the pending probe, which it only does between bytecodes.
        """
        while not self.paused.wait(sys.getswitchinterval()):
            pass

    def resume(self) -> None:
        """Probe again after ``pause_and_synchronize``."""
        if not self.is_alive():
            raise RuntimeError("ProgressWatchdog.resume: the watchdog thread is not running")
        self.paused.clear()
        with self._cond:
            self._pause_requested = False
            self._cond.notify_all()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the thread and join it (``timeout`` seconds at most)."""
        with self._cond:
            self._stop_requested = True
            self._cond.notify_all()
        if self.is_alive():
            self.join(timeout)
