"""Heartbeats of a node's Wrapper ranks to one party of the node: one datagram socket per node.

Each rank's monitor process sends its heartbeat to its node's agent process
instead of writing it to the job's store. Under a supervisor, to a Unix datagram
socket the supervisor binds (``NVRX_RANK_BEATS``: its path) and its node agent
reads (``nvrx.node_agent.supervised``); without one, the monitors of a host send
theirs to the host's node agent (``nvrx.node_agent.host``). That agent alone
talks to the store for the whole node, so the store's load grows with the number
of nodes, not ranks (``docs/inprocess.md``, "Hangs and dead ranks"). ``RankBeats``
tells which of the node's ranks stopped beating.

A beat says who beats and where it is (initial rank, local rank and restart
count, rank and world size of its round, the round, the pids of the rank
and of its monitor, and without a supervisor the host's ring slot its rank is
listed in) and how long the agent may wait
for the next one (``heartbeat_timeout``). ``bye`` says the monitor stops
beating on purpose (the rank ended or left the job): no silence to declare.
No torch here: the monitor process, the agents and the supervisor import this.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, Protocol

from nvrx import jobenv

log = logging.getLogger(__name__)

#: Largest datagram read; a beat is about 100 bytes.
MAX_DATAGRAM = 4096


@dataclasses.dataclass(frozen=True)
class Beat:
    """One heartbeat, or a ``bye``, of the monitor of the rank whose process is ``pid``."""

    initial_rank: int
    pid: int
    local_rank: int = -1  # with ``attempt``: which child of the supervisor the rank runs in
    attempt: int = 0
    rank: int = -1
    world_size: int = 0
    round: int = -1
    interval: float = 1.0
    timeout: float = 30.0
    monitor_pid: int = 0  # the monitor process that beats (it leads its own process group)
    slot: int = -1  # without a supervisor: the host's ring slot its rank is listed in
    bye: bool = False

    def encode(self) -> bytes:
        """The beat as one datagram; a field at its default that an older reader does not
        know (``slot``) is left out, so that it reads the beat all the same."""
        fields = dataclasses.asdict(self)
        if self.slot < 0:
            del fields["slot"]
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Beat:
        """The beat in ``data``; ValueError when it is not one."""
        try:
            fields: Any = json.loads(data)
            beat = cls(**fields)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not a rank beat: {data[:200]!r} ({exc})") from None
        ids = (beat.initial_rank, beat.pid, beat.local_rank, beat.attempt, beat.rank,
               beat.world_size, beat.round, beat.monitor_pid, beat.slot)  # fmt: skip
        times = (beat.interval, beat.timeout)  # a supervisor computes deadlines with them
        if not all(isinstance(i, int) for i in ids) or not all(
            isinstance(t, (int, float)) and math.isfinite(t) for t in times
        ):
            raise ValueError(
                f"not a rank beat: {data[:200]!r} (its ranks, pids, round and attempt are "
                "ints; interval and timeout finite numbers)"
            )
        return beat


class SupervisorGone(RuntimeError):
    """No socket is bound where the supervisor's was: it ended, or died (its children,
    which it starts to die with it, too)."""


def child_of_supervisor() -> tuple[int, int]:
    """(local rank, restart count) of the supervisor's child this process runs in, as a beat
    says them; -1, 0 when unknown."""
    try:
        local_rank = jobenv.int_from(None, jobenv.supervisor_local_rank_variable(), -1)
        return local_rank, jobenv.int_from(None, jobenv.RESTART_COUNT, 0)
    except ValueError as exc:
        log.warning("%s: the supervisor cannot tell which child beats", exc)
        return -1, 0


def socket_path() -> str | None:
    """Where this rank's beats go; None when no supervisor collects them (the Wrapper alone)."""
    return os.environ.get(jobenv.RANK_BEATS) or None


class BeatSender:
    """The monitor's end: sends beats without ever blocking; a lost beat is only logged."""

    def __init__(self, path: str, to: str = "the supervisor", level: int = logging.WARNING) -> None:
        self.path, self._to, self._level = path, to, level
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._failing = False
        #: Whether the last send found no socket bound at ``path``: the supervisor closed it
        #: at its end, or died (it binds the socket before any child starts).
        self.listener_gone = False

    def send(self, beat: Beat, wait_s: float = 0.0) -> bool:
        """Send ``beat``; whether it left. A supervisor not listening yet, or a full queue,
        loses a beat (the next one comes one interval later), unless ``wait_s`` > 0: then
        the send waits that long for room (a ``bye``, which no later beat makes up for)."""
        try:
            if wait_s > 0:
                self._sock.settimeout(wait_s)
            self._sock.sendto(beat.encode(), self.path)
        except OSError as exc:
            if not self._failing:
                log.log(self._level, "heartbeat to %s at %s lost: %s", self._to, self.path, exc)
            self._failing = True
            self.listener_gone = exc.errno in (errno.ECONNREFUSED, errno.ENOENT)
            return False
        finally:
            self._sock.setblocking(False)
        if self._failing:
            log.info("heartbeats reach %s again", self._to)
        self._failing = self.listener_gone = False
        return True

    def close(self) -> None:
        self._sock.close()


class BeatSocket:
    """The receiving end: a datagram socket bound at ``path`` (a supervisor's, in its private
    directory; a node agent's, an abstract name), read by the node's agent process.

    The kernel tells the sender's credentials with each datagram (``SO_PASSCRED``): a beat
    of another user, that reached the socket anyway, is dropped."""

    def __init__(self, path: str, fd: int | None = None) -> None:
        """Bind a socket at ``path``; or, given ``fd``, take over the one bound there by
        the process that started this one (and passed its descriptor on)."""
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM, fileno=fd)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        if fd is None:
            self._sock.bind(path)
        self._sock.setblocking(False)
        self.refused = 0  # datagrams of other users dropped

    def fileno(self) -> int:
        return self._sock.fileno()

    def bound_at(self) -> str:
        """Where the socket is bound (also one taken over by its descriptor)."""
        name = self._sock.getsockname()
        return name.decode(errors="surrogateescape") if isinstance(name, bytes) else str(name)

    def receive(self) -> list[Beat]:
        """Every beat waiting now; malformed datagrams are logged and dropped."""
        beats = []
        while True:
            try:
                data, ancillary, _, _ = self._sock.recvmsg(MAX_DATAGRAM, _CREDENTIALS_SPACE)
            except (BlockingIOError, InterruptedError):
                return beats
            uid = sender_uid(ancillary)
            if uid != os.geteuid():
                self.refused += 1
                log.warning("dropped a rank beat of uid %s: not this user's (%d so far)", uid, self.refused)
                continue
            try:
                beats.append(Beat.decode(data))
            except ValueError as exc:
                log.warning("%s", exc)

    def close(self, unlink: bool = True) -> None:
        """Stop listening; ``unlink``: remove the socket's file too (not when another
        process bound a socket of its own at ``path`` since)."""
        self._sock.close()
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


_CREDENTIALS_SPACE = socket.CMSG_SPACE(struct.calcsize("3i"))


def sender_uid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    """The sender's uid from a datagram's ``SCM_CREDENTIALS`` (pid, uid, gid); None without."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= 12:
            return int(struct.unpack("3i", data[:12])[1])
    return None


# -- which ranks stopped beating ------------------------------------------------------
@dataclasses.dataclass
class Beating:
    """What the last beat of one rank's monitor said, and when it came."""

    beat: Beat
    last: float
    declared: bool = False

    @property
    def deadline(self) -> float:
        return self.last + self.beat.timeout


@dataclasses.dataclass(frozen=True)
class Silence:
    """A rank whose monitor stopped beating: take it out of its round."""

    beat: Beat
    silent_s: float


def in_running_round(beat: Beat) -> bool:
    """Whether the rank that beat meets the barriers of the running round: one that beats
    from a round, or a first process of its rank whose beat from its first round may not have
    come yet. Not a later attempt (one a supervisor started: a replacement waiting to be
    admitted, or a process of a job-wide restart, a failover or a spare's takeover) until it
    beats from a round, which its monitor does at its first look in one; an arrival it makes
    before that costs the store a few more requests, nothing else."""
    return beat.round >= 0 or beat.attempt == 0


@dataclasses.dataclass
class NewPids:
    """What a batch of beats told first: processes whose monitor beats (they run the
    Wrapper), and processes whose monitor beats from a round (they train). A process is new
    again after its monitor's ``bye`` (a later process with its pid, or its next call)."""

    wrapper: list[int] = dataclasses.field(default_factory=list)
    in_round: list[int] = dataclasses.field(default_factory=list)


class RankBeats:
    """The latest beat of each local rank's monitor, by initial rank."""

    def __init__(self) -> None:
        self.ranks: dict[int, Beating] = {}
        self._latest: dict[int, int] = {}  # local rank -> the latest attempt that beat
        self._wrapper_pids: set[int] = set()  # told in ``NewPids.wrapper``, until a bye
        self._in_round_pids: set[int] = set()  # told in ``NewPids.in_round``, until a bye

    def record(self, beats: list[Beat], now: float | None = None) -> NewPids:
        """Apply received beats: a ``bye`` ends the watch of its process. A beat of an
        earlier attempt of a local rank than one that beat already is passed over: the
        monitor of a child that ended may beat on (its own process group) while it takes
        care of its rank, and must not stand for the replacement's. Returns the processes
        the beats told of first."""
        now = time.monotonic() if now is None else now
        new = NewPids()
        for beat in beats:
            self._note_pid(beat, new)
            if beat.local_rank >= 0:
                latest = self._latest.setdefault(beat.local_rank, beat.attempt)
                if beat.attempt < latest:
                    continue
                self._latest[beat.local_rank] = beat.attempt
            current = self.ranks.get(beat.initial_rank)
            if beat.bye:
                if current is not None and current.beat.pid == beat.pid:
                    del self.ranks[beat.initial_rank]
                continue
            if current is None or current.beat.pid != beat.pid or current.beat.round != beat.round:
                self.ranks[beat.initial_rank] = Beating(beat, now)
            else:  # a beat ends a silence: a later one is a new one
                current.beat, current.last, current.declared = beat, now, False
        return new

    def _note_pid(self, beat: Beat, new: NewPids) -> None:
        if beat.bye:
            self._wrapper_pids.discard(beat.pid)
            self._in_round_pids.discard(beat.pid)
            return
        if beat.pid not in self._wrapper_pids:
            self._wrapper_pids.add(beat.pid)
            new.wrapper.append(beat.pid)
        if beat.round >= 0 and beat.pid not in self._in_round_pids:
            self._in_round_pids.add(beat.pid)
            new.in_round.append(beat.pid)

    def due(self, now: float) -> list[Silence]:
        """Ranks silent beyond their timeout, each named once per silence (a beat ends one)."""
        found = []
        for beating in self.ranks.values():
            if not beating.declared and now > beating.deadline:
                beating.declared = True
                found.append(Silence(beating.beat, now - beating.last))
        return found

    def next_deadline(self) -> float | None:
        """When ``due`` may next have something to say."""
        times = [b.deadline for b in self.ranks.values() if not b.declared]
        return min(times) if times else None


class Duty(Protocol):
    """What a node's agent does with what its ``BeatLoop`` reads: without a supervisor, the
    host's node agent takes silent ranks out itself (``nvrx.node_agent.host``); under
    one, the node agent tells its supervisor (``nvrx.node_agent.supervised``)."""

    def received(self, beats: list[Beat], new: NewPids, now: float) -> None:
        """``beats`` were read at ``now`` (and recorded: ``new`` is what they told first)."""

    def silent(self, silence: Silence, now: float) -> None:
        """A rank's monitor fell silent beyond its timeout (told once per silence)."""

    def interval(self) -> float | None:
        """How often ``tick`` runs; None: never (read again after each look)."""

    def tick(self, now: float) -> bool:
        """The node's beat in the ring of liveness, and what the duty does at each; False:
        the agent ends."""


class BeatLoop:
    """The loop of a node's agent, the same with or without a supervisor: the beats as they
    come, each read before any silence is judged; a rank's silence at its deadline; the
    duty's tick every interval. ``run`` until a tick says the agent ends, or raises (the
    agent ends with it: without a supervisor, the next beat that finds no agent starts one).
    A ``received`` or ``silent`` that raises is logged and the loop goes on."""

    def __init__(self, sock: BeatSocket, duty: Duty) -> None:
        self.sock, self.duty = sock, duty
        self.beats = RankBeats()
        self.failures = 0  # the duty's calls that raised
        self._failed: set[str] = set()  # the duty's methods that raised once (traceback logged)

    def look(self, now: float) -> None:
        """The beats waiting, then the silences due at ``now``. The table has the beats
        before the duty is told, so a ``received`` that raises loses no beat for the
        silences to come (what that call had still to tell is lost), and a ``silent`` that
        raises does not keep the silences after it from being told."""
        beats = self.sock.receive()
        new = self.beats.record(beats, now)
        self._tell(self.duty.received, beats, new, now)
        for silence in self.beats.due(now):
            self._tell(self.duty.silent, silence, now)

    def _tell(self, call: Callable[..., Any], *args: Any) -> None:
        """``call(*args)``; an exception is logged (its traceback the first time this method
        raises) and the loop goes on: a fault in telling one beat or silence never ends the
        node's liveness."""
        try:
            call(*args)
        except Exception as exc:
            self.failures += 1
            if call.__name__ not in self._failed:
                self._failed.add(call.__name__)
                log.exception("the node agent's %s failed; its loop goes on", call.__name__)
            else:
                log.error("the node agent's %s failed again (%d failures in all): %r",
                          call.__name__, self.failures, exc)  # fmt: skip

    def run(self) -> None:
        next_tick = time.monotonic()
        while True:
            interval = self.duty.interval()
            due = [self.beats.next_deadline(), None if interval is None else next_tick]
            soonest = min((t for t in due if t is not None), default=None)
            wait = None if soonest is None else max(0.0, soonest - time.monotonic())
            select.select([self.sock], [], [], wait)
            now = time.monotonic()
            self.look(now)
            if interval is None or now < next_tick:
                continue
            next_tick = now + interval
            if not self.duty.tick(now):  # one that raises ends the loop: the agent ends
                return
