"""A ``--job`` or ``--rank`` that names nothing in the logs: an error naming what is there.

Without it a typo'd job id or a rank beyond the job's world prints an empty report and
exits 0, as if the job had done nothing.
"""

from __future__ import annotations

from pathlib import Path

from .compact import compress_ints
from .loading import ReportError
from .summarize import Filters


def check_named(filters: Filters, jobs: set[str], ranks: set[int], directory: Path) -> None:
    """``ReportError`` (exit 2) when ``filters`` ask for a job or rank that none of the events
    of ``directory`` (``jobs``, ``ranks``: what they hold) names."""
    if filters.job is not None and jobs and filters.job not in jobs:
        raise ReportError(
            f"no job {filters.job!r} in {str(directory)!r}: jobs {', '.join(sorted(jobs))}"
        )
    if filters.rank is not None and filters.rank not in ranks:
        there = f"ranks {compress_ints(ranks)}" if ranks else "no rank wrote events"
        raise ReportError(f"no rank {filters.rank} in {str(directory)!r}: {there}")
