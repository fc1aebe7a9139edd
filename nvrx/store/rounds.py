"""Restart rounds in the store: the round counter, the job restart counter, and the keys
of one round, with who writes them in which order.

Round numbers name the key space of a restart round (``nvrx/r<round>/``).
In-process restarts advance the round by one; a new process generation (every
process of the job restarted) starts at the next multiple of
``GENERATION_STEP`` above the last round the store saw, so its keys never
collide with a previous generation's. The job restart counter counts
in-process and process restarts together.

The keys of one round live under ``keys.round_prefix(round)`` (a ``RoundView``). Who
writes what in a round, in this order:

1. the first rank to start it counts it (``commit_round_start``: ``STARTED``, and the
   job restart counter when the round follows a restart);
2. a rank that faults, or a monitor, supervisor agent or peer on its behalf, appends a
   fault record (``FAULT_LIST``) and sets ``INTERRUPTED`` to ``fault``
   (``record_fault``); a round that ends without one has ``INTERRUPTED`` set to ``done``;
3. a rank that leaves for good is registered in ``TERMINATED`` (``register_terminated``,
   or ``proxy_leave`` by whoever found it gone);
4. every rank, or a proxy for it, arrives at the iteration barrier; the last arrival
   writes ``DECISION`` (who left, the restart count, the world size) and publishes the
   next round before anyone is released (``arrive_iteration``); every rank then reads
   the same decision (``wait_iteration``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

from . import barrier, faults, keys

log = logging.getLogger(__name__)

GENERATION_STEP = 100


def _read_int(store: Any, key: str) -> int | None:
    if not store.check([key]):
        return None
    return int(store.get(key))


def current_round(store: Any) -> int | None:
    """The round the job is in, or None when no round started yet."""
    return _read_int(store, keys.CURRENT_ROUND)


def publish_round(store: Any, round_: int) -> None:
    """Record that the job is in ``round_`` now."""
    store.set(keys.CURRENT_ROUND, str(int(round_)))


def generation_base(store: Any, *, step: int = GENERATION_STEP) -> int:
    """First round of a new process generation (``step`` by keyword only).

    0 for a fresh store; otherwise the next multiple of ``step`` above the last
    published round (a restarted job, or a second wrapped call, never reuses a
    key space). All processes of a generation read the same value because the
    round is published only after the initial barrier, which every one of them
    must pass first.
    """
    last = current_round(store)
    if last is None:
        return 0
    return (last // step + 1) * step


def count_job_restart(store: Any) -> int:
    """Count one more job restart; returns the new total."""
    return int(store.add(keys.JOB_RESTARTS, 1))


def job_restarts(store: Any) -> int:
    """Job restarts counted so far (in-process and process restarts)."""
    return int(store.add(keys.JOB_RESTARTS, 0))


def set_job_restarts(store: Any, value: int) -> None:
    """Record ``value`` restarts (used when a restarted round actually starts)."""
    store.set(keys.JOB_RESTARTS, str(int(value)))


#: Value of ``keys.INTERRUPTED`` when a round completed without a fault.
DONE = "done"
ITERATION_BARRIER = "iteration"
COMPLETION_BARRIER = "completion"


class RoundView:
    """The keys of one restart round, on any store client (torch's or ``nvrx.store.wire``):
    every key under the round's prefix, joined as torch's ``PrefixStore`` joins them."""

    def __init__(self, iteration: int, base_store: Any) -> None:
        self.iteration = iteration
        self.base_store = base_store
        self.prefix = keys.round_prefix(iteration).rstrip("/")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    @property
    def timeout(self) -> timedelta:
        return self.base_store.timeout

    def set(self, key: str, value: str | bytes) -> None:
        self.base_store.set(self._key(key), value)

    def append(self, key: str, value: str | bytes) -> None:
        self.base_store.append(self._key(key), value)

    def add(self, key: str, amount: int) -> int:
        return int(self.base_store.add(self._key(key), amount))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.base_store.compare_set(self._key(key), expected, desired)

    def check(self, names: Iterable[str]) -> bool:
        return bool(self.base_store.check([self._key(k) for k in names]))

    def delete_key(self, key: str) -> bool:
        return bool(self.base_store.delete_key(self._key(key)))

    def get(self, key: str) -> bytes:
        return self.base_store.get(self._key(key))

    def multi_get(self, names: Sequence[str]) -> list[bytes]:
        return self.base_store.multi_get([self._key(k) for k in names])

    def multi_set(self, names: Sequence[str], values: Sequence[str | bytes]) -> None:
        self.base_store.multi_set([self._key(k) for k in names], list(values))

    def wait(self, names: Iterable[str], timeout: timedelta | None = None) -> None:
        names = [self._key(k) for k in names]
        if timeout is None:
            self.base_store.wait(names)
        else:
            self.base_store.wait(names, timeout)


def round_store(base: Any, round_: int) -> RoundView:
    """The store view of one restart round."""
    return RoundView(round_, base)


def record_fault(store: Any, record: faults.FaultRecord) -> bool:
    """Record a fault in the round and interrupt it; False when the round had completed already."""
    faults.append_record(store, keys.FAULT_LIST, record)
    return interrupt(store, "fault")


def interrupt(store: Any, value: str) -> bool:
    """Set the round's interrupted key unless set; True when ``value`` (or a fault) holds now."""
    current = store.compare_set(keys.INTERRUPTED, "", value)
    # The key never changes once set, so writing its value again is safe, and a ``set``
    # wakes the monitor threads waiting on it on every server: torch's legacy TCPStore
    # backend (``use_libuv=False``) answers a ``compare_set`` without waking any waiter.
    store.set(keys.INTERRUPTED, current)
    text = current.decode(errors="replace") if isinstance(current, bytes) else str(current)
    return text != DONE or value == DONE


def fault_records(store: Any) -> list[faults.FaultRecord]:
    return faults.read_records(store, keys.FAULT_LIST)


def register_terminated(store: Any, rank: int) -> bool:
    """Register ``rank`` (its rank in this round) as terminated; idempotent. True if new."""
    if int(store.add(keys.terminated_flag(rank), 1)) != 1:
        return False
    store.append(keys.TERMINATED, f"{rank},")
    return True


def terminated_ranks(store: Any) -> set[int]:
    if not store.check([keys.TERMINATED]):
        return set()
    raw = store.get(keys.TERMINATED).decode()
    return {int(part) for part in raw.split(",") if part.strip()}


def _publish_decision(store: Any, base: Any, world_size: int) -> None:
    """Run by the last arrival at a round's iteration barrier, before anyone is released.

    ``world_size`` is in the decision for a replacement process: a round whose
    ranks all terminated has nobody left to take it back (``rejoin``).
    """
    # The restart is counted when the next round starts (commit_round_start), so
    # a round that every rank leaves (RestartAbort everywhere) counts nothing.
    decision = {
        "terminated": sorted(terminated_ranks(store)),
        "job_restarts": job_restarts(base) + 1,
        "world_size": world_size,
    }
    round_ = getattr(store, "iteration", None)
    if round_ is not None:
        _clear_stale_keys(base, round_)
        publish_round(base, round_ + 1)
    store.set(keys.DECISION, json.dumps(decision))


def _clear_stale_keys(base: Any, round_: int) -> None:
    """Delete torch's rendezvous keys (every rank left its groups) and rounds older than the previous one."""
    stale = tuple(keys.round_prefix(r) for r in range(max(0, round_ - 3), max(0, round_ - 1)))
    try:
        for key in base.list_keys():
            if key.startswith(keys.TORCH_DEFAULT_PG_PREFIX) or (stale and key.startswith(stale)):
                base.delete_key(key)
    except Exception as exc:  # a store without list_keys: nothing to collect
        log.debug("could not clear stale keys: %r", exc)


def commit_round_start(store: Any, base: Any, restarts: int) -> None:
    """The first rank to start a round after a restart records the new job restart count."""
    if int(store.add(keys.STARTED, 1)) == 1 and job_restarts(base) < restarts:
        set_job_restarts(base, restarts)


def arrive_iteration(store: Any, base: Any, rank: int, world_size: int) -> None:
    """Register ``rank`` at the round's iteration barrier (itself or by proxy)."""
    barrier.arrive(
        store,
        ITERATION_BARRIER,
        rank,
        world_size,
        reentrant=True,
        before_release=lambda: _publish_decision(store, base, world_size),
    )


def wait_iteration(store: Any, world_size: int, timeout: float) -> dict[str, Any]:
    """Wait for the iteration barrier; returns the decision every rank reads alike."""
    barrier.wait(store, ITERATION_BARRIER, world_size, timeout, range(world_size))
    return json.loads(store.get(keys.DECISION))


def proxy_leave(
    store: Any, base: Any, rank: int, world_size: int, record: faults.FaultRecord | None
) -> None:
    """Everything peers need when ``rank`` leaves the round for good (it died or was killed)."""
    if record is not None:
        faults.append_record(store, keys.FAULT_LIST, record)
    register_terminated(store, rank)
    interrupt(store, "fault")
    arrive_iteration(store, base, rank, world_size)
