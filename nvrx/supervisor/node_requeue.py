"""SLURM's side of a node loss: requeue without the lost node, end a job whose batch host died.

When the job cannot survive a loss, it is requeued held (``scontrol requeuehold``), its ``ExcNodeList``
gains the lost nodes, and it is released: the next allocation never lands on
a node that was just lost, and the job cannot start in between. A job
submitted with ``--no-requeue`` is left alone. A lost node that still runs a step of
the job is not excluded: its supervisor was lost (killed, say), not the node.

The batch script runs on the job's first node, with node 0's supervisor.
When that node is lost, the job survives it (``--no-kill``), but nothing is
left to end the job in SLURM: it would stay RUNNING until its time limit. The
store host that took over ends it when the training is done.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from nvrx.slurm import commands

if TYPE_CHECKING:
    from .preemption import PreemptionHandler

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


def requeue_without(
    host: str | None,
    preemption: PreemptionHandler | None,
    emit: Callable[..., None],
    probe: bool = True,
) -> None:
    """Under SLURM, the job that stopped for a lost node runs again on other nodes. ``probe``:
    first ask whether the node still answers (not for a node that left on purpose)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id or not host:
        return
    # SLURM's node state lags a node's death by its SlurmdTimeout; a step answers now.
    answered = probe and commands.node_answers(job_id, host)
    if answered:
        log.warning(
            "node %s still runs SLURM steps: its supervisor was lost, not the node; "
            "requeued without excluding it", host,
        )  # fmt: skip
    try:
        excluded = requeue_excluding(job_id, [] if answered else [host])
    except (commands.SlurmCommandError, OSError) as exc:
        log.error("could not requeue job %s without %s: %s", job_id, host, exc)
        return
    if excluded is None:
        return
    count = None
    if preemption is not None:  # the next run's node 0 then knows who requeued, and why
        run = preemption.run_index
        count = preemption.ledger.append("node_failure", run, issued_by="nvrx")
    emit(
        "requeue", cause="node_failure", count=count, excluded=excluded,
        answered=[host] if answered else [],
    )  # fmt: skip
