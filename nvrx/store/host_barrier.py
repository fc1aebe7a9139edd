"""The round protocol's barriers met per host: a host's ranks arrive at its agent, the agent
arrives once at the store and holds one wait there for all of them.

Without it every rank arrives and waits at the job's store itself, so a barrier costs the
store a few requests per rank. Through its host's agent (the node agent of a Wrapper job
without a supervisor, ``nvrx.node_agent.host``; under one, the supervisor's node
agent, ``nvrx.node_agent.supervised``) it costs a few per host: one
``multi_set`` of the arrivals and one ``add`` (``rounds.arrive_group``), one ``WAIT`` on
the release, whatever the number of ranks of the host. The barriers met this way are
``rounds.HOST_BARRIERS``; the agent closes one as a rank would (their ``before_release``
is protocol code, not user code).

Messages (JSON datagrams on Unix sockets: the host's node agent at an abstract name, a
supervised node agent in its supervisor's private directory, the ranks' at abstract names; a receiver
drops a datagram of another user, as ``nvrx.rank_beats`` does), in this order:

1. ``arrive`` rank → agent, at ``relay_address`` (``supervised_relay_address``): ``kind``,
   ``at`` (the generation or round), ``world``, ``rank``, ``wait`` (False: only arrive, as a
   rank that does not host the store at the termination barrier), ``timeout`` (how long
   the rank waits at most) and ``reply`` (the abstract name the rank listens at, bound for
   this barrier).
2. The agent holds a barrier's arrivals until as many came as its host has ranks it serves
   (``BarrierRelay.local_ranks``: those that beat to it; for the barriers of a round, those
   of them ``rank_beats.in_running_round`` counts, ``round_ranks``: not a replacement that
   waits to be admitted, which meets none of them), or ``LINGER_S`` after the first came;
   then, in a thread with a store connection of its own, it arrives for all of them
   at once. (Ranks that come later are a batch of their own.)
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
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import json
import logging
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from nvrx.rank_beats import MAX_DATAGRAM, Beat, in_running_round, sender_uid

from . import barrier, rounds

log = logging.getLogger(__name__)

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

_CREDENTIALS_SPACE = socket.CMSG_SPACE(12)


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


def _datagram_socket(address: str | None) -> socket.socket:
    """A datagram socket that is told its senders' credentials, bound at ``address``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        if address is not None:
            sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


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


# -- the rank's end -----------------------------------------------------------------------
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


# -- the agent's end ----------------------------------------------------------------------
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
        (set by the agent: ``rank_beats.in_running_round``). None: all of them."""
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
        that meet the running round's barriers (``rank_beats.in_running_round``)."""
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
