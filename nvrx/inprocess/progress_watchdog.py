"""Progress of the main thread, shared with the monitor process through a small mmap.

``ProgressBoard`` is a small shared file both processes map: the main
process writes progress timestamps and its round/rank/phase, the monitor
process reads them. A ``ping()`` is one 8-byte store into shared memory, with
no message, lock or system call.

``ProgressWatchdog`` proves that the main thread executes bytecode: every
``interval`` it schedules a pending call (``Py_AddPendingCall``), which the
interpreter runs in the main thread only between bytecodes; the call stamps
the board. A main thread blocked in C (a hang, with or without the GIL) stops
the stamps, and the monitor process sees their age grow.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import struct
import tempfile
import threading
import time

log = logging.getLogger(__name__)

_LAYOUT = struct.Struct(
    "<ddqqqqqd"
)  # auto, manual, round, rank, world_size, initial_rank, flags, user_since
SIZE = 128
_GENERATION_OFFSET = 64

FLAG_USER = 1  # the main thread runs user code (timeouts apply)
FLAG_TIMEOUTS_OFF = 2  # disable_hang_protection() is active
FLAG_SHUTDOWN = 4  # the Wrapper ended normally: the monitor process exits quietly


class ProgressBoard:
    """Shared progress record of one rank (see module doc); 128 bytes, 8-byte fields."""

    def __init__(self, path: str | None = None) -> None:
        self.owner = path is None
        if path is None:
            directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path = tempfile.mkstemp(prefix="nvrx-progress-", dir=directory)
            os.ftruncate(fd, SIZE)
        else:
            fd = os.open(path, os.O_RDWR)
        self.path = path
        try:
            self._map = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if self.owner:
            self._write(0.0, 0.0, 0, -1, 0, -1, 0, 0.0)

    def _write(self, *values: float) -> None:
        _LAYOUT.pack_into(self._map, 0, *values)

    def read(self) -> dict[str, float]:
        auto, manual, round_, rank, ws, irank, flags, since = _LAYOUT.unpack_from(self._map, 0)
        return {
            "auto": auto,
            "manual": manual,
            "round": round_,
            "rank": rank,
            "world_size": ws,
            "initial_rank": irank,
            "flags": flags,
            "user_since": since,
        }

    # single fields (8-byte aligned stores) ----------------------------------
    def stamp_auto(self, now: float | None = None) -> None:
        struct.pack_into("<d", self._map, 0, time.monotonic() if now is None else now)

    def stamp_manual(self, now: float | None = None) -> None:
        struct.pack_into("<d", self._map, 8, time.monotonic() if now is None else now)

    def set_round(self, round_: int, rank: int | None, world_size: int, initial_rank: int) -> None:
        struct.pack_into(
            "<qqqq", self._map, 16, round_, -1 if rank is None else rank, world_size, initial_rank
        )

    def set_generation(self, generation: int) -> None:
        struct.pack_into("<q", self._map, _GENERATION_OFFSET, generation)

    def generation(self) -> int:
        return struct.unpack_from("<q", self._map, _GENERATION_OFFSET)[0]

    def _flags(self) -> int:
        return struct.unpack_from("<q", self._map, 48)[0]

    def set_flag(self, flag: int, on: bool) -> None:
        flags = self._flags()
        struct.pack_into("<q", self._map, 48, (flags | flag) if on else (flags & ~flag))

    def enter_user(self) -> None:
        """The main thread starts running user code: progress counts from now."""
        now = time.monotonic()
        struct.pack_into(
            "<dd", self._map, 0, now, 0.0
        )  # manual ping inactive until the first ping()
        struct.pack_into("<d", self._map, 56, now)
        self.set_flag(FLAG_USER, True)

    def leave_user(self) -> None:
        self.set_flag(FLAG_USER, False)

    def close(self) -> None:
        try:
            self._map.close()
        except (BufferError, ValueError):
            pass
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


_PENDING_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class ProgressWatchdog(threading.Thread):
    """Stamps ``board`` from the main thread's eval loop every ``interval`` seconds."""

    def __init__(self, board: ProgressBoard, interval: float) -> None:
        super().__init__(name="nvrx-progress-watchdog", daemon=True)
        self.board = board
        self.interval = interval
        self._stop_event = threading.Event()
        self._pending = threading.Semaphore(1)  # at most one pending call in flight
        self._callback = _PENDING_CB(self._on_main_thread)

    def _on_main_thread(self, _arg: int) -> int:
        self.board.stamp_auto()
        self._pending.release()
        return 0

    def run(self) -> None:
        add_pending = ctypes.pythonapi.Py_AddPendingCall
        add_pending.argtypes = [_PENDING_CB, ctypes.c_void_p]
        add_pending.restype = ctypes.c_int
        while not self._stop_event.wait(self.interval):
            # Only schedule when the previous call ran: a stalled main thread
            # must not fill the interpreter's pending-call queue.
            if self._pending.acquire(blocking=False):
                if add_pending(self._callback, None) != 0:
                    self._pending.release()

    def shutdown(self, timeout: float | None = None) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout)
