"""Per-file summaries: which events the report considers, and one file read into a summary.

The report merges summaries, never raw events, which keeps memory flat for
thousands of ranks; ``file_fold`` does the folding, event by event.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from nvrx.events.reader import ReadStats

from .file_fold import FileFolder, FileSummary
from .loading import read_events
from .values import num

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Filters:
    """Which events the report considers (``--job``, ``--rank``, ``--node``, ``--since``)."""

    job: str | None = None
    rank: int | None = None
    node: int | None = None
    since: float | None = None

    def active(self) -> bool:
        return any(v is not None for v in (self.job, self.rank, self.node, self.since))

    def keep(self, event: dict[str, Any]) -> bool:
        if self.job is not None and event.get("job") is not None and str(event["job"]) != self.job:
            return False
        if self.rank is not None and event.get("rank") != self.rank:
            return False
        if self.node is not None and event.get("node") != self.node:
            return False
        if self.since is not None and num(event.get("wall"), 0.0) < self.since:
            return False
        return True


def summarize_file(path: str | os.PathLike[str], filters: Filters | None = None) -> FileSummary:
    """Read one event file and fold it into a ``FileSummary`` (never raises on bad content)."""
    stats = ReadStats()
    summary = FileSummary(path=str(path), stats=stats)
    folder = FileFolder(summary)
    keep = filters.keep if filters is not None and filters.active() else None
    for event in read_events(path, stats):
        if keep is not None and not keep(event):
            continue
        folder.add(event)
    folder.finish()
    return summary


__all__ = ["FileSummary", "Filters", "summarize_file"]
