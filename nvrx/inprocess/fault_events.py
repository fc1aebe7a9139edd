"""The ``fault`` event: one shape for every fault, built from a ``FaultRecord``. No torch here.

The monitor process writes a fault's event as soon as it sees the fault, even
while its link to the store is still being made (``monitor_store``); the
store record follows (``fault_recording``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nvrx.store.faults import FaultRecord

#: Writes one event: ``emit(kind, **fields)`` (an ``EventWriter.emit`` or a wrapper of it).
Emit = Callable[..., Any]


def emit_fault(
    emit: Emit,
    record: FaultRecord,
    *,
    fault_kind: str,
    origin_rank: int | None,
    **fields: Any,
) -> None:
    """Emit the ``fault`` event of ``record``: kind, the rank it is blamed on, what and when.

    ``exc_type`` and ``traceback`` are left out when the record has none (a
    record the monitor process made); ``fields`` add to or override the
    record's values (``detected_mono`` of a peer fault, the ``signature`` of a
    monitor fault).
    """
    event: dict[str, Any] = {"fault_kind": fault_kind, "origin_rank": origin_rank}
    if record.exc_type is not None:
        event["exc_type"] = record.exc_type
    event["message"] = record.message
    if record.traceback is not None:
        event["traceback"] = record.traceback
    event["signature"] = record.signature
    event["detected_mono"] = record.detected_mono
    event.update(fields)
    emit("fault", **event)


def announce_leave(emit: Emit, rank: int, record: FaultRecord) -> None:
    """The event of the monitor taking ``rank`` out of its round (it died, hung or went
    silent); ``store.proxy_leave`` is the store's part."""
    emit_fault(emit, record, fault_kind=record.kind, origin_rank=rank, signature=record.kind)
