"""A host's place in the store without a supervisor: its slot, its counter, its lists of ranks.

The node agent of a host (``node_agent``) beats for the host in the ring of
hosts (``nvrx.store.ring_watch``): ``HostRing``. Its slot is handed out once
per host; each monitor writes its rank in the host's list (``list_rank``), and
again in the list of those that ended on purpose (``list_ended``).
``Thresholds`` says how long a rank's take-out waits before it is tried again,
and how long a silent host stands before its ranks are taken out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from nvrx.store import keys, rank_lists
from nvrx.store.ring_watch import RingWatch


def register(store: Any, host: str) -> int:
    """The ring slot of ``host``: the one its first monitor to ask took, unless that slot
    ended since (its agent ended with the ranks it knew): then the host's next one."""
    for generation in range(MAX_SLOTS_PER_HOST):
        slot = _slot(store, f"{host}#{generation}")
        if not claimed(store, slot):
            return slot
    raise RuntimeError(f"host {host} ended {MAX_SLOTS_PER_HOST} places in the ring: no more")


#: How many times one host's place in the ring may end and be taken again.
MAX_SLOTS_PER_HOST = 1000


def _slot(store: Any, name: str) -> int:
    """The slot named ``name``, taken once (compare-and-set: the first to ask decides)."""
    key = keys.host_slot(name)
    if store.check([key]):
        return int(store.get(key))
    slot = int(store.add(keys.HOST_COUNT, 1)) - 1
    got = store.compare_set(key, "", str(slot))
    taken = int(got.decode() if isinstance(got, bytes) else got)
    if taken != slot:  # another monitor of the host took one first: this one is never used
        store.add(keys.host_claim(slot), 1)
    return taken


def claimed(store: Any, slot: int) -> bool:
    """Whether host ``slot``'s place in the ring ended."""
    return int(store.add(keys.host_claim(slot), 0)) > 0


def list_rank(store: Any, slot: int, rank: int) -> None:
    """``rank`` runs on host ``slot``: what its agent, and the host watching it, go by."""
    rank_lists.add(store, keys.host_ranks(slot), rank)


def list_ended(store: Any, slot: int, rank: int) -> None:
    """The monitor of ``rank`` on host ``slot`` stops beating on purpose."""
    rank_lists.add(store, keys.host_ended(slot), rank)


def ended_ranks(store: Any, slot: int) -> set[int]:
    """The ranks of host ``slot`` whose monitor stopped beating on purpose."""
    return rank_lists.read(store, keys.host_ended(slot))


def live_ranks(store: Any, slot: int) -> list[int]:
    """The ranks of host ``slot`` whose monitor has not stopped beating on purpose."""
    return sorted(rank_lists.read(store, keys.host_ranks(slot)) - ended_ranks(store, slot))


@dataclass(frozen=True)
class Thresholds:
    """How long a rank's take-out waits before it is tried again (``replace_s``), and how
    long a host's counter stands still before the host is taken out (``host_s``): the
    longer, by a few beats, so that an agent started again after its predecessor died
    beats before its host is found silent."""

    timeout: float  # heartbeat_timeout: a rank's
    period: float  # between two beats of a monitor: heartbeat + monitor-process interval

    @property
    def replace_s(self) -> float:
        return max(self.timeout / 2, 3 * self.period)

    @property
    def host_s(self) -> float:
        return max(self.timeout, self.replace_s + 3 * self.period)

    @property
    def stall_s(self) -> float:
        """An agent that did not look at the store this long does not count that time."""
        return 2 * self.period + self.timeout / 4


class HostRing:
    """The agent's part in the store: its host's counter, the watch of the next host."""

    def __init__(self, store: Any, slot: int, limits: Thresholds) -> None:
        self.store, self.slot, self.limits = store, slot, limits
        self.ring = RingWatch(slot, self.count(), limits.host_s)
        self._last_tick: float | None = None

    def count(self) -> int:
        return int(self.store.add(keys.HOST_COUNT, 0))

    def refresh(self) -> None:
        """Hosts whose first monitor came after this one's last look: take them in the ring."""
        self.ring.resize(self.count())

    def tick(self, now: float, wall: float) -> dict[str, Any] | None:
        """One beat for this host and one look at the next; a report when that one newly
        went silent (as ``RingWatch.observe``). Time this agent itself did not look (a
        stall, or a store that did not answer) is nobody's silence. A slot that never beat
        has its end read at every look: a slot its host took twice ends at its second."""
        store, ring, limits = self.store, self.ring, self.limits
        started = time.monotonic()
        store.add(keys.host_alive(self.slot), 1)
        beats = ring.look(
            lambda slot: int(store.add(keys.host_alive(slot), 0)),
            lambda slot, beats: (beats == 0 or ring.still_for(now) > limits.timeout / 2)
            and int(store.add(keys.host_claim(slot), 0)) > 0,
        )
        took = time.monotonic() - started
        last, self._last_tick = self._last_tick, now
        if beats is None:
            return None
        if took > limits.stall_s or (last is not None and now - last > limits.stall_s):
            ring.restart_clock(now)
            return None
        return ring.observe(beats, now, wall)

    def claim(self, slot: int) -> bool:
        """Take the end of ``slot``; False when it was ended already (by itself or another)."""
        return int(self.store.add(keys.host_claim(slot), 1)) == 1
