"""What interrupted a round, in the reference's terms: ``Interruption`` kinds and ``InterruptionRecord``.

nvrx keeps fault records in the store as JSON (``nvrx.events.failures.FaultRecord``,
with the exception, message and traceback). This module gives them the
reference's names: ``InterruptionRecord.from_fault_record`` maps a record to
its ``Interruption``, ``interruption_records(store)`` reads a round's records,
and ``format_interruption_records`` writes the one-line summary
(``Interruption.EXCEPTION on ranks={0, 3}``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any

from nvrx.events import failures
from nvrx.store import rounds


class Interruption(enum.Enum):
    """Why a rank interrupted a round."""

    EXCEPTION = enum.auto()
    BASE_EXCEPTION = enum.auto()
    SOFT_TIMEOUT = enum.auto()
    HARD_TIMEOUT = enum.auto()
    TERMINATED = enum.auto()
    UNRESPONSIVE = enum.auto()
    MONITOR_PROCESS_EXCEPTION = enum.auto()


#: nvrx fault-record kind -> Interruption.
FROM_FAULT_KIND = {
    "exception": Interruption.EXCEPTION,
    "exit": Interruption.BASE_EXCEPTION,
    "hang_soft": Interruption.SOFT_TIMEOUT,
    "hang_hard": Interruption.HARD_TIMEOUT,
    "dead": Interruption.TERMINATED,
    "signal": Interruption.TERMINATED,
    "unresponsive": Interruption.UNRESPONSIVE,
    "node_lost": Interruption.UNRESPONSIVE,
    "monitor_exception": Interruption.MONITOR_PROCESS_EXCEPTION,
}

#: Interruption -> the nvrx fault-record kind that ``StoreMixin.record_interrupted`` writes.
TO_FAULT_KIND = {
    Interruption.EXCEPTION: "exception",
    Interruption.BASE_EXCEPTION: "exit",
    Interruption.SOFT_TIMEOUT: "hang_soft",
    Interruption.HARD_TIMEOUT: "hang_hard",
    Interruption.TERMINATED: "dead",
    Interruption.UNRESPONSIVE: "unresponsive",
    Interruption.MONITOR_PROCESS_EXCEPTION: "monitor_exception",
}


@dataclasses.dataclass(frozen=True)
class InterruptionRecord:
    """One interruption: the rank it is blamed on and its kind."""

    rank: int
    interruption: Interruption

    @classmethod
    def from_fault_record(cls, record: failures.FaultRecord) -> InterruptionRecord:
        """The record of an nvrx ``FaultRecord`` (its kind mapped by ``FROM_FAULT_KIND``)."""
        try:
            return cls(rank=record.rank, interruption=FROM_FAULT_KIND[record.kind])
        except KeyError:
            raise ValueError(
                f"InterruptionRecord: no Interruption for fault kind {record.kind!r}; "
                f"known: {sorted(FROM_FAULT_KIND)}"
            ) from None

    @classmethod
    def from_str(cls, string: str) -> InterruptionRecord:
        """Parse ``str(record)``/``repr(record)``, or the short ``rank=3 interruption=EXCEPTION``."""
        fields: dict[str, str] = {}
        body = string.strip()
        if body.startswith(f"{cls.__name__}(") and body.endswith(")"):
            body = body[len(cls.__name__) + 1 : -1]
        for part in body.replace(",", " ").split():
            name, sep, value = part.partition("=")
            if sep:
                fields[name] = value
        raw_rank, raw_kind = fields.get("rank", ""), fields.get("interruption", "")
        kind = raw_kind.lstrip("<").split(":")[0].removeprefix("Interruption.")
        if not raw_rank.isdigit() or kind not in Interruption.__members__:
            raise ValueError(
                f"InterruptionRecord.from_str: expected 'rank=<int>' and 'interruption=<name of "
                f"Interruption>', got {string!r}"
            )
        return cls(rank=int(raw_rank), interruption=Interruption[kind])


def interruption_records(store: Any) -> list[InterruptionRecord]:
    """The interruptions recorded in a round's store, in the order the store received them."""
    records = rounds.fault_records(store)
    return [InterruptionRecord.from_fault_record(r) for r in records]


def format_interruption_records(records: Iterable[InterruptionRecord]) -> str:
    """One line: each kind with the ranks it hit, kinds in order of first appearance."""
    by_kind: dict[Interruption, set[int]] = {}
    for record in records:
        by_kind.setdefault(record.interruption, set()).add(record.rank)
    return ", ".join(
        f"{kind} on ranks={{{', '.join(map(str, sorted(ranks)))}}}"
        for kind, ranks in by_kind.items()
    )


__all__ = [
    "FROM_FAULT_KIND",
    "TO_FAULT_KIND",
    "Interruption",
    "InterruptionRecord",
    "format_interruption_records",
    "interruption_records",
]
