"""The wire between a node's ranks and its node agent: the beats of the ranks' monitors,
and the round protocol's barriers the ranks meet through the agent, both directions.

One party of the node, its agent process (``nvrx.node_agent``), alone talks to the job's
store for the node's Wrapper ranks, so the store's load grows with the number of nodes,
not ranks (``docs/inprocess.md``, "Hangs and dead ranks"). Every message is one JSON
datagram on a Unix socket, and every receiver drops a datagram of another user (the
kernel tells the sender's credentials with each, ``SO_PASSCRED``: ``sender_uid``). The
sockets of a node:

* the agent's beat socket (``BeatSocket``, one per node): under a supervisor, bound by the
  supervisor in its private directory (``NVRX_RANK_BEATS``: its path, ``socket_path``)
  and read by its node agent (``nvrx.node_agent.supervised``); without one, the host's
  node agent's (``nvrx.node_agent.host``), at an abstract name;
* the agent's barrier relay (``BarrierRelay``), beside it: ``barriers.sock`` in the
  supervisor's private directory (``supervised_relay_address``), or an abstract name
  beside the host's node agent's (``relay_address``);
* a rank's reply socket, one per barrier it meets: an abstract name, connected to the
  relay.

Beats, monitor → agent (``BeatSender`` → ``BeatSocket``), every interval: each rank's
monitor process sends its heartbeat to its node's agent instead of writing it to the
store. A beat (``Beat``) says who beats and where it is (initial rank, local rank and
restart count, rank and world size of its round, the round, the pids of the rank and of
its monitor, and without a supervisor the host's ring slot its rank is listed in) and how
long the agent may wait for the next one (``heartbeat_timeout``). ``bye`` says the
monitor stops beating on purpose (the rank ended or left the job): no silence to declare.
The agent reads the beats in one loop (``BeatLoop``); ``RankBeats`` tells which of the
node's ranks stopped beating.

Barriers, rank ↔ agent (``HostBarrierClient`` ↔ ``BarrierRelay``): a host's ranks arrive
at its agent, the agent arrives once at the store and holds one wait there for all of
them. Without the agent every rank arrives and waits at the store itself, so a barrier
costs the store a few requests per rank; through the agent it costs a few per host: one
``multi_set`` of the arrivals and one ``add`` (``rounds.arrive_group``), one ``WAIT`` on
the release, whatever the number of ranks of the host. The barriers met this way are
``rounds.HOST_BARRIERS``; the agent closes one as a rank would (their ``before_release``
is protocol code, not user code). The messages, in this order:

1. ``arrive`` rank → agent, at ``relay_address`` (``supervised_relay_address``): ``kind``,
   ``at`` (the generation or round), ``world``, ``rank``, ``wait`` (False: only arrive, as a
   rank that does not host the store at the termination barrier), ``timeout`` (how long
   the rank waits at most) and ``reply`` (the abstract name the rank listens at, bound for
   this barrier).
2. The agent holds a barrier's arrivals until as many came as its host has ranks it serves
   (``BarrierRelay.local_ranks``: those that beat to it; for the barriers of a round, those
   of them ``in_running_round`` counts, ``round_ranks``: not a replacement that waits to
   be admitted, which meets none of them), or ``LINGER_S`` after the first came; then, in
   a thread with a store connection of its own, it arrives for all of them at once.
   (Ranks that come later are a batch of their own.)
3. ``arrived`` agent → each of those ranks, once the store took the arrival. To the lowest
   of them it carries ``forged``: the values with no valid seal the arrival (or its
   closing, or its release) replaced, as (key, size) pairs, which that rank reports as
   its own arrival would have (a sealed barrier: ``nvrx.store.barrier``).
4. ``released`` agent → each of those that wait, once the barrier released; nothing when
   its wait ran out (the rank's own deadline names who is missing).
5. ``failed`` agent → each of them, where the store failed the agent: they meet the
   barrier at the store themselves at once.

A sealed barrier costs the agent one ``append`` (one entry of the barrier's group list naming
its ranks: ``nvrx.store.barrier``), one ``add`` and one wait, plus the reads of the arrivals
when its count completes the barrier.

What a rank does when the agent is not there: no agent bound at the address (the rank's
socket, connected to it for the barrier, is refused), or no ``arrived`` within ``ACK_S``:
it arrives and waits at the store itself (an arrival is reentrant: one the agent made too
counts once). While it waits for ``released`` it sends its arrival again every
``RESEND_S`` to the agent it connected to (one that lost track of it arrives for it again:
harmless, as above); an agent that is gone is found by the refused send, and the rank
waits at the store itself for the time left. An agent that ended while it closed a
barrier (it took the closing, and did not release) leaves the closing to the first of its
host's arrivals that comes after it: the rank's own at the store, or that of the agent
that replaces it (``barrier.closer_token`` names the closer's process).

No torch here: the monitor process, the agents and the supervisor import this. The
barriers' code imports the store's round protocol (``nvrx.store.rounds``,
``nvrx.store.barrier``) where it meets or relays one, not with this module: the monitor
process, which only beats, does not load it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from nvrx import jobenv

if TYPE_CHECKING:
    from nvrx.store import rounds

log = logging.getLogger(__name__)

#: Largest datagram read; a beat is about 100 bytes.
MAX_DATAGRAM = 4096


# -- the beats: monitor to agent ---------------------------------------------------------
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
        self._sock = _datagram_socket(path if fd is None else None, fd)
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


def _datagram_socket(address: str | None, fd: int | None = None) -> socket.socket:
    """A datagram socket that is told its senders' credentials, bound at ``address`` (not
    when None); given ``fd``, the socket of that descriptor (bound by another process)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM, fileno=fd)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        if address is not None:
            sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


_CREDENTIALS_SPACE = socket.CMSG_SPACE(struct.calcsize("3i"))


def sender_uid(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    """The sender's uid from a datagram's ``SCM_CREDENTIALS`` (pid, uid, gid); None without."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= 12:
            return int(struct.unpack("3i", data[:12])[1])
    return None


# -- which ranks stopped beating ---------------------------------------------------------
@dataclasses.dataclass
class Beating:
    """What the last beat of one rank's monitor said, and when it came; ``since``: when its
    silence counts from (its last beat, or later where the agent did not look meanwhile)."""

    beat: Beat
    last: float
    declared: bool = False
    since: float | None = None

    @property
    def deadline(self) -> float:
        return max(self.last, self.since or self.last) + self.beat.timeout


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

    def forgive(self, now: float, late_s: float) -> None:
        """The agent looked ``late_s`` after it meant to (its process was stopped, the whole
        job suspended, or a call of its duty took that long; beats sent meanwhile may be
        lost with the socket's queue full): a rank whose timeout is less than twice that has
        its silence counted from ``now``, since time the agent did not look is no rank's
        silence. Once per silence: one that stays silent is found a timeout later, however
        late the agent goes on looking."""
        for beating in self.ranks.values():
            forgiven = beating.since is not None and beating.since > beating.last
            if not beating.declared and not forgiven and late_s > beating.beat.timeout / 2:
                beating.since = now

    def look_every(self) -> float | None:
        """The longest the agent may go without a look, so that how late it looked says how
        long it did not look (``forgive``): a quarter of the shortest timeout it watches."""
        times = [b.beat.timeout for b in self.ranks.values() if not b.declared]
        return min(times) / 4 if times else None

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
    come, each read before any silence is judged; a rank's silence at its deadline (a look
    at least every quarter of the shortest timeout, so that a late look says how long the
    agent did not look: ``RankBeats.forgive``); the duty's tick every interval. ``run``
    until a tick says the agent ends, or raises (the agent ends with it: without a
    supervisor, the next beat that finds no agent starts one). A ``received`` or
    ``silent`` that raises is logged and the loop goes on."""

    def __init__(self, sock: BeatSocket, duty: Duty) -> None:
        self.sock, self.duty = sock, duty
        self.beats = RankBeats()
        self.failures = 0  # the duty's calls that raised
        self._failed: set[str] = set()  # the duty's methods that raised once (traceback logged)

    def look(self, now: float, late_s: float = 0.0) -> None:
        """The beats waiting, then the silences due at ``now``, ``late_s`` after the loop
        meant to look (``RankBeats.forgive``). The table has the beats before the duty is
        told, so a ``received`` that raises loses no beat for the silences to come (what
        that call had still to tell is lost), and a ``silent`` that raises does not keep the
        silences after it from being told."""
        beats = self.sock.receive()
        new = self.beats.record(beats, now)
        self.beats.forgive(now, late_s)
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
        next_tick = looked = time.monotonic()
        while True:
            interval, every = self.duty.interval(), self.beats.look_every()
            due = [
                self.beats.next_deadline(),
                None if interval is None else next_tick,
                None if every is None else looked + every,
            ]
            soonest = min((t for t in due if t is not None), default=None)
            wait = None if soonest is None else max(0.0, soonest - time.monotonic())
            select.select([self.sock], [], [], wait)
            now = looked = time.monotonic()
            self.look(now, 0.0 if soonest is None else now - soonest)
            if interval is None or now < next_tick:
                continue
            next_tick = now + interval
            if not self.duty.tick(now):  # one that raises ends the loop: the agent ends
                return


# -- the barriers: rank to agent and back ------------------------------------------------
#: How long the agent holds a barrier's first arrivals for the rest of its host's ranks
#: (where it serves ranks that do not come: a spare outside the round, one taken out).
LINGER_S = 0.2
#: How long a rank waits for ``arrived`` before it arrives at the store itself.
ACK_S = LINGER_S + 4.0
#: How often a waiting rank sends its arrival again (and so finds an agent that is gone).
RESEND_S = 5.0
#: How many of the latest barriers the agent remembers who it arrived for.
KEPT_MEETINGS = 16
#: The longest wait the agent holds for a rank, whatever the rank asks.
MAX_WAIT_S = 7 * 24 * 3600.0


def relay_address(agent_address: str) -> str:
    """The abstract name the agent at ``agent_address`` takes barrier arrivals at."""
    return f"{agent_address}-barriers"


def supervised_relay_address(beats_path: str) -> str:
    """Where the node agent of the supervisor whose ranks beat to ``beats_path``
    (``NVRX_RANK_BEATS``) takes barrier arrivals: beside it, in the supervisor's private
    directory (no other user can bind or reach it there)."""
    return os.path.join(os.path.dirname(beats_path), "barriers.sock")


@dataclasses.dataclass(frozen=True)
class Meeting:
    """One barrier: which (``rounds.HOST_BARRIERS``), of which generation or round, of how
    many participants."""

    kind: str
    at: int
    world: int


def _receive(sock: socket.socket) -> dict[str, Any] | None:
    """One message of this user from ``sock`` (blocking as the socket is set); None for a
    datagram of another user or one that is not a message."""
    data, ancillary, _, _ = sock.recvmsg(MAX_DATAGRAM, _CREDENTIALS_SPACE)
    if sender_uid(ancillary) != os.geteuid():
        log.warning("dropped a barrier message of another user")
        return None
    try:
        message = json.loads(data)
    except ValueError:
        log.warning("dropped a barrier message that is not JSON: %r", data[:80])
        return None
    return message if isinstance(message, dict) else None


# -- the barriers: the rank's end --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Call:
    """One rank's meeting of one barrier: which, as whom, until when, whether it waits, who
    reports forged values, and the abstract name it hears the agent at."""

    meeting: Meeting
    rank: int
    deadline: float
    wait: bool
    on_forged: rounds.OnForged | None
    reply: str = dataclasses.field(default_factory=lambda: f"\0nvrx-barrier-rank-{secrets.token_hex(8)}")


class HostBarrierClient:
    """A rank's way to its host's agent (``meet``), or to the store itself without one."""

    def __init__(self, address: str | None) -> None:
        self.address = address

    def meet(
        self,
        base: Any,
        meeting: Meeting,
        rank: int,
        timeout: float,
        wait: bool = True,
        on_forged: rounds.OnForged | None = None,
    ) -> None:
        """Arrive at ``meeting`` as ``rank`` and, with ``wait``, wait for its release
        (``BarrierTimeout`` after ``timeout`` seconds, naming who is missing and, as how
        long it waited, ``timeout``: the whole wait, the agent's part included)."""
        from nvrx.store import barrier, rounds

        call = _Call(meeting, rank, time.monotonic() + timeout, wait, on_forged)
        if self.address is not None and self._met_through_agent(call):
            return
        # (again, where the agent took it but is gone: an arrival counts once)
        rounds.arrive_one(base, meeting.kind, meeting.at, rank, meeting.world, on_forged)
        if wait:
            left = call.deadline - time.monotonic()
            try:
                rounds.wait_barrier(base, meeting.kind, meeting.at, meeting.world, left)
            except barrier.BarrierTimeout as exc:  # it names what was left, not the wait
                raise barrier.BarrierTimeout(exc.name, exc.expected, exc.missing, timeout) from None

    def _met_through_agent(self, call: _Call) -> bool:
        """Arrive (and wait) through the agent, on a reply socket of this call; whether it
        is done (False: the rank meets it at the store)."""
        try:
            sock = _datagram_socket(call.reply)
        except OSError as exc:
            log.warning("no socket to hear this host's agent (%s): meeting the barrier at the store", exc)
            return False
        with sock:
            try:  # connected: a full queue is waited on, and only the agent's replies come
                sock.connect(self.address)
            except OSError:
                return False  # nobody bound there
            return self._through_agent(sock, call)

    def _through_agent(self, sock: socket.socket, call: _Call) -> bool:
        """Arrive through the agent (telling ``on_forged`` of the forged values its arrival
        replaced, where the agent says this rank tells them); whether it is done (False:
        the rank arrives and waits at the store itself)."""
        meeting, deadline, wait, on_forged = call.meeting, call.deadline, call.wait, call.on_forged
        arrival = dataclasses.asdict(meeting) | {"op": "arrive", "rank": call.rank, "wait": wait, "reply": call.reply}
        if not self._send(sock, arrival, deadline):
            return False
        arrived = self._await(sock, meeting, "arrived", min(ACK_S, deadline - time.monotonic()))
        if arrived is None or arrived["op"] == "failed":
            return False
        for key, size in arrived.get("forged", []):  # values the agent's arrival replaced
            if on_forged is not None:
                on_forged(str(key), int(size))
        while wait:
            released = self._await(sock, meeting, "released", min(RESEND_S, deadline - time.monotonic()))
            if released is not None:
                return released["op"] == "released"
            if time.monotonic() >= deadline or not self._send(sock, arrival, deadline):
                return False
        return True

    @staticmethod
    def _send(sock: socket.socket, arrival: dict[str, Any], deadline: float) -> bool:
        """Send ``arrival``, with the time the rank has left, to the agent; False when it is
        gone, or its queue stays full for ``ACK_S`` (an agent that stopped reading)."""
        message = arrival | {"timeout": round(max(deadline - time.monotonic(), 0.0), 3)}
        data = json.dumps(message).encode()
        until = min(time.monotonic() + ACK_S, deadline)
        sock.setblocking(False)  # the socket's timeout, set for a receive, would wait first
        while True:
            try:
                sock.send(data, socket.MSG_DONTWAIT)
                return True
            except BlockingIOError:
                left = until - time.monotonic()
                if left <= 0 or not select.select([], [sock], [], left)[1]:
                    return False
            except OSError as exc:
                if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                    log.warning("barrier arrival to this host's agent failed: %s", exc)
                return False

    @staticmethod
    def _await(
        sock: socket.socket, meeting: Meeting, op: str, timeout: float
    ) -> dict[str, Any] | None:
        """The agent's ``op`` about ``meeting``, or its ``failed``, within ``timeout`` s;
        None when neither came."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                message = _receive(sock)
            except (TimeoutError, OSError):
                return None
            if message is not None and _meeting_of(message) == meeting:
                if message.get("op") in (op, "failed"):
                    return message
        return None


def _meeting_of(message: dict[str, Any]) -> Meeting | None:
    """The meeting a message names; None for one that names none."""
    from nvrx.store import rounds

    try:
        meeting = Meeting(str(message["kind"]), int(message["at"]), int(message["world"]))
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
    if meeting.kind not in rounds.HOST_BARRIERS or meeting.at < 0 or meeting.world < 1:
        return None
    return meeting


@dataclasses.dataclass(frozen=True)
class _Arrival:
    """An ``arrive`` message, checked."""

    meeting: Meeting
    rank: int
    reply: str
    wait: bool
    timeout: float

    @classmethod
    def of(cls, message: dict[str, Any] | None) -> _Arrival | None:
        """The arrival ``message`` says; None (logged) for one that is not a whole arrival."""
        if message is None:
            return None
        meeting = _meeting_of(message)
        if meeting is None or message.get("op") != "arrive":
            log.warning("dropped a barrier message that is no arrival: %.200r", message)
            return None
        wait = message.get("wait", True)
        try:
            arrival = cls(
                meeting, int(message["rank"]), str(message["reply"]), wait is True,
                min(max(float(message.get("timeout", 0.0)), 0.0), MAX_WAIT_S),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, OverflowError):
            arrival = None
        bad = arrival is None or not isinstance(wait, bool) or not arrival.reply
        if bad or not 0 <= arrival.rank < meeting.world:  # type: ignore[union-attr]
            log.warning("dropped a barrier arrival that does not say what it needs: %.200r", message)
            return None
        return arrival


# -- the barriers: the agent's end -------------------------------------------------------
@dataclasses.dataclass
class _Batch:
    """Arrivals at one meeting the agent holds: each rank's reply address, whether it
    waits, the longest wait asked for, and when the first came."""

    first: float
    replies: dict[int, str] = dataclasses.field(default_factory=dict)
    waiting: set[int] = dataclasses.field(default_factory=set)
    timeout: float = 0.0


class BarrierRelay:
    """The agent's end: a thread that takes its host's arrivals at ``address`` and meets
    each barrier for them (``connect`` gives a store connection; one per barrier in
    progress, kept for the next once it is done)."""

    def __init__(self, address: str, connect: Callable[[], Any]) -> None:
        self.address, self._connect = address, connect
        self._counts: tuple[int, int | None] = (0, None)  # local_ranks, round_ranks
        self._sock = _datagram_socket(address)
        self._sock.setblocking(False)
        self._wake, self._woken = socket.socketpair()  # a new count is looked at at once
        for end in (self._wake, self._woken):
            end.setblocking(False)
        self._held: dict[Meeting, _Batch] = {}
        self._busy: dict[Meeting, set[int]] = {}  # ranks of the meetings in progress
        self._waiting: dict[int, tuple[Meeting, dict[int, str]]] = {}  # by batch: who waits
        #: Ranks whose arrival went to the store, for the latest meetings: a host's rank that
        #: comes after the others went does not wait ``LINGER_S`` for them.
        self._sent: collections.OrderedDict[Meeting, set[int]] = collections.OrderedDict()
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nvrx-barrier-relay", daemon=True)

    @property
    def local_ranks(self) -> int:
        """How many ranks of this host the agent serves now (set by the agent, from the
        ranks that beat to it): a barrier's arrivals go to the store once that many came."""
        return self._counts[0]

    @property
    def round_ranks(self) -> int | None:
        """Of ``local_ranks``, how many an ``iteration`` or ``termination`` barrier waits for
        (set by the agent: ``in_running_round``). None: all of them."""
        return self._counts[1]

    def count(self, local: int, in_round: int | None = None) -> None:
        """Serve ``local`` ranks, ``in_round`` of them meeting the running round's barriers
        (None: all), both set at once; fewer (a rank died): a held batch may be whole now."""
        if (local, in_round) != self._counts:
            self._counts = (local, in_round)
            self._recount()

    def serve(self, beats: Iterable[Beat | None]) -> None:
        """Serve the ranks whose latest beats are ``beats`` (None: a rank the agent knows of
        whose beat it holds no more): ``local_ranks`` counts them all, ``round_ranks`` those
        that meet the running round's barriers (``in_running_round``)."""
        held = list(beats)
        self.count(len(held), sum(1 for b in held if b is not None and in_running_round(b)))

    def _recount(self) -> None:
        """A new count is looked at at once."""
        with contextlib.suppress(OSError):
            self._wake.send(b"!")

    def _expected(self, kind: str) -> int:
        """How many arrivals of this host a barrier of ``kind`` waits for."""
        local, in_round = self._counts  # one read: the agent sets both at once
        if kind == "initial" or in_round is None:
            return local
        return min(in_round, local)

    def start(self) -> BarrierRelay:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop taking arrivals; the ranks that wait on a barrier in progress are told
        ``failed``, and wait at the store themselves from now on."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake.send(b"!")
        self._thread.join()
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), {}
        for meeting, replies in waiting:
            self._answer(replies, {"op": "failed"}, meeting)
        self._sock.close()
        self._wake.close()
        self._woken.close()
        with self._lock:
            idle, self._idle = self._idle, []
        for store in idle:
            _close(store)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self._serve_once()
            except Exception:  # an error in one barrier's bookkeeping is not the relay's end
                log.exception("the barrier relay failed to serve an arrival")

    def _serve_once(self) -> None:
        due = min((b.first + LINGER_S for b in self._held.values()), default=None)
        wait = None if due is None else max(due - time.monotonic(), 0.0)
        readable, _, _ = select.select([self._sock, self._woken], [], [], wait)
        if self._woken in readable:
            with contextlib.suppress(OSError):
                self._woken.recv(4096)
        if self._sock in readable:
            self._take_arrivals(time.monotonic())
        self._flush_due(time.monotonic())

    def _take_arrivals(self, now: float) -> None:
        while True:
            try:
                message = _receive(self._sock)
            except (BlockingIOError, InterruptedError):
                return
            arrival = _Arrival.of(message)
            if arrival is not None:
                self._hold(arrival, now)

    def _hold(self, arrival: _Arrival, now: float) -> None:
        meeting, rank = arrival.meeting, arrival.rank
        with self._lock:
            if rank in self._busy.get(meeting, ()):
                return  # sent again while the agent waits for it: it is answered then
            batch = self._held.setdefault(meeting, _Batch(now))
        batch.replies[rank] = arrival.reply
        if arrival.wait:
            batch.waiting.add(rank)
        batch.timeout = max(batch.timeout, arrival.timeout)

    def _flush_due(self, now: float) -> None:
        for meeting, batch in list(self._held.items()):
            came = self._sent.get(meeting, set()) | set(batch.replies)
            if len(came) >= self._expected(meeting.kind) or now >= batch.first + LINGER_S:
                del self._held[meeting]
                self._sent[meeting] = came
                self._sent.move_to_end(meeting)
                while len(self._sent) > KEPT_MEETINGS:
                    self._sent.popitem(last=False)
                with self._lock:  # from here on, ``close`` tells them
                    self._busy.setdefault(meeting, set()).update(batch.replies)
                    self._waiting[id(batch)] = (meeting, dict(batch.replies))
                threading.Thread(
                    target=self._meet, args=(meeting, batch), name="nvrx-barrier", daemon=True
                ).start()

    def _meet(self, meeting: Meeting, batch: _Batch) -> None:
        """Arrive for the batch, answer ``arrived``, wait once, answer ``released``; on an
        error, answer ``failed`` (the ranks meet the barrier at the store at once)."""
        from nvrx.store import rounds

        store = None
        try:
            if self._stop.is_set():
                return  # ``close`` told them
            waiting = {r: batch.replies[r] for r in batch.waiting}
            store = self._arrive(meeting, batch)
            released = bool(waiting) and rounds.await_barrier(
                store, meeting.kind, meeting.at, meeting.world, batch.timeout
            )
            store = self._keep(store)  # before the ranks hear: their next barrier reuses it
            if released:
                with self._lock:
                    told = self._waiting.pop(id(batch), None) is None  # failed by ``close``
                if not told:
                    self._answer(waiting, {"op": "released"}, meeting)
        except Exception as exc:
            log.warning("barrier %s %d for ranks %s failed: %r", meeting.kind, meeting.at,
                        sorted(batch.replies), exc)  # fmt: skip
            self._answer(batch.replies, {"op": "failed"}, meeting)
            _close(store)
            store = None
        finally:
            with self._lock:
                self._waiting.pop(id(batch), None)
                busy = self._busy.get(meeting, set())
                busy.difference_update(batch.replies)
                if not busy:
                    self._busy.pop(meeting, None)
            _close(store)

    def _keep(self, store: Any) -> Any:
        """Put a store connection back in the pool; ``None``, or the connection itself when
        the relay is closing (the caller closes it)."""
        with self._lock:
            if self._stop.is_set():
                return store
            self._idle.append(store)
        return None

    def _arrive(self, meeting: Meeting, batch: _Batch) -> Any:
        """Arrive for the batch and answer ``arrived``; the store connection it used. A kept
        connection that fails (its store closed since) is replaced once: an arrival made
        twice counts once, and one that took the barrier's closing before the connection
        broke closes it on the next (one token for both tries)."""
        from nvrx.store import barrier, rounds

        ranks, forged, closer = sorted(batch.replies), [], barrier.closer_token()
        report = lambda key, size: forged.append([key, size])  # noqa: E731
        with self._lock:
            kept = self._idle.pop() if self._idle else None
        tries = ([kept] if kept is not None else []) + [None]
        for again, store in enumerate(tries):
            store = store or self._connect()
            try:
                closed = rounds.arrive_group(
                    store, meeting.kind, meeting.at, ranks, meeting.world, report, closer,
                    again=bool(again),
                )
                break
            except Exception:
                _close(store)
                if store is not kept:
                    raise
        log.info("barrier %s %d: arrived for ranks %s%s", meeting.kind, meeting.at, ranks,
                 " and released it" if closed else "")  # fmt: skip
        # the forged values this arrival replaced (once, over both tries): the batch's lowest
        # rank reports them
        forged = [list(f) for f in dict.fromkeys(map(tuple, forged))]
        self._answer({ranks[0]: batch.replies[ranks[0]]}, {"op": "arrived", "forged": forged}, meeting)
        self._answer({r: batch.replies[r] for r in ranks[1:]}, {"op": "arrived"}, meeting)
        return store

    def _answer(self, to: dict[int, str], what: dict[str, Any], meeting: Meeting) -> None:
        message = json.dumps(dataclasses.asdict(meeting) | what).encode()
        for rank, reply in to.items():
            try:
                self._sock.sendto(message, reply)
            except OSError as exc:  # it gave up on the agent, or ended: nothing to tell
                log.debug("could not tell rank %d %s: %s", rank, what["op"], exc)


def _close(store: Any) -> None:
    if store is not None and hasattr(store, "close"):
        with contextlib.suppress(Exception):
            store.close()
