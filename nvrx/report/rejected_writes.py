"""Rejected writes: control values in the store that no process of the job wrote.

One process of the job (``docs/security.md`` names which, key by key) records a
``rejected_write`` event for each value of a sealed control key whose seal did not verify:
forged by a process without the job's secret, or replayed from another key, round or run.
The job acted on none of them; the report lists them, as a sign that something else
reaches the job's store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .model import RejectedWrite

if TYPE_CHECKING:
    from .job_summary import JobSummary


def build_rejected_writes(job: JobSummary) -> list[RejectedWrite]:
    """Every rejected write, in the order they were recorded."""
    found = [e for e in job.node_events if e.get("kind") == "rejected_write"]
    return [
        RejectedWrite(
            run=e["run"],
            wall=e.get("wall"),
            node=e.get("node"),
            key=e.get("key"),
            reason=e.get("reason"),
            value_bytes=e.get("value_bytes"),
        )
        for e in sorted(found, key=lambda e: e.get("wall") or 0.0)
    ]


__all__ = ["build_rejected_writes"]
