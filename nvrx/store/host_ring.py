"""A host's place in the store without a supervisor: its slot, its lists of ranks.

The node agent of a host without a supervisor (``nvrx.node_agent.host``) beats for the
host in the ring of hosts (``nvrx.store.ring``, under ``keys.HOSTS_PREFIX``: ``RING``; the
job has no secret, so its claims are plain). Each monitor writes, in this order:

1. the job's token (``job_token``, compare-and-set: the first to write decides), which it
   gives to its host's agent; the agent reads it at every connect and leaves a store that
   holds none or another;
2. its host's slot, handed out once per host (``register``), and its rank in the host's
   list (``list_rank``); where it then finds that place ended (``claimed``), its rank in
   that place's list of ended ranks too (``list_ended``: a host that declared the place
   lost reads the list again after its claim and leaves the rank alone; the host's own
   agent, which ended it, may have listed the rank in the host's next place first, where
   the monitor lists it too), and it takes the host's next slot the same way;
3. then its beats go to the agent (which connects only after one came);
4. when it ends on purpose, its rank in the list of those that ended so, in its place and
   in each later place of its host that lists it (``end_rank``).

An agent whose host's ranks all ended ends its place (``end_place``), then reads the list
again: a rank listed meanwhile goes on the host's next place (``carry_over``), which the
agent its beat starts next takes. Such a rank that ends lists itself as ended there as
well (step 4). One that ends on purpose while it is being carried over, before the
carry-over listed it, and whose bye to the agent is lost, is taken out as silent there:
its ended mark in the ended place is read by no one (a rank that moves on by itself in
step 2 writes the same mark, and must stay live in the next place).

``Thresholds`` says how long a rank's take-out waits before it is tried again, and how
long a silent host stands before its ranks are taken out.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import keys, rank_lists, ring

#: The ring of hosts, and its claims: plain entries (no job secret without a supervisor).
RING = ring.RingKeys(keys.HOSTS_PREFIX)
ENTRIES = ring.Unsealed()


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
        end_place(store, slot)
    return taken


def job_token(store: Any) -> str:
    """The job's token in ``store``: the one the first monitor to ask wrote (compare-and-set).
    A node agent given it tells its job's store from another job's at the same address."""
    got = store.compare_set(keys.JOB_TOKEN, "", uuid.uuid4().hex)
    return got.decode() if isinstance(got, bytes) else str(got)


def read_job_token(store: Any) -> str | None:
    """The job's token in ``store``; None while no monitor wrote one."""
    if not store.check([keys.JOB_TOKEN]):
        return None
    raw = store.get(keys.JOB_TOKEN)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def claimed(store: Any, slot: int) -> bool:
    """Whether host ``slot``'s place in the ring ended."""
    return bool(ring.read_claims(store, RING, ENTRIES, slot).valid)


def declared_lost(store: Any, slot: int) -> bool:
    """Whether another host's agent ended host ``slot``'s place (found it silent), rather
    than its own agent (its ranks all ended)."""
    first = ring.read_claims(store, RING, ENTRIES, slot).first
    if first is None:
        return False
    try:
        by = json.loads(first).get("by")
    except (ValueError, AttributeError):
        return True  # not an entry of ours: the place is ended all the same, not by itself
    return by != slot


def end_place(store: Any, slot: int) -> bool:
    """End host ``slot``'s place in the ring (its ranks all ended, or it was never used);
    False when it was ended already."""
    return ring.claim(store, RING, ENTRIES, slot, slot)


def declare_lost(store: Any, slot: int, by: int) -> bool:
    """Host ``by``'s agent ends silent host ``slot``'s place and fences it
    (``nvrx.store.ring``)."""
    return ring.declare_lost(store, RING, ENTRIES, slot, by)


def beats(store: Any, slot: int) -> int:
    """Host ``slot``'s counter in the ring: its agent's beats (``ring.FENCE`` more once it
    was declared lost)."""
    return int(store.add(RING.alive(slot), 0))


def name_place(store: Any, slot: int, host: str, node: int | None) -> None:
    """Say which host (and node, where known) stands in ``slot``."""
    store.set(keys.host_name(slot), json.dumps({"host": host, "node": node}))


def place_name(store: Any, slot: int) -> dict[str, Any]:
    """``{"host": ..., "node": ...}`` of the host in ``slot``; empty where it said nothing."""
    if not store.check([keys.host_name(slot)]):
        return {}
    raw = store.get(keys.host_name(slot))
    try:
        named = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except ValueError:
        return {}
    return named if isinstance(named, dict) else {}


def host_count(store: Any) -> int:
    """How many host slots were handed out: the size of the ring."""
    return int(store.add(keys.HOST_COUNT, 0))


class HostsBeating:
    """Whether any host's agent beat since the last look: the sum of the ring's counters
    moved (a job whose hosts all stand still is gone, or cut off)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.seen = self._total()

    def _total(self) -> int:
        return sum(beats(self.store, slot) for slot in range(host_count(self.store)))

    def __call__(self) -> bool:
        total = self._total()
        moved, self.seen = total != self.seen, total
        return moved


def place(store: Any, slot: int, limits: Thresholds) -> ring.RingPlace:
    """Host ``slot``'s part in the ring of hosts (a silent host stands ``limits.host_s``)."""
    return ring.RingPlace(
        RING, slot, host_count(store), limits.host_s, ENTRIES, stall_s=limits.stall_s
    )


def list_rank(store: Any, slot: int, rank: int) -> None:
    """``rank`` runs on host ``slot``: what its agent, and the host watching it, go by."""
    rank_lists.add(store, keys.host_ranks(slot), rank)


def carry_over(store: Any, host: str, ranks: set[int]) -> int:
    """List ``ranks`` in ``host``'s next place, its place having ended (its agent's claim
    won) as their monitors listed them there: they read no claim yet and beat for the ended
    place, whose next agent takes this one. Its slot."""
    slot = register(store, host)
    for rank in sorted(ranks):
        list_rank(store, slot, rank)
    return slot


def list_ended(store: Any, slot: int, rank: int) -> None:
    """The monitor of ``rank`` on host ``slot`` stops beating on purpose."""
    rank_lists.add(store, keys.host_ended(slot), rank)


def end_rank(store: Any, host: str, slot: int, rank: int) -> None:
    """The monitor of ``rank``, listed on ``host``'s place ``slot``, stops beating on
    purpose: ``rank`` listed as ended there and, where the host's own agent ended that place
    (``carry_over`` may have listed it in a later one), in each later place of the host that
    lists it, found without taking a new one."""
    list_ended(store, slot, rank)
    if not claimed(store, slot) or declared_lost(store, slot):
        return
    for later in _places(store, host):
        if later > slot and rank in rank_lists.read(store, keys.host_ranks(later)):
            list_ended(store, later, rank)


def _places(store: Any, host: str) -> Iterator[int]:
    """The slots ``host`` took so far, in order, read only (``register`` takes one)."""
    for generation in range(MAX_SLOTS_PER_HOST):
        key = keys.host_slot(f"{host}#{generation}")
        if not store.check([key]):
            return
        yield int(store.get(key))


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
