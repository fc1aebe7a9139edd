"""Restart rounds and the job restart counter, kept in the store.

Round numbers name the key space of a restart round (``nvrx/r<round>/``).
In-process restarts advance the round by one; a new process generation (every
process of the job restarted) starts at the next multiple of
``GENERATION_STEP`` above the last round the store saw, so its keys never
collide with a previous generation's. The job restart counter counts
in-process and process restarts together.
"""

from __future__ import annotations

from typing import Any

from . import keys

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
