"""The decision after a warning, and the job's ledger of requeues (``requeues.json``)."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nvrx.checkpoint_flag import write_json_atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarningOutcome:
    """What the job does after a warning; the same on every node."""

    cause: str
    requeued: bool
    exit_code: int
    reason: str
    requeue_count: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RequeueLedger:
    """The job's requeues so far (``requeues.json``), written by node 0 only."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def entries(self) -> list[dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning(
                "requeue ledger %s unreadable (%s); counting from SLURM_RESTART_COUNT",
                self.path,
                exc,
            )
            return []
        return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []

    def count(self, cause: str | None = None) -> int:
        return sum(1 for e in self.entries() if cause is None or e.get("cause") == cause)

    def append(self, cause: str, run: int, **extra: Any) -> int:
        """Record one requeue; returns the number of requeues recorded."""
        entries = self.entries()
        entries.append({"cause": cause, "run": run, "wall": time.time(), **extra})
        write_json_atomic(self.path, entries)
        return len(entries)
