"""The supervisor's store agent: a small process that talks to the job's TCPStore for it.

The supervisor itself imports no torch, so that ``fork_and_monitor`` can fork
replacement children from a process that holds no torch or socket state. This
agent (started with ``python -m nvrx.supervisor.store_agent HOST PORT TIMEOUT``,
or ``- - TIMEOUT`` to get the address later as a first stdin line, when it is
started ahead during a store failover) owns the store clients instead (nvrx's own,
``nvrx.store.wire``: the agent imports no torch either) and speaks JSON lines:

* requests on stdin: ``{"id": 1, "op": "add"|"set"|"append"|"get"|"compare_set"|"watch",
  "key": ..., ...}``; ``liveness`` starts the node heartbeat and watch (``node_watch``,
  which reads the slots' claims with the job's secret, ``seal.job_sealer``), ``leave_ranks``
  takes a lost node's ranks out of the Wrapper's running round and ``leave_silent``
  a rank whose monitor stopped beating out of its round (``nvrx.store.rounds``)
* answers on stdout: ``{"id": 1, "value": ...}`` or ``{"id": 1, "error": "..."}``
* unsolicited lines: ``{"event": "ready"}``, ``{"event": "key", "key": k, "value": v}``
  when a watched key is set, ``{"event": "lost", "message": ...}`` when the store is gone,
  ``{"event": "node_silent", "slot": s, ...}`` and ``{"event": "fenced", ...}`` from the node
  watch; ``{"event": "wrapper_pid", "pid": p}`` (its first beat, again after its bye),
  ``{"event": "rank_in_round", "pid": p}`` (its first beat from a round: its training
  function runs) and ``{"event": "rank_silent", "beat": {...}, "silent_s": s}`` from the
  rank beats.

The barriers: the node's Wrapper ranks arrive at the round protocol's barriers through this
agent (``nvrx.store.host_barrier``: a ``BarrierRelay`` at the socket beside the beat
socket), which arrives for them at the store at once.

The rank beats: the Wrapper's monitor processes of the node beat to the socket the
supervisor bound for them (``nvrx.rank_beats``, ``NVRX_RANK_BEATS``); the supervisor
passes its descriptor to this agent (``BEATS_FD``), which alone reads it, as the node
agent of a job without a supervisor reads its host's (``nvrx.inprocess.node_agent``).
The agent says which processes beat (they run the Wrapper) and which rank's monitor fell
silent beyond its ``heartbeat_timeout``; the supervisor, which knows its children, has
the silent rank taken out of its round (``leave_silent``) and kills it. An agent started
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
import select
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from nvrx import jobenv
from nvrx.rank_beats import BeatSocket, RankBeats
from nvrx.store.host_barrier import BarrierRelay, supervised_relay_address
from nvrx.store.wire import StoreGone, StoreTimeout, WireStore

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
    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port = host, port
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
        raise ValueError(
            f"unknown op {op!r}: expected add, set, append, get, compare_set, watch, liveness, leave_ranks "
            "or leave_silent"
        )

    def _start_liveness(self, request: dict[str, Any]) -> None:
        from nvrx.store.seal import job_sealer

        from .node_watch import NodeWatch

        timeout = float(request["timeout"])
        sealer = job_sealer()
        if sealer is None:
            raise ValueError("no job secret: $NVRX_JOB_SECRET_FILE is not set (the supervisor sets it)")
        NodeWatch(
            # a store host that froze must not hold a beat longer than a node may be silent
            lambda: self._connect(timeout),
            self.send,
            own=int(request["slot"]),
            nslots=int(request["nslots"]),
            interval=float(request["interval"]),
            timeout=timeout,
            sealer=sealer,
            startup_s=float(request.get("startup", timeout)),
            job_dir=request.get("job_dir"),
            store_name=f"{self.host}-{self.port}",
        ).start()

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


class BeatWatch(threading.Thread):
    """Reads the node's rank beats from socket ``fd`` and sends what the supervisor acts on."""

    def __init__(self, fd: int, send: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(name="rank-beats", daemon=True)
        self.sock = BeatSocket("", fd)  # bound by the supervisor, which removes it
        self.send = send
        self.beats = RankBeats()
        #: The node's barrier relay, told how many ranks beat here (``step``).
        self.relay: BarrierRelay | None = None

    def run(self) -> None:
        while True:
            deadline = self.beats.next_deadline()
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            select.select([self.sock], [], [], wait)
            self.step(time.monotonic())

    def step(self, now: float) -> None:
        """Read the beats waiting (before any silence is judged), then tell what is new."""
        new = self.beats.record(self.sock.receive(), now)
        for pid in new.wrapper:
            self.send({"event": "wrapper_pid", "pid": pid})
        for pid in new.in_round:
            self.send({"event": "rank_in_round", "pid": pid})
        if self.relay is not None:
            self.relay.serve(b.beat for b in self.beats.ranks.values())
        for silence in self.beats.due(now):
            beat = dataclasses.asdict(silence.beat)
            self.send({"event": "rank_silent", "beat": beat, "silent_s": round(silence.silent_s, 3)})


def _log_to_stderr() -> None:
    """Log to the supervisor's stderr, which this agent shares, at the supervisor's level
    (``--verbose``: INFO, with a line for each barrier met for the node's ranks)."""
    handler = logging.StreamHandler(sys.stderr)
    pid = os.getpid()
    handler.setFormatter(logging.Formatter(f"%(asctime)s nvrx.store_agent[{pid}] %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    level = logging.getLevelName(os.environ.get(jobenv.AGENT_LOG_LEVEL, "WARNING"))
    root.setLevel(level if isinstance(level, int) else logging.WARNING)


def _start_relay(beats: BeatSocket, connect: Callable[[], Any]) -> BarrierRelay | None:
    """The node's barrier relay (``nvrx.store.host_barrier``) at the path its ranks find
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

    from . import node_watch  # noqa: F401

    line = sys.stdin.readline()
    if not line:
        return None
    address = json.loads(line)
    return str(address["host"]), int(address["port"])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (3, 4):
        print(
            "usage: python -m nvrx.supervisor.store_agent HOST|- PORT|- TIMEOUT_S [BEATS_FD]",
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
    if beats_fd is not None:  # the beats and the barriers need no store yet: from the start
        watch = BeatWatch(beats_fd, _send_line)
        watch.relay = _start_relay(watch.sock, lambda: WireStore(host, port, timeout))
        watch.start()
    try:
        agent = _Agent(host, port, timeout)
    except Exception as exc:
        _send_line({"event": "lost", "message": f"{type(exc).__name__}: {exc}"})
        return 3
    agent.serve(sys.stdin)
    sys.stdout.flush()
    # Watch threads may be blocked in a store wait of a day: nothing to wait for.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
