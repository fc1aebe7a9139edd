"""Node liveness, run by each supervisor's store agent: this slot's place in the ring of slots.

Every ``interval`` the agent's watch ticks its place in the ring (``nvrx.store.ring``:
its beat, its look at the next slot that has not ended, the claims and fences read with
the job's secret) and sends what the tick found to the supervisor: a slot newly silent
for ``timeout`` (``node_silent``, which the supervisor declares lost), a write of a client
without the secret (``rejected``), this slot fenced off (``fenced``: its supervisor ends
its children, for the job has moved on). A slot that never beat is given ``startup_s``
(the store timeout: how long a node may take to reach the store) before it is reported.

A store host that freezes (a hung node) does not reset its connections, and a store client
may then block far longer than its timeout: a watchdog reports the store lost when one beat
has been waiting for an answer longer than ``timeout``, so that the survivors fail over
within seconds. (Time this process itself spent frozen between beats is no sign of the
store: a thawed node first learns whether it was fenced.)

A client that sets this slot's counter back after its beats holds it still for its
watcher; the slot then stamps its beats in the job folder too
(``store_failover.beats_dir``, per store: owner-only, which no other user's process can
write), which its watcher reads while the counter stands still. So such a client does not
get a healthy node declared lost where the job folder is shared by the nodes (as a store
failover needs it) and the node timeout is at least three heartbeats; one that times its
writes around both the slot's beats and the watcher's reads still can (docs/security.md).
The watch reads the claims with the job's secret (``seal.job_sealer``: the agent reads it
from the file its supervisor names).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nvrx.store.ring import Counters, RingPlace, RingWatch
from nvrx.store.seal import Sealer

from . import node_keys, store_failover


class NodeWatch(threading.Thread):
    """The agent's liveness thread: beats for ``own`` and sends reports through ``send``."""

    def __init__(
        self,
        connect: Callable[[], Counters],
        send: Callable[[dict[str, Any]], None],
        own: int,
        nslots: int,
        interval: float,
        timeout: float,
        sealer: Sealer,
        startup_s: float | None = None,
        job_dir: str | None = None,
        store_name: str = "",
    ) -> None:
        super().__init__(name="node-watch", daemon=True)
        self._connect, self._send = connect, send
        self.interval, self.timeout = interval, timeout
        if job_dir is not None and not store_name:
            raise ValueError("with a job folder, store_name is needed: stamps are per store")
        stamps = None if job_dir is None else store_failover.beats_dir(Path(job_dir), store_name)
        self.place = RingPlace(
            node_keys.RING, own, nslots, timeout, sealer, startup_s, stamps=stamps
        )
        self.stopped = threading.Event()
        self._beat_started: float | None = None  # while a beat waits for the store
        self._reported = threading.Lock()  # one "lost" report, from the beats or the watchdog

    @property
    def ring(self) -> RingWatch:
        """Whom this slot watches, and since when its counter stood still."""
        return self.place.ring

    def run(self) -> None:
        threading.Thread(target=self._watchdog, name="node-watchdog", daemon=True).start()
        try:
            store = self._connect()
            while not self.stopped.is_set():
                self._beat_started = time.monotonic()
                alive = self._tick(store)
                self._beat_started = None
                if not alive:
                    self.stopped.set()
                    return
                if self.stopped.wait(self.interval):
                    return
        except Exception as exc:  # StoreGone and kin: the store is gone
            self._lost(f"node watch: {type(exc).__name__}: {exc}")

    def _watchdog(self) -> None:
        while not self.stopped.wait(self.interval):
            started = self._beat_started
            late = 0.0 if started is None else time.monotonic() - started
            if late > self.timeout:
                self._lost(f"the store did not answer a heartbeat for {late:.1f} s")
                return

    def _lost(self, message: str) -> None:
        if self._reported.acquire(blocking=False):
            self.stopped.set()
            self._send({"event": "lost", "message": message})

    def _tick(self, store: Counters) -> bool:
        """One tick of this slot's place, its reports sent as they come; False once it is
        fenced off."""
        return self.place.tick(store, time.monotonic(), time.time(), self._send)
