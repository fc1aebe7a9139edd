"""SLURM's side of a node loss: requeue without the lost node, end a job whose batch host died.

When the job cannot survive a loss, it is requeued held (``scontrol requeuehold``), its ``ExcNodeList``
gains the lost nodes, and it is released: the next allocation never lands on
a node that was just lost, and the job cannot start in between. A job
submitted with ``--no-requeue`` is left alone. A lost node that still runs a step of
the job is not excluded: its supervisor was lost (killed, say), not the node.

The batch script runs on the job's first node, with node 0's supervisor.
When that node is lost, the job survives it (``--no-kill``), but nothing is
left to end the job in SLURM: it would stay RUNNING until its time limit. The
store host that took over ends it when the training is done. A job of two
nodes has no store host to take over (``failover``): there the survivor asks
SLURM whether the other node still runs a step (``probe_other_of_two``), and
requeues the job without it when it does not and the job is still RUNNING a
while later. That wait lets a store host that is alive but cut off from the
survivor by a partition requeue first (without the survivor, whose supervisor
it saw fall silent): one requeue per loss, decided by the store host when it can.

SLURM requeues even a job that was cancelled or ended, so nothing is requeued
unless SLURM says the job is RUNNING (``job_running``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from nvrx.slurm import commands
from nvrx.slurm.nodelist import expand_nodelist

if TYPE_CHECKING:
    from .preemption import PreemptionHandler

log = logging.getLogger(__name__)
_NONE = ("", "(null)", "None")

#: Seconds between two questions to SLURM while waiting for a job to leave RUNNING.
_LOOK_S = 1.0


class Requeue(Protocol):
    """``requeue_without`` as the supervisor's parts call it (bound to its preemption and
    event writer)."""

    def __call__(self, host: str | None, probe: bool = True) -> None: ...


def requeue_excluding(job_id: str, lost: Iterable[str]) -> list[str] | None:
    """Requeue ``job_id`` excluding ``lost`` (SLURM node names); the excluded nodes, or None
    when the job may not be requeued. Raises ``SlurmCommandError`` when SLURM refuses."""
    info = commands.show_job(job_id)
    if _state(info) != "RUNNING":
        log.warning("job %s is %s, not RUNNING: not requeued for a lost node", job_id, _state(info))
        return None
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


def _state(info: Mapping[str, str] | None) -> str | None:
    """The ``JobState`` of ``scontrol show job``; None for a job slurmctld no longer knows."""
    return None if info is None else info.get("JobState")


def job_running(job_id: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether SLURM says ``job_id`` is RUNNING: not cancelled, timed out, ending or requeued
    already. A job that is not must not be requeued for a loss."""
    try:
        return _state(commands.show_job(job_id, env=env)) == "RUNNING"
    except (commands.SlurmCommandError, OSError) as exc:
        log.warning("cannot ask SLURM whether job %s runs: %s", job_id, exc)
        return False


def other_node_of_two(env: Mapping[str, str] = os.environ) -> str | None:
    """The first node of this SLURM step (``SLURM_STEP_NODELIST``), where node rank 0 and
    the store run (``topology``), when the step has exactly two nodes and this one
    (``SLURMD_NODENAME``) is the second; else None."""
    try:
        nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST", ""))
    except ValueError:
        return None
    if len(nodes) != 2 or nodes[0] == nodes[1] or env.get("SLURMD_NODENAME") != nodes[1]:
        return None
    return nodes[0]


def _still_running_after(job_id: str, settle_s: float, env: Mapping[str, str]) -> bool:
    """Whether ``job_id`` is still RUNNING ``settle_s`` from now; False as soon as it is not
    (a cancel, or a requeue by another supervisor)."""
    deadline = time.monotonic() + settle_s
    while job_running(job_id, env):
        if time.monotonic() >= deadline:
            return True
        time.sleep(_LOOK_S)  # no event tells that a job left RUNNING: SLURM is asked again
    return False


@dataclass(frozen=True)
class OtherNode:
    """What SLURM said of the other node of a two-node job (``probe_other_of_two``)."""

    node: str  # the step's first node, where node rank 0 and the store ran
    answered: bool  # whether a no-op step of the job ran there
    probe_s: float  # seconds that step took to run or to fail


def probe_other_of_two(
    job_id: str, settle_s: float, env: Mapping[str, str] = os.environ
) -> OtherNode | None:
    """Whether the first node of this two-node step still runs a SLURM step; None when SLURM
    cannot tell: the step is not of two nodes, the job is not RUNNING (cancelled, say: its
    nodes stop answering too), this node does not answer either, or a node that did not
    answer is followed within ``settle_s`` by the job leaving RUNNING (a cancel, or a
    requeue by a store host that is alive beyond a partition)."""
    other, own = other_node_of_two(env), env.get("SLURMD_NODENAME")
    if other is None or own is None:
        log.warning("node %s is not the second of a two-node step (SLURM_STEP_NODELIST=%s): "
                    "SLURM is not asked about node 0's node", own, env.get("SLURM_STEP_NODELIST"))  # fmt: skip
        return None
    if not job_running(job_id, env):
        log.warning("job %s is not RUNNING: SLURM is not asked about node %s", job_id, other)
        return None
    if not commands.node_answers(job_id, own, env=env):
        log.warning("node %s (this one) runs no SLURM step of job %s either: SLURM cannot "
                    "tell whether %s was lost", own, job_id, other)  # fmt: skip
        return None
    t0 = time.monotonic()
    answered = commands.node_answers(job_id, other, env=env)
    took = round(time.monotonic() - t0, 3)
    if not answered and not _still_running_after(job_id, settle_s, env):
        log.warning("node %s ran no step, but job %s left RUNNING within %.0f s: the node is "
                    "not counted as lost", other, job_id, settle_s)  # fmt: skip
        return None
    return OtherNode(other, answered, took)


def end_unrequeued(job_id: str, batch_host: str) -> None:
    """``scancel`` a job still RUNNING after its lost ``batch_host`` was excluded by a requeue
    that SLURM refused (``--no-requeue``, say): nothing else would end it before its time limit."""
    if not job_running(job_id):
        return
    log.warning("job %s lost node %s, which ran its batch script, and was not requeued: "
                "ending it", job_id, batch_host)  # fmt: skip
    try:
        commands.cancel([job_id])
    except (commands.SlurmCommandError, OSError) as exc:
        log.error("could not end job %s: %s", job_id, exc)


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
