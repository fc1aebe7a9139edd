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
counter right after appending its claim, so the slot's own next beat, whenever
the declaration lands, returns a count at or above ``FENCE``. The slot then reads
its claim: a valid entry (``node_keys.claims``) means it is reported as
``fenced``, and its supervisor ends its children, for the job has moved on. A
fence with no valid claim behind it, or claim entries that do not unseal, were
written by a client without the job's secret: they are reported as ``rejected``
(once per forged fence or batch of new forged entries) and the slot beats on; the
next real fence is one more ``FENCE`` above the count seen. A beat that reads its
counter at or below what its last beat read was set back by such a client (deleted, or a
negative amount added, which holds the slot still for its watcher): it is reported as
``rejected`` too, and from then on the slot also stamps each beat in a file of the job
folder (``store_failover.beats_dir``, per store: owner-only, which no other user's process
can write). A watcher whose target's counter stands still reads that file, and while the
stamp moves (or once it appears) it does not find the target silent (it logs that its
beats are held still in the store). So a client that sets a slot's counter back after its
beats does not get a healthy node declared lost where the job folder is shared by the
nodes (as a store failover needs it) and the node timeout is at least three heartbeats;
one that times its writes around both the slot's beats and the watcher's reads still can
(docs/security.md). The watch reads the
claims with the job's secret (``seal.job_sealer``: the agent reads it from the file its
supervisor names).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from nvrx.store.ring_watch import RingWatch
from nvrx.store.seal import SealedList, Sealer

from . import node_keys, store_failover

log = logging.getLogger(__name__)

#: Beats between two reads of this slot's own claim: only for a declarer that ended
#: between its claim and its fence (the fence is what normally tells a slot).
OWN_CLAIM_EVERY = 600
#: Asked of the store as both the expected and the new value, to read a key in one request:
#: an unset key answers it back unchanged, a set one answers its value. No writer of ours
#: ever writes it.
_UNSET = "\x00unset"


class Counters(Protocol):
    """What the watch needs of a store client (``nvrx.store.wire.WireStore`` in the agent):
    counters to bump and read, and a compare-and-set to read a claim in one request."""

    def add(self, key: str, amount: int) -> int: ...

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...


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
        self._connect, self._send, self.sealer = connect, send, sealer
        self.own, self.interval = own, interval
        self.ring = RingWatch(own, nslots, timeout, startup_s)
        self.timeout = timeout
        self.stopped = threading.Event()
        self._beat_started: float | None = None  # while a beat waits for the store
        self._beats = 0
        self._fence_floor = 0  # a count at or above this plus FENCE is a fence to look into
        self._forged_seen = 0  # entries of the own claim that did not unseal, reported already
        self._last_count: int | None = None  # what this slot's last beat read of its counter
        self._beats_dir = (
            None if job_dir is None else store_failover.beats_dir(Path(job_dir), store_name)
        )
        self._stamping = False  # once this slot's counter was set back: beats in the job folder too
        self._stamps: dict[int, str | None] = {}  # what this watch last read of a target's stamp
        self._held: set[int] = set()  # targets whose store beats are held still, said once
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
        self._check_counter(count)
        if self._stamping:
            self._stamp()
        fence = count >= self._fence_floor + node_keys.FENCE
        own_claim = (self._beats - 1) % OWN_CLAIM_EVERY == 0  # the first beat, then rarely
        if (fence or own_claim) and self._ended(store, count, fence):
            self._send({"event": "fenced", "slot": self.own})
            return False
        if own_claim and self._beats > 1:
            return True  # the claim was this beat's second request: the ring's look waits a beat
        beats = self.ring.look(
            lambda slot: int(store.add(node_keys.alive(slot), 0)),
            lambda slot, _: self._claims(store, slot).valid,
        )
        if beats is None:
            return True
        now, target = time.monotonic(), self.ring.target
        if not self.ring.stood_still(beats):
            self._stamps.pop(target, None)  # a later stretch reads its stamp afresh
        elif self._stamp_moved(target):
            self.ring.restart_clock(now)  # alive: its store beats are held still
        report = self.ring.observe(beats, now, time.time())
        if report is not None:
            log.warning("slot %s silent for %.1f s", report["slot"], report["silent_s"])
            self._send(report)
        return True

    def _check_counter(self, count: int) -> None:
        """Only this slot adds to its counter but for a declarer's fence, which raises it: a
        count at or below the last one means a client set it back (deleted it, or added a
        negative amount), which holds this slot still in its watcher's eyes. Each set-back is
        reported, and from the first the slot stamps its beats in the job folder too."""
        last, self._last_count = self._last_count, count
        if last is None or count > last:
            return
        reason = (
            f"this slot's beat counter was set back from {last} to {count - 1} before this beat: "
            "not a write of this job's supervisors (held still in the store, this slot stamps "
            "its beats in the job folder for its watcher)"
        )
        log.warning("rejected a change of slot %d's beat counter: %s", self.own, reason)
        key = node_keys.alive(self.own)
        self._send({"event": "rejected", "key": key, "reason": reason, "value_bytes": 0})
        self._stamping = self._beats_dir is not None
        # a forged fence set back: a real one later counts from where the counter is now
        self._fence_floor = min(self._fence_floor, count - count % node_keys.FENCE)

    def _stamp(self) -> None:
        """This beat in the job folder, written whole (a reader never sees half of it)."""
        assert self._beats_dir is not None
        try:
            self._beats_dir.mkdir(parents=True, exist_ok=True)
            part = self._beats_dir / f".{self.own}.part"
            part.write_text(str(self._beats))
            os.replace(part, self._beats_dir / str(self.own))
        except OSError as exc:
            log.warning("cannot stamp this slot's beat in the job folder: %s", exc)

    def _stamp_moved(self, slot: int | None) -> bool:
        """Whether ``slot``'s stamp in the job folder changed (or appeared) since this watch
        last read it in this stretch of its counter standing still."""
        if self._beats_dir is None or slot is None:
            return False
        try:
            stamp: str | None = (self._beats_dir / str(slot)).read_text()
        except OSError:
            stamp = None
        read_before, last = slot in self._stamps, self._stamps.get(slot)
        self._stamps[slot] = stamp
        moved = read_before and stamp is not None and stamp != last
        if moved and slot not in self._held:
            self._held.add(slot)
            log.warning("slot %d's beat counter stands still in the store, but it stamps its beats "
                        "in the job folder: held still by another client, not silent", slot)  # fmt: skip
        return moved

    def _claims(self, store: Counters, slot: int) -> SealedList:
        key = node_keys.claim(slot)
        raw = store.compare_set(key, _UNSET, _UNSET)
        value = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        return node_keys.claims(self.sealer, slot, None if value == _UNSET else value)

    def _ended(self, store: Counters, count: int, fence: bool) -> bool:
        """Whether this slot's claim holds a valid entry; reports what was forged of it."""
        claims = self._claims(store, self.own)
        if claims.valid:
            return True
        forged = claims.invalid - self._forged_seen
        if forged > 0 or fence:
            self._forged_seen = claims.invalid
            key = node_keys.claim(self.own) if forged > 0 else node_keys.alive(self.own)
            reason = (
                f"{forged} claim entries with no valid seal: not a declaration of this job's "
                "supervisors in this run"
                if forged > 0
                else "a fence with no valid claim behind it: not added by this job's supervisors"
            )
            log.warning("rejected a forged end of slot %d: %s", self.own, reason)
            size = claims.invalid_bytes if forged > 0 else 0
            self._send({"event": "rejected", "key": key, "reason": reason, "value_bytes": size})
        if fence:
            self._fence_floor = count - count % node_keys.FENCE
        return False
