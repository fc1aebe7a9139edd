"""Fault recording: the ``fault`` event of a fault and, where it belongs, its record in the round's store.

Faults are described by the rank itself (its own exception, an exception that
a peer's fault caused, its exit from the job) and by its monitor process on
its behalf (a hang, its death, an unresponsive peer). Every ``fault`` event is
built by ``nvrx.store.faults.emit_fault`` from a ``FaultRecord``, so they all
share one shape. The store record is what the other ranks act on; the event is
what the report reads. The monitor process writes a fault's event as soon as it
sees the fault, even while its link to the store is still being made
(``monitor_store``, which imports this module as its first step); the store
record follows. No torch here.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from nvrx.store import faults as nvrx_faults
from nvrx.store import rounds
from nvrx.store.faults import Emit, FaultRecord, emit_fault

log = logging.getLogger(__name__)

def _first_origin(store: Any) -> int | None:
    """The rank whose fault the store received first in this round, None when unknown."""
    with contextlib.suppress(Exception):
        origins = rounds.fault_records(store)  # in the order the store received them
        if origins:
            return origins[0].rank
    return None


def record_rank_fault(
    store: Any,
    emit: Emit,
    rank: int | None,
    exc: BaseException,
    peer_seen_mono: float | None,
    *,
    event: bool = True,
) -> bool:
    """Record an exception of this rank: its own fault, or the consequence of a peer's.

    Once the monitor thread has seen another rank's fault (``peer_seen_mono``)
    it aborts the process groups, which makes pending collectives here fail:
    such an exception is a ``peer`` fault naming the rank that faulted first,
    and is not written to the store. Returns whether the fault is on record
    (False when the store could not be written). ``event=False``: a second
    attempt at the store write, whose event was emitted by the first.
    """
    record = nvrx_faults.from_exception(rank if rank is not None else -1, exc)
    if not event:
        emit = _no_event
    if peer_seen_mono is not None:
        emit_fault(
            emit,
            record,
            fault_kind="peer",
            origin_rank=_first_origin(store),
            detected_mono=peer_seen_mono,
        )
        return True
    emit_fault(emit, record, fault_kind="exception", origin_rank=rank, detection_s=0.0)
    try:
        rounds.record_fault(store, record)
    except Exception as store_exc:
        log.error("could not record the fault in the store: %r", store_exc)
        return False
    return True


def _no_event(kind: str, **fields: Any) -> None:
    """An ``Emit`` that writes nothing."""


def record_exit(store: Any, emit: Emit, rank: int, exc: BaseException) -> None:
    """This rank leaves the job because of ``exc``: an ``exit`` record in the store, then its event."""
    record = nvrx_faults.from_exception(rank, exc, kind="exit")
    rounds.append_fault(store, record)
    emit_fault(emit, record, fault_kind="exit", origin_rank=rank)


def record_soft_hang(
    store: Any, emit: Emit, rank: int, message: str, stack: str, stale_s: float
) -> None:
    """The monitor saw no progress for ``stale_s`` (past ``soft_timeout``): record the fault
    (every rank restarts); it happened at the last progress, ``stale_s`` before now."""
    record = FaultRecord(rank=rank, kind="hang_soft", message=message)
    rounds.record_fault(store, record)
    emit_fault(
        emit,
        record,
        fault_kind="hang_soft",
        origin_rank=rank,
        signature="hang_soft",
        traceback=stack,
        detection_s=stale_s,
    )
