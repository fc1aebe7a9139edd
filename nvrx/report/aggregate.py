"""Event files folded into one ``JobSummary``: the unit of work of a worker process."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from .file_summary import FileSummary
from .job_summary import JobSummary
from .summarize import Filters, fold_file, summarize_file


def aggregate_files(
    paths: Sequence[str | os.PathLike[str]],
    filters: Filters | None = None,
    run_starts: dict[str, list[float]] | None = None,
) -> JobSummary:
    """Summarize and merge ``paths`` into one ``JobSummary`` (the unit of work of a worker process).

    When the job ran once (each supervisor started once), every file's rounds are of run 0,
    and the files fold them straight into the job's: no round state of a file is merged.
    A file that starts a run itself, or is damaged, has the files folded one by one instead.
    """
    job = JobSummary.starting(run_starts)
    if job.runs == 1:
        for path in paths:
            fs = fold_file(path, filters, job_rounds=job.rounds)
            if fs is None or fs.run_starts:
                break
            job.add(fs)
        else:
            return job
        job = JobSummary.starting(run_starts)
    for path in paths:
        job.add(summarize_file(path, filters))
    return job


def run_starts_of(summaries: Iterable[FileSummary]) -> dict[str, list[float]]:
    """``supervisor_start`` wall times per ``run_key`` in ``summaries``: where each job run begins."""
    starts: dict[str, list[float]] = {}
    for fs in summaries:
        for key, wall in fs.run_starts:
            starts.setdefault(key, []).append(wall)
    return starts
