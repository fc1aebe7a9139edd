"""The node agent's duty under a supervisor: it tells its supervisor, and is its store client.

The supervisor itself imports no torch, so that ``fork_and_monitor`` can fork
replacement children from a process that holds no torch or socket state. Its node
agent (started with
``python -m nvrx.node_agent supervised HOST PORT TIMEOUT [BEATS_FD]``, or ``- -`` for
HOST and PORT to get the address later as a first stdin line, when it is started ahead
during a store failover) owns the store clients instead (nvrx's own,
``nvrx.store.wire``: the agent imports no torch either) and speaks JSON lines:

* requests on stdin: ``{"id": 1, "op": "add"|"set"|"append"|"get"|"compare_set"|"watch",
  "key": ..., ...}``; ``liveness`` starts the node's beat in the ring whose keys'
  prefix it names (``NodeDuty``, which reads the slots' claims with the job's secret,
  ``seal.job_sealer``, and stamps its beats in the folder ``stamps`` where given), ``leave_ranks``
  takes a lost node's ranks out of the Wrapper's running round, ``leave_silent``
  a rank whose monitor stopped beating out of its round, and ``current_round`` reads the
  round the job is in (``nvrx.store.rounds``)
* answers on stdout: ``{"id": 1, "value": ...}`` or ``{"id": 1, "error": "..."}``
* unsolicited lines: ``{"event": "ready"}``, ``{"event": "key", "key": k, "value": v}``
  when a watched key is set, ``{"event": "lost", "message": ..., "answered_wall": ...}`` when the
  store is gone (from the node watch: when its last answered beat was sent, else none),
  ``{"event": "node_silent", "slot": s, ...}`` and ``{"event": "fenced", ...}`` from the node
  watch; ``{"event": "wrapper_pid", "pid": p}`` (its first beat, again after its bye),
  ``{"event": "rank_in_round", "pid": p}`` (its first beat from a round: its training
  function runs) and ``{"event": "rank_silent", "beat": {...}, "silent_s": s}`` from the
  rank beats.

The barriers: the node's Wrapper ranks arrive at the round protocol's barriers through this
agent (``nvrx.node_agent.rank_wire``: a ``BarrierRelay`` at the socket beside the beat
socket), which arrives for them at the store at once.

The rank beats: the Wrapper's monitor processes of the node beat to the socket the
supervisor bound for them (``nvrx.node_agent.rank_wire``, ``NVRX_RANK_BEATS``); the supervisor
passes its descriptor to this agent (``BEATS_FD``), which alone reads it, in the loop the
node agent of a job without a supervisor runs (``rank_wire.BeatLoop``; its duty here is
``NodeDuty``, which also beats for the node's slot in the ring; there it is
``nvrx.node_agent.host.NodeAgent``). The agent says which
processes beat (they run the Wrapper) and which rank's monitor fell silent beyond its
``heartbeat_timeout``; the supervisor, which knows its children, has the silent rank
taken out of its round (``leave_silent``) and kills it. An agent started
ahead without an address reads no beat before it is given one: until then the agent it
will replace reads them.

It exits when stdin closes (its supervisor ended) and never outlives it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

from nvrx import jobenv
from nvrx.store.ring import Counters, RingKeys, RingPlace
from nvrx.store.wire import StoreGone, StoreTimeout, WireStore

from .rank_wire import (
    BarrierRelay,
    Beat,
    BeatLoop,
    BeatSocket,
    NewPids,
    Silence,
    supervised_relay_address,
)

#: A watch waits in chunks of this length so a wait never depends on the client's timeout.
#: A day: the renewals add nothing that counts to the store's load, and a connection is never
#: idle for the five days after which a stateful firewall (Linux conntrack) forgets it.
_WATCH_CHUNK = timedelta(days=1)


_OUT_LOCK = threading.Lock()

log = logging.getLogger(__name__)


def _send_line(message: dict[str, Any]) -> None:
    """Write one message to the supervisor (from any thread of the agent)."""
    line = json.dumps(message, separators=(",", ":")) + "\n"
    with _OUT_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


class _Agent:
    def __init__(self, host: str, port: int, timeout: float, node: NodeDuty) -> None:
        self.host, self.port, self.node = host, port, node
        self.timeout = timedelta(seconds=timeout)
        self.send = _send_line
        self.store = self._connect()

    def _connect(self, timeout: float | None = None) -> WireStore:
        return WireStore(self.host, self.port, self.timeout if timeout is None else timeout)

    def _watch(self, key: str) -> None:
        try:
            store = self._connect()
            while True:
                try:
                    store.wait([key], _WATCH_CHUNK)
                    break
                except StoreTimeout:
                    continue  # chunk elapsed without the key: wait again
            value = store.get(key).decode(errors="replace")
        except Exception as exc:  # StoreGone: the server is gone
            self.send({"event": "lost", "message": f"{type(exc).__name__}: {exc}"})
            return
        self.send({"event": "key", "key": key, "value": value})

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op, key = request.get("op"), request.get("key")
        if not isinstance(key, str) or not key:
            raise ValueError(f"request needs a non-empty string 'key', got {key!r}")
        if op == "add":
            return {"value": int(self.store.add(key, int(request.get("amount", 1))))}
        if op == "set":
            self.store.set(key, str(request.get("value", "")))
            return {"value": None}
        if op == "append":
            self.store.append(key, str(request.get("value", "")))
            return {"value": None}
        if op == "compare_set":
            expected, desired = str(request.get("expected", "")), str(request["desired"])
            return {"value": self.store.compare_set(key, expected, desired).decode(errors="replace")}
        if op == "get":
            if not self.store.check([key]):
                return {"value": None}
            return {"value": self.store.get(key).decode(errors="replace")}
        if op == "watch":
            threading.Thread(
                target=self._watch, args=(key,), name=f"watch-{key}", daemon=True
            ).start()
            return {"value": None}
        if op == "liveness":
            self._start_liveness(request)
            return {"value": None}
        if op == "leave_ranks":
            from nvrx.store import rounds

            return {
                "value": rounds.leave_round(
                    self.store,
                    [int(r) for r in request["initial_ranks"]],
                    int(request["world_size"]),
                    str(request.get("message", "")),
                    bool(request.get("gone")),
                )
            }
        if op == "leave_silent":
            from nvrx.store import rounds

            return {
                "value": rounds.leave_silent(
                    self.store,
                    int(request["initial_rank"]),
                    int(request["world_size"]),
                    str(request.get("message", "")),
                )
            }
        if op == "current_round":
            from nvrx.store import rounds

            return {"value": rounds.current_round(self.store)}
        raise ValueError(
            f"unknown op {op!r}: expected add, set, append, get, compare_set, watch, liveness, "
            "leave_ranks, leave_silent or current_round"
        )

    def _start_liveness(self, request: dict[str, Any]) -> None:
        from nvrx.store.seal import job_sealer

        timeout = float(request["timeout"])
        sealer = job_sealer()
        if sealer is None:
            raise ValueError("no job secret: $NVRX_JOB_SECRET_FILE is not set (the supervisor sets it)")
        stamps = request.get("stamps")
        place = RingPlace(
            RingKeys(str(request["ring"])), int(request["slot"]), int(request["nslots"]), timeout,
            sealer, float(request.get("startup", timeout)), None if stamps is None else Path(stamps),
        )  # fmt: skip
        # a store host that froze must not hold a beat longer than a node may be silent
        self.node.watch_ring(place, lambda: self._connect(timeout), float(request["interval"]), timeout)

    def serve(self, lines: Iterable[str]) -> None:
        self.send({"event": "ready"})
        for raw in lines:
            try:
                request = json.loads(raw)
                rid = request.get("id")
            except ValueError:
                self.send({"id": None, "error": f"malformed request line {raw[:200]!r}"})
                continue
            try:
                answer = self.handle(request)
            except StoreGone as exc:
                # the loss first: a supervisor that reads the failed answer knows it was a loss
                self.send({"event": "lost", "message": f"{type(exc).__name__}: {exc}"})
                self.send({"id": rid, "error": f"store lost: {exc}"})
                return
            except Exception as exc:
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            answer["id"] = rid
            self.send(answer)


class NodeDuty:
    """The supervised node agent's duty (that of its ``BeatLoop``): it tells its
    supervisor what the rank beats say and what the node's beat in the ring of slots finds;
    the supervisor decides (it knows its children, and node roles follow).

    Once asked (``watch_ring``), every ``interval`` it beats in this slot's place in the
    ring (``nvrx.store.ring``: its beat, its look at the next slot that has not ended, the
    claims and fences read with the job's secret) and tells what the tick found: a slot
    newly silent for ``timeout`` (``node_silent``, which the supervisor declares lost), a
    write of a client without the secret (``rejected``), this slot fenced off (``fenced``:
    its supervisor ends its children, for the job has moved on; the slot beats no more). A
    slot that never beat is given ``startup_s`` (the store timeout: how long a node may
    take to reach the store) before it is reported.

    A store host that freezes (a hung node) does not reset its connections, and a store
    client may then block far longer than its timeout: a watchdog reports the store lost
    when one beat has been waiting for an answer longer than ``timeout``, so that the
    survivors fail over within seconds. (Time this process itself spent stopped, between
    beats or during one, is no sign of the store: a thawed node first reads its beat's
    answer and learns whether it was fenced, ``BeatOverdue``.) The ring's beat runs in a
    thread of its own, not in the loop: a slow store never holds the ranks' beats (a ``bye``
    that found their socket's queue full would be lost, and its rank, still running, found
    silent).

    A client that sets this slot's counter back after its beats holds it still for its
    watcher; the slot then stamps its beats in the folder its supervisor names, in the job
    folder (per store: owner-only, which no other user's process can write), which its
    watcher reads while the counter stands still. So such a client does
    not get a healthy node declared lost where the job folder is shared by the nodes (as a
    store failover needs it) and the node timeout is at least three heartbeats; one that
    times its writes around both the slot's beats and the watcher's reads still can
    (docs/security.md).
    """

    def __init__(self, send: Callable[[dict[str, Any]], None], sock: BeatSocket | None) -> None:
        """``sock``: the node's rank beats (None: no Wrapper beats here)."""
        self.send = send
        self.loop = None if sock is None else BeatLoop(sock, self)
        #: The node's barrier relay, told how many ranks beat here (``received``).
        self.relay: BarrierRelay | None = None
        self.place: RingPlace | None = None  # this slot's, once ``watch_ring``
        self.ring_thread: threading.Thread | None = None  # its beats, until fenced or lost
        self._interval, self.timeout = 0.0, 0.0
        self.stopped = threading.Event()  # fenced, or the store lost: no more beats
        self._beat_started: float | None = None  # while a beat waits for the store
        #: When the last beat the store answered was sent (wall clock): the store was alive
        #: then, so a loss counts from there (told with the ``lost`` report).
        self.answered_wall: float | None = None
        self._reported = threading.Lock()  # one "lost" report, from the beats or the watchdog

    def received(self, beats: list[Beat], new: NewPids, now: float) -> None:
        """Tell the processes that beat first (they run the Wrapper) and that beat from a
        round first (they train); give the relay its counts."""
        for pid in new.wrapper:
            self.send({"event": "wrapper_pid", "pid": pid})
        for pid in new.in_round:
            self.send({"event": "rank_in_round", "pid": pid})
        if self.relay is not None and self.loop is not None:
            self.relay.serve(b.beat for b in self.loop.beats.ranks.values())

    def silent(self, silence: Silence, now: float) -> None:
        beat = dataclasses.asdict(silence.beat)
        self.send({"event": "rank_silent", "beat": beat, "silent_s": round(silence.silent_s, 3)})

    def interval(self) -> None:
        return None  # the ring's beat has a thread of its own (``watch_ring``)

    def tick(self, now: float) -> bool:
        return True

    def watch_ring(
        self, place: RingPlace, connect: Callable[[], Counters], interval: float, timeout: float
    ) -> None:
        """Beat in ``place`` every ``interval`` from now on, with a connection of
        ``connect``'s whose beat may wait ``timeout`` at most."""
        if self.place is not None:
            raise ValueError(f"this agent beats for slot {self.place.own} already")
        self.place, self._interval, self.timeout = place, interval, timeout
        self.ring_thread = threading.Thread(
            target=self._beat_ring, args=(connect,), name="node-watch", daemon=True
        )
        self.ring_thread.start()

    def _beat_ring(self, connect: Callable[[], Counters]) -> None:
        threading.Thread(target=self._watchdog, name="node-watchdog", daemon=True).start()
        try:
            store = connect()
            while not self.stopped.is_set():
                self._beat_started, sent_wall = time.monotonic(), time.time()
                alive = self.beat(store, self._beat_started)
                self._beat_started, self.answered_wall = None, sent_wall
                if not alive:
                    self.stopped.set()  # fenced off
                    return
                if self.stopped.wait(self._interval):
                    return
        except Exception as exc:  # StoreGone and kin: the store is gone
            self._lost(f"node watch: {type(exc).__name__}: {exc}")

    def beat(self, store: Counters, now: float) -> bool:
        """One tick of this slot's place, its reports sent as they come; False once it is
        fenced off."""
        assert self.place is not None
        return self.place.tick(store, now, time.time(), self.send)

    def _watchdog(self) -> None:
        overdue = BeatOverdue(self._interval, time.monotonic())
        while not self.stopped.wait(self._interval):
            late = overdue.late(self._beat_started, time.monotonic())
            if late > self.timeout:
                self._lost(f"the store did not answer a heartbeat for {late:.1f} s")
                return

    def _lost(self, message: str) -> None:
        if self._reported.acquire(blocking=False):
            self.stopped.set()
            self.send({"event": "lost", "message": message, "answered_wall": self.answered_wall})


class BeatOverdue:
    """How long the ring's beat in flight has waited for the store, less the time this
    process itself was stopped. The watchdog wakes every ``interval``; a wake that comes
    more than two intervals after the last says the process did not run for the excess (its
    node froze, and a beat it had sent waited with it). Each wake still adds at least one
    interval to the wait, so a store that never answers is reported however late the wakes."""

    def __init__(self, interval: float, now: float) -> None:
        self.interval = interval
        self._woke = now
        self._stops: list[tuple[float, float]] = []  # (wake that ended a stop, its length)

    def late(self, started: float | None, now: float) -> float:
        """Seconds the beat that started at ``started`` (None: none in flight) has waited
        by this wake, ``now``, not counting the part of each stop that came after it
        started (a stop is the stretch just before the wake that ended it)."""
        gap, self._woke = now - self._woke, now
        if gap > 2 * self.interval:
            self._stops.append((now, gap - self.interval))
        if started is None:
            self._stops.clear()
            return 0.0
        self._stops = [stop for stop in self._stops if stop[0] > started]
        return now - started - sum(min(length, wake - started) for wake, length in self._stops)


def _log_to_stderr() -> None:
    """Log to the supervisor's stderr, which this agent shares, at the supervisor's level
    (``--verbose``: INFO, with a line for each barrier met for the node's ranks)."""
    handler = logging.StreamHandler(sys.stderr)
    pid = os.getpid()
    handler.setFormatter(logging.Formatter(f"%(asctime)s nvrx.node_agent[{pid}] %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    level = logging.getLevelName(os.environ.get(jobenv.AGENT_LOG_LEVEL, "WARNING"))
    root.setLevel(level if isinstance(level, int) else logging.WARNING)


def _start_relay(beats: BeatSocket, connect: Callable[[], Any]) -> BarrierRelay | None:
    """The node's barrier relay (``nvrx.node_agent.rank_wire``) at the path its ranks find
    beside their beat socket, in the supervisor's private directory. A socket left there
    (by the agent this one replaces, even one that still runs) is replaced: the node's
    ranks send their arrivals here from now on. None (logged) where it cannot bind."""
    path = supervised_relay_address(beats.bound_at())
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    try:
        relay = BarrierRelay(path, connect).start()
    except OSError as exc:
        log.warning("no barrier relay for this node's ranks (%s): they meet the barriers at "
                    "the store", exc)  # fmt: skip
        return None
    log.info("meets the barriers of this node's ranks")
    return relay


def _address_from_stdin() -> tuple[str, int] | None:
    """The store's address as the first line on stdin (``{"host": ..., "port": ...}``)."""
    from nvrx.store import rounds  # noqa: F401 - imported while the address is still unknown

    line = sys.stdin.readline()
    if not line:
        return None
    address = json.loads(line)
    return str(address["host"]), int(address["port"])


def main(args: list[str]) -> int:
    """Serve the supervisor on stdin and stdout for the store at ``args`` (see the module
    docstring), reading the node's rank beats on descriptor ``BEATS_FD`` where given."""
    if len(args) not in (3, 4):
        print(
            "usage: python -m nvrx.node_agent supervised HOST|- PORT|- TIMEOUT_S [BEATS_FD]",
            file=sys.stderr,
        )
        return 2
    timeout = float(args[2])
    beats_fd = int(args[3]) if len(args) == 4 else None
    _log_to_stderr()
    if args[0] == "-":  # started ahead: the address comes on stdin
        address = _address_from_stdin()
        if address is None:
            return 0  # not needed after all
        host, port = address
    else:
        host, port = args[0], int(args[1])
    sock = None if beats_fd is None else BeatSocket("", beats_fd)  # the supervisor's to remove
    node = NodeDuty(_send_line, sock)
    if sock is not None:  # the beats and the barriers need no store yet: from the start
        node.relay = _start_relay(sock, lambda: WireStore(host, port, timeout))
        assert node.loop is not None
        threading.Thread(target=node.loop.run, name="rank-beats", daemon=True).start()
    try:
        agent = _Agent(host, port, timeout, node)
    except Exception as exc:
        _send_line({"event": "lost", "message": f"{type(exc).__name__}: {exc}"})
        return 3
    agent.serve(sys.stdin)
    sys.stdout.flush()
    # Watch threads may be blocked in a store wait of a day: nothing to wait for.
    os._exit(0)
