"""The job's requeues for lost nodes, as the report keeps them: each ``requeue`` event the
supervisor wrote when lost nodes stopped the job (``node_requeue.requeue_without``: cause
``node_failure``, issued by nvrx).

Three of its outcomes ask something of the user, and only the event tells them after the
supervisor's log is gone: SLURM refused to release the requeued job (``held``: it waits
until someone releases it), refused to exclude lost nodes (``exclude_refused``, with
``exclude_error``: the next run may land on them), or lost nodes were left in because the
job names them in ``--nodelist`` (``required``: the next run waits for them). The answer
says each (``render_answer``). A requeue SLURM made itself (``issued_by`` slurm) names no
nodes and is not one of these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .model import NodeRequeue

if TYPE_CHECKING:
    from .job_summary import JobSummary


def node_requeues(job: JobSummary) -> list[NodeRequeue]:
    """Every requeue the supervisor made for lost nodes, in the order they were made."""
    found = [
        e
        for e in job.node_events
        if e.get("kind") == "requeue"
        and e.get("cause") == "node_failure"
        and e.get("issued_by") == "nvrx"
    ]
    return [
        NodeRequeue(
            run=e["run"],
            wall=e.get("wall"),
            slurm_job_id=e.get("slurm_job_id"),
            excluded=e.get("excluded") or [],
            answered=e.get("answered") or [],
            required=e.get("required") or [],
            exclude_refused=e.get("exclude_refused") or [],
            exclude_error=e.get("exclude_error"),
            held=e.get("held") is True,
        )
        for e in sorted(found, key=lambda e: (e["run"], e.get("wall") or 0.0))
    ]
