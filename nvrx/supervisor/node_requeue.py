"""SLURM's side of a node loss: requeue without the lost node, end a job whose batch host died.

When the job cannot survive a loss, it is requeued held (``scontrol requeuehold``), its ``ExcNodeList``
gains the lost nodes, and it is released: the next allocation never lands on
a node that was just lost, and the job cannot start in between. A job
submitted with ``--no-requeue`` is left alone.

The batch script runs on the job's first node, with node 0's supervisor.
When that node is lost, the job survives it (``--no-kill``), but nothing is
left to end the job in SLURM: it would stay RUNNING until its time limit. The
store host that took over ends it when the training is done.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from nvrx.slurm import commands

log = logging.getLogger(__name__)
_NONE = ("", "(null)", "None")


def requeue_excluding(job_id: str, lost: Iterable[str]) -> list[str] | None:
    """Requeue ``job_id`` excluding ``lost`` (SLURM node names); the excluded nodes, or None
    when the job may not be requeued. Raises ``SlurmCommandError`` when SLURM refuses."""
    info = commands.show_job(job_id)
    if info is None or info.get("Requeue") != "1":
        log.warning("job %s is not requeueable (--no-requeue): not requeued", job_id)
        return None
    excluded = info.get("ExcNodeList", "")
    names = commands.show_hostnames(excluded) if excluded not in _NONE else []
    names += [n for n in lost if n and n not in names]
    # requeuehold sends SIGTERM to every process of this job, the next two commands included
    commands.run_command(["scontrol", "requeuehold", str(job_id)], outlive_job_end=True)
    try:
        commands.run_command(
            ["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(names)}"],
            outlive_job_end=True,
        )
    finally:
        commands.run_command(["scontrol", "release", str(job_id)], outlive_job_end=True)
    return names


def end_orphaned_job(job_id: str) -> None:
    """``scancel`` a job whose batch script died with its node, once its work is done."""
    log.warning("job %s lost its batch host: ending it now that its training is done", job_id)
    commands.cancel([job_id])
