"""The supervisor's end of the fault-tolerance channel: monitored ranks and their deadlines.

Ranks that use ``nvrx.fault_tolerance.RankMonitorClient`` connect to a
``SOCK_SEQPACKET`` socket that this object listens on; each packet updates what
the supervisor knows of that rank (heartbeats, open sections, timeouts in
force). ``next_deadline()`` tells the supervisor's loop when the earliest
timeout falls due, so nothing is polled; ``due(now)`` names the ranks whose
timeout passed. ``stack()`` asks such a rank for its Python stack. No torch here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import select
import shutil
import socket
import struct
import tempfile
import time
from typing import Any

from nvrx.fault_tolerance import channel
from nvrx.fault_tolerance.timeouts import Timeouts

log = logging.getLogger(__name__)

#: Longest Unix socket path Linux takes (``sun_path`` holds 108 bytes with its NUL).
MAX_SOCKET_PATH = 107
#: Name prefix of a supervisor's private directory (its sockets, a copy of the job's secret).
PREFIX = "nvrx-ft-"
#: A directory younger than this is never swept: its supervisor may not listen yet.
SWEEP_AFTER_S = 60.0
#: Longest wait for a hung rank's stack to start, and the pause that ends it.
STACK_WAIT_S, STACK_QUIET_S = 2.0, 0.2


@dataclasses.dataclass
class Watched:
    """One monitored process, as its packets describe it."""

    conn: socket.socket
    peer_pid: int | None = None  # the connecting process, as the kernel tells (SO_PEERCRED)
    local_rank: int | None = None
    rank: int | None = None
    attempt: int | None = None
    pid: int | None = None  # the peer's: a pid a rank reports may be another namespace's
    stack_fd: int | None = None
    timeouts: Timeouts = dataclasses.field(default_factory=Timeouts)
    started: float = 0.0
    last_heartbeat: float | None = None
    open: dict[str, float] = dataclasses.field(default_factory=dict)
    outside_since: float | None = None
    declared: bool = False  # a hang was declared: no further deadline
    deferred: float | None = None  # a deadline judged later once, its packets unread then

    def deadline(self) -> tuple[float, str, str | None, float] | None:
        """``(when, timeout kind, section, limit)`` of the earliest timeout; None when none runs."""
        if self.declared or self.local_rank is None:
            return None
        t, found = self.timeouts, []
        if self.last_heartbeat is None and t.initial_heartbeat is not None:
            found.append((self.started + t.initial_heartbeat, "initial_heartbeat", None, t.initial_heartbeat))
        elif self.last_heartbeat is not None and t.heartbeat is not None:
            found.append((self.last_heartbeat + t.heartbeat, "heartbeat", None, t.heartbeat))
        for name, since in self.open.items():
            limit = t.sections.get(name)
            if limit is not None:
                found.append((since + limit, "section", name, limit))
        if not self.open and self.outside_since is not None and t.out_of_section is not None:
            found.append((self.outside_since + t.out_of_section, "out_of_section", None, t.out_of_section))
        return min(found, key=lambda d: d[0]) if found else None


@dataclasses.dataclass(frozen=True)
class Hang:
    """A monitored rank missed a timeout."""

    local_rank: int
    rank: int | None
    attempt: int | None
    pid: int | None
    timeout: str  # initial_heartbeat | heartbeat | section | out_of_section
    section: str | None
    limit_s: float
    stale_s: float


def sweep_abandoned(parent: str, now: float | None = None) -> list[str]:
    """Remove the private directories under ``parent`` that supervisors of this user left
    when they were killed (SIGKILL leaves no time to clean up): those whose socket no longer
    listens, older than ``SWEEP_AFTER_S``. Returns the ones removed."""
    now = time.time() if now is None else now
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if entry.name.startswith(PREFIX) and _abandoned(entry, now):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    if removed:
        log.info("removed %d directories of killed supervisors under %s", len(removed), parent)
    return removed


def _abandoned(entry: os.DirEntry[str], now: float) -> bool:
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    own = entry.is_dir(follow_symlinks=False) and info.st_uid == os.geteuid()
    if not own or now - info.st_mtime < SWEEP_AFTER_S:
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(os.path.join(entry.path, "supervisor.sock"))
    except (ConnectionRefusedError, FileNotFoundError):
        return True  # nobody listens there any more
    except OSError:
        return False
    finally:
        probe.close()
    return False


#: What ``RankWatch.read`` tells the supervisor: (what, the rank, the detail).
Told = tuple[str, Watched, Any]


class RankWatch:
    """Listens for monitored ranks of this node; see the module doc."""

    def __init__(self) -> None:
        sweep_abandoned(tempfile.gettempdir())
        self._dir = tempfile.mkdtemp(prefix=PREFIX)  # private (0700): only this user connects
        self.path = os.path.join(self._dir, "supervisor.sock")
        if len(self.path.encode()) > MAX_SOCKET_PATH:  # a long $TMPDIR: Unix socket paths are short
            os.rmdir(self._dir)
            sweep_abandoned("/tmp")
            self._dir = tempfile.mkdtemp(prefix=PREFIX, dir="/tmp")
            self.path = os.path.join(self._dir, "supervisor.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.watched: dict[int, Watched] = {}  # by connection descriptor

    def fileno(self) -> int:
        return self._listener.fileno()

    @property
    def directory(self) -> str:
        """The private directory of this supervisor's sockets."""
        return self._dir

    def accept(self) -> int | None:
        """Take one waiting connection; its descriptor (to watch for packets), or None. A
        peer of another user is refused (``SO_PEERCRED``), whatever reached the socket."""
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return None
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.geteuid():
            log.warning("refused a fault-tolerance connection of pid %d: uid %d is not this user's", pid, uid)
            conn.close()
            return None
        conn.setblocking(False)
        self.watched[conn.fileno()] = Watched(conn, peer_pid=pid)
        return conn.fileno()

    def read(self, fd: int, now: float | None = None) -> list[Told]:
        """Apply every waiting packet of connection ``fd``; returns what the supervisor should log:
        ``("init", w, source)``, ``("timeouts", w, source)``, ``("control", w, request)``,
        ``("steps", w, [seconds, ...])``, ``("end", w, "bye" | "closed")``;
        a source is where the timeouts came from: config, restored or computed."""
        watched = self.watched.get(fd)
        if watched is None:
            return []
        told: list[Told] = []
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(watched.conn, channel.MAX_MESSAGE, 1)
            except BlockingIOError:
                return told
            except OSError as exc:
                log.warning("fault-tolerance channel of local rank %s: %s", watched.local_rank, exc)
                data, fds = b"", []
            if not data:
                told.append(("end", watched, "closed"))
                self._drop(fd)
                return told
            stamp = time.monotonic() if now is None else now
            try:
                verb, payload = channel.decode(data)
            except ValueError as exc:
                log.warning("local rank %s: %s", watched.local_rank, exc)
                for extra in fds:
                    os.close(extra)
                continue
            if verb == channel.INIT:
                if self._init(watched, payload, fds, stamp):  # (it owns fds: kept or closed)
                    told.append(("init", watched, str(payload.get("source", "config"))))
            elif fds:
                for extra in fds:
                    os.close(extra)
            if verb == channel.SHUTDOWN:
                told.append(("end", watched, "bye"))
                self._drop(fd)
                return told
            self._apply(watched, verb, payload, stamp, told)

    def _apply(
        self, watched: Watched, verb: str, payload: Any, stamp: float, told: list[Told]
    ) -> None:
        """Apply one message (not ``init`` or ``bye``) of ``watched``; add to ``told`` what
        the supervisor should hear of it."""
        if verb == channel.HEARTBEAT:
            watched.last_heartbeat = stamp
        elif verb == channel.SECTION_START and isinstance(payload, str) and payload:
            watched.open[payload] = stamp
            watched.outside_since = None
        elif verb == channel.SECTION_END and isinstance(payload, str) and payload:
            watched.open.pop(payload, None)
            if not watched.open:
                watched.outside_since = stamp
        elif verb == channel.END_ALL:
            watched.open.clear()
            watched.outside_since = stamp
        elif verb == channel.SECTIONS_NOW:
            self._sections_now(watched, payload, stamp)
        elif verb == channel.TIMEOUTS:
            try:
                watched.timeouts = Timeouts.from_dict(payload["timeouts"])
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("local rank %s sent bad timeouts: %r", watched.local_rank, exc)
                return
            told.append(("timeouts", watched, str(payload.get("source", "client"))))
        elif verb == channel.CONTROL:
            told.append(("control", watched, payload))
        elif verb == channel.STEPS and _seconds(payload):
            told.append(("steps", watched, payload))

    def _sections_now(self, watched: Watched, state: Any, stamp: float) -> None:
        """The sections the rank has open now and for how long (its catch-up after a lag):
        their timers, and the one outside every section, go on from when they began."""
        opened = state.get("open") if isinstance(state, dict) else None
        if not isinstance(opened, dict) or not all(
            isinstance(name, str) and name and _age(age) for name, age in opened.items()
        ):
            log.warning("local rank %s sent a bad state of its sections: %.60r", watched.local_rank, state)
            return
        watched.open = {name: stamp - float(age) for name, age in opened.items()}
        outside = state.get("outside")
        watched.outside_since = None if opened else stamp - (float(outside) if _age(outside) else 0.0)

    def _init(self, watched: Watched, hello: Any, fds: list[int], now: float) -> bool:
        """Take a rank's hello: who it is, its stack pipe, its timeouts. False (and nothing
        taken) when it is no object: a broken rank's, which must not stop the supervisor."""
        if not isinstance(hello, dict):
            log.warning("a monitored process (pid %s) sent a malformed hello: %.60r", watched.peer_pid, hello)
            for extra in fds:
                os.close(extra)
            return False
        watched.local_rank = _int(hello.get("local_rank"))
        watched.rank = _int(hello.get("rank"))
        watched.attempt = _int(hello.get("attempt"))
        watched.pid = watched.peer_pid if watched.peer_pid else None  # 0: not in our namespace
        if watched.stack_fd is not None:
            os.close(watched.stack_fd)
        watched.stack_fd = fds[0] if fds else None
        for extra in fds[1:]:
            os.close(extra)
        try:
            watched.timeouts = Timeouts.from_dict(hello.get("timeouts") or {})
        except (TypeError, ValueError) as exc:
            log.warning("local rank %s sent bad timeouts: %r", watched.local_rank, exc)
        watched.started = watched.outside_since = now
        return True

    def connection_fds(self) -> list[int]:
        return list(self.watched)

    def next_deadline(self) -> float | None:
        """Monotonic time at which the earliest timeout falls due; None when none runs."""
        times = [d[0] for w in self.watched.values() if (d := w.deadline()) is not None]
        return min(times) if times else None

    def due(self, now: float | None = None) -> list[Hang]:
        """The ranks whose timeout passed; each is declared once. A rank whose packets wait
        unread (they came while the supervisor was busy, and may be its heartbeats) is
        judged at the next look, once the loop read them (at once: its socket is readable),
        though packets came again meanwhile: a deadline is put off once."""
        now = time.monotonic() if now is None else now
        hangs = []
        for w in self.watched.values():
            d = w.deadline()
            if d is None or d[0] > now:
                continue
            if w.deferred != d[0] and _readable(w.conn):
                w.deferred = d[0]
                continue
            when, kind, section, limit = d
            w.declared = True
            assert w.local_rank is not None
            stale = now - when + limit
            hangs.append(Hang(w.local_rank, w.rank, w.attempt, w.pid, kind, section, limit, stale))
        return hangs

    def stack(self, hang: Hang) -> str | None:
        """Ask the hung rank for its stack (``channel.STACK_SIGNAL``) and read it; None if none came."""
        watched = next((w for w in self.watched.values() if w.pid == hang.pid), None)
        if watched is None or watched.stack_fd is None or hang.pid is None or hang.pid <= 0:
            return None
        fd = watched.stack_fd
        while select.select([fd], [], [], 0)[0]:  # what an earlier request left
            if not os.read(fd, 65536):
                return None
        try:
            os.kill(hang.pid, channel.STACK_SIGNAL)
        except ProcessLookupError:
            return None
        chunks: list[bytes] = []
        wait = STACK_WAIT_S
        while select.select([fd], [], [], wait)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            wait = STACK_QUIET_S  # the dump is written at once: a pause ends it
        return b"".join(chunks).decode(errors="replace") or None

    def _drop(self, fd: int) -> None:
        watched = self.watched.pop(fd, None)
        if watched is None:
            return
        watched.conn.close()
        if watched.stack_fd is not None:
            with contextlib.suppress(OSError):
                os.close(watched.stack_fd)

    def close(self) -> None:
        for fd in list(self.watched):
            self._drop(fd)
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _seconds(value: object) -> bool:
    """Whether ``value`` is a list of step times (numbers ≥ 0)."""
    return isinstance(value, list) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in value
    )


def _readable(conn: socket.socket) -> bool:
    """Whether packets (or the end) wait on ``conn``; ``poll``, which takes any descriptor."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def _age(value: object) -> bool:
    """Whether ``value`` is a number of seconds ≥ 0 (finite)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
