"""The decision after a warning, the job's ledger of requeues (``requeues.json``), and the
record of a submitted callable's checkpoint (``r<run>.checkpoint``), which may refuse a requeue."""

from __future__ import annotations

import contextlib
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
    """The job's requeues so far (``requeues.json``), written by node 0 only.

    A file that cannot be read (a stale NFS handle, a write of another tool) counts as
    ``runs_before`` requeues of unknown cause, each counted against every cap: each requeue
    of the job began a run, so no more were made. The next requeue recorded keeps it beside
    the new ledger, as ``requeues.json.unreadable``, instead of writing over it."""

    def __init__(self, path: str | os.PathLike[str], runs_before: int = 0) -> None:
        self.path = Path(path)
        self.runs_before = runs_before

    def entries(self) -> list[dict[str, Any]]:
        return self._read()[0]

    def _read(self) -> tuple[list[dict[str, Any]], bool]:
        """The entries, and whether the file could be read (a missing one is empty)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return [], True
        except (OSError, ValueError) as exc:
            log.warning(
                "requeue ledger %s unreadable (%s); counting %d requeue(s) of unknown cause "
                "from SLURM_RESTART_COUNT", self.path, exc, self.runs_before,
            )  # fmt: skip
            return [{"cause": None, "run": run} for run in range(self.runs_before)], False
        entries = [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []
        return entries, True

    def count(self, cause: str | tuple[str, ...] | None = None) -> int:
        """Requeues recorded (of ``cause``, or of any of several; one whose cause the ledger
        lost counts for every cause)."""
        causes = (cause,) if isinstance(cause, str) else cause
        return sum(1 for e in self.entries() if causes is None or e.get("cause") in (*causes, None))

    def append(self, cause: str, run: int, **extra: object) -> int:
        """Record one requeue; returns the number of requeues recorded."""
        entries, readable = self._read()
        if not readable:
            with contextlib.suppress(OSError):
                os.replace(self.path, self.path.with_name(self.path.name + ".unreadable"))
        entries.append({"cause": cause, "run": run, "wall": time.time(), **extra})
        write_json_atomic(self.path, entries)
        return len(entries)


def checkpoint_record_path(flag: str | os.PathLike[str]) -> Path:
    """Where rank 0 records the checkpoint of a submitted callable after the warning of the run
    whose flag is ``flag``: ``r<run>.checkpoint`` next to it (``nvrx.submission.checkpointing``)."""
    return Path(flag).with_suffix(".checkpoint")


def write_checkpoint_record(flag: str | os.PathLike[str], requeue: bool, reason: str) -> Path:
    """Record (atomically) whether the checkpoint lets the job be requeued, and why."""
    return write_json_atomic(
        checkpoint_record_path(flag), {"requeue": requeue, "reason": reason, "wall": time.time()}
    )


def requeue_refusal(flag: str | os.PathLike[str]) -> str | None:
    """Why the callable's checkpoint refused the requeue (submitit: it returned None), or None."""
    path = checkpoint_record_path(flag)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("checkpoint record %s unreadable (%s); requeueing as usual", path, exc)
        return None
    if isinstance(record, dict) and record.get("requeue") is False:
        return str(record.get("reason") or "the submitted callable's checkpoint refused it")
    return None
