"""Per-file summaries: which events the report considers, and one file read into a summary.

The report merges summaries, never raw events, which keeps memory flat for
thousands of ranks; ``file_fold`` does the folding, event by event.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from nvrx.events.reader import ReadStats, iter_file

from .file_fold import FileFolder
from .file_summary import FileSummary
from .loading import parse_lines, read_events, read_whole_lines
from .parts import RoundState
from .typed_events import decode_records
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
        if self.node is not None and node_of(event) != self.node:
            return False
        if self.since is not None and num(event.get("wall"), 0.0) < self.since:
            return False
        return True


def node_of(event: dict[str, Any]) -> Any:
    """The node an event is of for ``--node``: its writer's, but the faulted rank's for a
    fault another host's node agent wrote (``rank_host``, ``rank_node``). A supervisor's
    events, a spare's ``rank_node`` faults too, keep its slot, as the docs say."""
    if event.get("rank_host") is not None:
        return event.get("rank_node")
    return event.get("node")


def summarize_file(path: str | os.PathLike[str], filters: Filters | None = None) -> FileSummary:
    """Read one event file and fold the events that ``filters`` keep into a ``FileSummary``.

    Damaged lines and an unreadable file are counted in its ``stats``, not raised. The
    starts of job runs are taken from every event of the job, whatever ``--rank``,
    ``--node`` or ``--since`` keep, so that the runs are the same with and without them.
    """
    summary = fold_file(path, filters)
    assert summary is not None  # (only folding into a job's rounds can fail)
    return summary


def _fold_whole(
    path: str | os.PathLike[str], job_rounds: dict[Any, RoundState] | None
) -> tuple[FileSummary | None, bool]:
    """Every event of a well-formed file folded in one pass: (its summary, False); (None,
    True) when it proved damaged once some events were folded into ``job_rounds``; (None,
    False) when it is for the tolerant reader from the start."""
    data = read_whole_lines(path)
    if data is None:
        return None, False
    records = decode_records(data)  # checked as they are decoded (with msgspec)
    events = records if records is not None else parse_lines(data)
    if events is None:
        return None, False
    summary = FileSummary(path=str(path), stats=ReadStats(files=1, events=len(events)))
    folder = FileFolder(summary, run_starts=True, job_rounds=job_rounds)
    if records is not None:
        folder.fold_records(records)
    elif not folder.fold(events, parsed=True):  # checked as they are folded
        return None, job_rounds is not None
    folder.finish()
    summary.final_wall = summary.last_wall
    return summary, False


def fold_file(
    path: str | os.PathLike[str],
    filters: Filters | None = None,
    job_rounds: dict[Any, RoundState] | None = None,
) -> FileSummary | None:
    """``summarize_file``, with the file's rounds folded straight into ``job_rounds`` (a
    job's round states of run 0; ``aggregate_files``) when given: the summary's own
    ``rounds`` then stay empty. None when the file turned out damaged once some of its
    events were folded there: the caller must start over without ``job_rounds``.
    """
    everything = filters is None or not filters.active()
    if everything:  # one pass over millions of events
        summary, spoilt = _fold_whole(path, job_rounds)
        if summary is not None or spoilt:
            return summary
    # A damaged or unreadable file (straight to the tolerant reader: the parse above failed,
    # or the fold met an event it skips), or filters: the reader's events.
    stats = ReadStats()
    summary = FileSummary(path=str(path), stats=stats)
    events = list(iter_file(path, stats)) if everything else read_events(path, stats)
    if everything:
        folder = FileFolder(summary, run_starts=True, job_rounds=job_rounds)
        folder.fold(events)
    else:
        assert filters is not None
        folder = FileFolder(summary, job_rounds=job_rounds)
        kept = []
        for event in events:
            if filters.of_job(event):
                summary.note_seen(event)
            if filters.keep(event):
                kept.append(event)
        folder.fold(kept)
    folder.finish()
    if everything:
        summary.final_wall = summary.last_wall
    return summary


__all__ = ["FileSummary", "Filters", "fold_file", "summarize_file"]
