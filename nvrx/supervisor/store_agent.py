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
  ``{"event": "node_silent", "slot": s, ...}`` and ``{"event": "fenced", ...}`` from the node watch.

It exits when stdin closes (its supervisor ended) and never outlives it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from nvrx.store.wire import StoreGone, StoreTimeout, WireStore

#: A watch waits in chunks of this length so a wait never depends on the client's timeout.
#: A day: the renewals add nothing that counts to the store's load, and a connection is never
#: idle for the five days after which a stateful firewall (Linux conntrack) forgets it.
_WATCH_CHUNK = timedelta(days=1)


class _Agent:
    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port = host, port
        self.timeout = timedelta(seconds=timeout)
        self._out_lock = threading.Lock()
        self.store = self._connect()

    def _connect(self, timeout: float | None = None) -> WireStore:
        return WireStore(self.host, self.port, self.timeout if timeout is None else timeout)

    def send(self, message: dict[str, Any]) -> None:
        line = json.dumps(message, separators=(",", ":")) + "\n"
        with self._out_lock:
            sys.stdout.write(line)
            sys.stdout.flush()

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
    if len(args) != 3:
        print(
            "usage: python -m nvrx.supervisor.store_agent HOST|- PORT|- TIMEOUT_S", file=sys.stderr
        )
        return 2
    timeout = float(args[2])
    if args[0] == "-":  # started ahead: the address comes on stdin
        address = _address_from_stdin()
        if address is None:
            return 0  # not needed after all
        host, port = address
    else:
        host, port = args[0], int(args[1])
    try:
        agent = _Agent(host, port, timeout)
    except Exception as exc:
        sys.stdout.write(
            json.dumps({"event": "lost", "message": f"{type(exc).__name__}: {exc}"}) + "\n"
        )
        sys.stdout.flush()
        return 3
    agent.serve(sys.stdin)
    sys.stdout.flush()
    # Watch threads may be blocked in a store wait of a day: nothing to wait for.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
