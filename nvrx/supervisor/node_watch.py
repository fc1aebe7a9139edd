"""Node liveness, run by each supervisor's store agent: beat for this slot, watch the next one.

Every ``interval`` the agent bumps its slot's liveness counter and reads the
counter of one other slot: the next one in the ring of slots that have not
ended (left cleanly or declared lost). A watched slot whose counter has not
moved for ``timeout`` seconds is reported to the supervisor (``node_silent``),
which declares it lost; the watch then moves on to the next slot. So each slot
is watched by exactly one other, and store load is two requests per node per
interval. The claims that say a slot ended are read only when they can have
changed something: the watched counter stood still; this watch's first beat
(a store that failed over keeps the claims, not the counters); and this
slot's own claim once every ``OWN_CLAIM_EVERY`` beats besides, in place of
that beat's look at the watched slot (which waits one interval), so that
while the watched slot beats every beat after the first sends two requests.
A slot that never beat is given ``startup_s`` (the store timeout: how long a
node may take to reach the store) before it is reported.

A store host that freezes (a hung node) does not reset its connections, and a
store client may then block far longer than its timeout: a watchdog
reports the store lost when one beat has been waiting for an answer longer
than ``timeout``, so that the survivors fail over within seconds. (Time this
process itself spent frozen between beats is no sign of the store: a thawed
node first learns whether it was fenced.)

A slot is fenced off when the others declared it lost while it was stalled (a
frozen node that thaws): whoever declared it adds ``node_keys.FENCE`` to its
counter right after taking its claim, so the slot's own next beat, whenever
the declaration lands, returns a count at or above ``FENCE``. It is reported
as ``fenced``, and its supervisor ends its children, for the job has moved on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from nvrx.store.ring_watch import RingWatch

from . import node_keys

log = logging.getLogger(__name__)

#: Beats between two reads of this slot's own claim: only for a declarer that ended
#: between its claim and its fence (the fence is what normally tells a slot).
OWN_CLAIM_EVERY = 600


class Counters(Protocol):
    """What the watch needs of a store client (``nvrx.store.wire.WireStore`` in the agent):
    counters to bump and read."""

    def add(self, key: str, amount: int) -> int: ...


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
        startup_s: float | None = None,
    ) -> None:
        super().__init__(name="node-watch", daemon=True)
        self._connect, self._send = connect, send
        self.own, self.interval = own, interval
        self.ring = RingWatch(own, nslots, timeout, startup_s)
        self.timeout = timeout
        self.stopped = threading.Event()
        self._beat_started: float | None = None  # while a beat waits for the store
        self._beats = 0
        self._reported = threading.Lock()  # one "lost" report, from the beats or the watchdog

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
        """One beat and one look; False once this slot is fenced off."""
        count = int(store.add(node_keys.alive(self.own), 1))
        self._beats += 1
        fenced = count >= node_keys.FENCE
        own_claim = (self._beats - 1) % OWN_CLAIM_EVERY == 0  # the first beat, then rarely
        if not fenced and own_claim:
            fenced = int(store.add(node_keys.claim(self.own), 0)) > 0
        if fenced:
            self._send({"event": "fenced", "slot": self.own})
            return False
        if own_claim and self._beats > 1:
            return True  # the claim was this beat's second request: the ring's look waits a beat
        ring = self.ring
        while ring.target is not None:
            beats = int(store.add(node_keys.alive(ring.target), 0))
            if not ring.stood_still(beats) or int(store.add(node_keys.claim(ring.target), 0)) == 0:
                break
            ring.ended_slot(ring.target)
        if ring.target is None:
            return True
        report = ring.observe(beats, time.monotonic(), time.time())
        if report is not None:
            log.warning("slot %s silent for %.1f s", report["slot"], report["silent_s"])
            self._send(report)
        return True
