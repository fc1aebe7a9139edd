"""Per-file summaries: which events the report considers, and one file read into a summary.

The report merges summaries, never raw events, which keeps memory flat for
thousands of ranks; ``file_fold`` does the folding, event by event.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from nvrx.events.reader import ReadStats

from .file_fold import FileFolder, FileSummary, run_start
from .loading import read_events
from .values import num


@dataclass(frozen=True)
class Filters:
    """Which events the report considers (``--job``, ``--rank``, ``--node``, ``--since``)."""

    job: str | None = None
    rank: int | None = None
    node: int | None = None
    since: float | None = None

    def active(self) -> bool:
        return any(v is not None for v in (self.job, self.rank, self.node, self.since))

    def of_job(self, event: dict[str, Any]) -> bool:
        """Whether ``event`` belongs to the job asked for (``--job``); events that name no job do."""
        return self.job is None or event.get("job") is None or str(event["job"]) == self.job

    def keep(self, event: dict[str, Any]) -> bool:
        if not self.of_job(event):
            return False
        if self.rank is not None and event.get("rank") != self.rank:
            return False
        if self.node is not None and event.get("node") != self.node:
            return False
        if self.since is not None and num(event.get("wall"), 0.0) < self.since:
            return False
        return True


def summarize_file(path: str | os.PathLike[str], filters: Filters | None = None) -> FileSummary:
    """Read one event file and fold the events that ``filters`` keep into a ``FileSummary``.

    Damaged lines and an unreadable file are counted in its ``stats``, not raised. The
    starts of job runs are taken from every event of the job, whatever ``--rank``,
    ``--node`` or ``--since`` keep, so that the runs are the same with and without them.
    """
    stats = ReadStats()
    summary = FileSummary(path=str(path), stats=stats)
    folder = FileFolder(summary)
    filters = filters if filters is not None and filters.active() else None
    for event in read_events(path, stats):
        if event["kind"] == "supervisor_start":
            start = run_start(event)
            if start is not None and (filters is None or filters.of_job(event)):
                summary.run_starts.append(start)
        if filters is not None and not filters.keep(event):
            continue
        folder.add(event)
    folder.finish()
    return summary


__all__ = ["FileSummary", "Filters", "summarize_file"]
