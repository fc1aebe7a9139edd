"""Fault records kept in the store as JSON (never as a parsed ``repr``).

Each rank appends its records, one JSON object per line, to one key of the
round; readers get structured ``FaultRecord`` objects back.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
import traceback
from typing import Any

log = logging.getLogger(__name__)

FAULT_KINDS = ("exception", "hang_soft", "hang_hard", "dead", "unresponsive", "exit", "signal")


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


def exception_signature(exc: BaseException) -> str:
    """Stable signature of an exception: its type and the innermost frame (file:function)."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    where = ""
    if frames:
        last = frames[-1]
        where = f"@{os.path.basename(last.filename)}:{last.name}"
    return f"{type(exc).__module__}.{type(exc).__qualname__}{where}"


def from_exception(rank: int, exc: BaseException, kind: str = "exception") -> FaultRecord:
    """A fault record describing ``exc`` raised on ``rank``."""
    return FaultRecord(
        rank=rank,
        kind=kind,
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        signature=exception_signature(exc),
    )


def append_record(store: Any, key: str, record: FaultRecord) -> None:
    """Append ``record`` to the list kept at ``key`` (one line of JSON)."""
    store.append(key, record.to_json() + "\n")


def read_records(store: Any, key: str) -> list[FaultRecord]:
    """Every record appended at ``key`` (an empty list when none); bad lines are logged and skipped."""
    if not store.check([key]):
        return []
    raw = store.get(key)
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            records.append(FaultRecord.from_json(line))
        except (ValueError, TypeError) as exc:
            log.warning("skipping unreadable fault record at %s: %s", key, exc)
    return records
