"""Fault records kept in the store as JSON (never as a parsed ``repr``).

Each rank appends its records, one JSON object per line, to one key of the
round; readers get structured ``FaultRecord`` objects back. In a job whose processes
hold the job's secret (``nvrx.store.seal.job_sealer``: a supervisor started them) each
record is an entry of a sealed list instead, for the key and the round it belongs to: a
record that a client without the secret appended, or one copied from another round or
run, is skipped and counted, never read as a fault.

The ``fault`` event of a record (``emit_fault``) is built here too, so that the record
and its event have one shape, and so that a monitor process can write a fault's event
before its link to the store is made (``nvrx.inprocess.monitor_store``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

from nvrx.events import failures

from .seal import Sealer, text_of

log = logging.getLogger(__name__)

#: Kinds of fault records: every fault kind of the vocabulary but ``peer`` (a rank that only
#: lost its peer records no fault of its own).
FAULT_KINDS = tuple(kind for kind in failures.FAULT_KINDS if kind != failures.PEER)


@dataclasses.dataclass(frozen=True)
class FaultRecord:
    """One fault as every rank sees it: who, what, and when it was detected."""

    rank: int
    kind: str
    exc_type: str | None = None
    message: str = ""
    traceback: str | None = None
    signature: str = ""
    detected_mono: float = dataclasses.field(default_factory=time.monotonic)
    detected_wall: float = dataclasses.field(default_factory=time.time)
    reporter_pid: int = dataclasses.field(default_factory=os.getpid)
    host: str = dataclasses.field(default_factory=socket.gethostname)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"), default=str)

    @classmethod
    def from_json(cls, text: str) -> FaultRecord:
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def from_exception(rank: int, exc: BaseException, kind: str = "exception") -> FaultRecord:
    """A fault record describing ``exc`` raised on ``rank``."""
    return FaultRecord(
        rank=rank,
        kind=kind,
        exc_type=failures.exception_type_of(exc),
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        signature=failures.exception_signature_of(exc),
    )


@dataclasses.dataclass(frozen=True)
class CheckedRecords:
    """The records read at a key, and what was skipped there for a seal that did not verify."""

    records: list[FaultRecord]
    forged: int = 0  # entries that did not unseal
    forged_bytes: int = 0


def append_record(
    store: Any, key: str, record: FaultRecord, sealer: Sealer | None = None, sealed_as: str = ""
) -> None:
    """Append ``record`` to the list kept at ``key``: one line of JSON, or with ``sealer``
    one sealed entry for ``sealed_as`` (the key's full name, round included)."""
    if sealer is None:
        store.append(key, record.to_json() + "\n")
    else:
        store.append(key, sealer.entry(sealed_as or key, record.to_json()))


def read_checked(
    store: Any, key: str, sealer: Sealer | None = None, sealed_as: str = ""
) -> CheckedRecords:
    """Every record appended at ``key`` that can be trusted (none when the key is not set):
    with ``sealer`` the entries sealed for ``sealed_as``, the others counted as forged.
    Unreadable lines are logged and skipped."""
    if not store.check([key]):
        return CheckedRecords([])
    raw = store.get(key)
    text = text_of(raw)
    forged = forged_bytes = 0
    if sealer is None:
        lines = text.splitlines()
    else:
        sealed = sealer.entries(sealed_as or key, text)
        lines, forged, forged_bytes = list(sealed.valid), sealed.invalid, sealed.invalid_bytes
    records = []
    for line in lines:
        if not line.strip():
            continue
        try:
            records.append(FaultRecord.from_json(line))
        except (ValueError, TypeError) as exc:
            log.warning("skipping unreadable fault record at %s: %s", key, exc)
    return CheckedRecords(records, forged, forged_bytes)


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


def announce_leave(emit: Emit, rank: int, record: FaultRecord, **fields: Any) -> None:
    """The event of the monitor taking ``rank`` out of its round (it died, hung or went
    silent); ``store.proxy_leave`` is the store's part. ``fields`` add to the event (the
    ``detection_s`` of a rank found silent: how long it had been)."""
    emit_fault(emit, record, fault_kind=record.kind, origin_rank=rank, signature=record.kind, **fields)
