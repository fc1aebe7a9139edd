"""SLURM's side of a node loss: requeue without the lost node, end a job whose batch host died.

When the job cannot survive a loss, it is requeued held (``scontrol requeuehold``), its ``ExcNodeList``
gains the lost nodes, and it is released: the next allocation never lands on
a node that was just lost, and the job cannot start in between. A job
submitted with ``--no-requeue`` is left alone. A lost node that still runs a step of
the job is not excluded: its supervisor was lost (killed, say), not the node.

The batch script runs on the job's batch host (SLURM's ``BatchHost``: the job's
first node, where node 0's supervisor runs too under the sbatch templates). When that
node is lost, the job survives it (``--no-kill``), but nothing is left to end the job in
SLURM: it would stay RUNNING until its time limit. The store host that took over ends it
when the training is done, if the batch host runs no step then (``orphaned_by``). When
no store host takes over (``failover``: two slots, too few left for a majority, or a
successor that published no store), the first survivor whose node answers and that
claims it asks SLURM whether the batch host and the nodes of the silent slots still run
a step (``probe_step_nodes``); when the batch host does not, it requeues the job without
every node that did not, if the job is still RUNNING a while later. That wait lets a store host that is alive but cut off from the
survivors by a partition requeue first (without them, whose supervisors it saw fall
silent): one requeue per loss, decided by the store host when it can.

SLURM requeues even a job that was cancelled or ended, so nothing is requeued
unless SLURM says the job is RUNNING (``job_running``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from nvrx.slurm import commands
from nvrx.slurm.nodelist import expand_nodelist

if TYPE_CHECKING:
    from .preemption import PreemptionHandler

log = logging.getLogger(__name__)
_NONE = ("", "(null)", "None")

#: Seconds between two questions to SLURM while waiting for a job to leave RUNNING.
_LOOK_S = 1.0
#: No-op steps asked of SLURM at once, when every node of a step is asked whether it answers.
_PROBES_AT_ONCE = 16


class Requeue(Protocol):
    """``requeue_without`` as the supervisor's parts call it (bound to its preemption and
    event writer)."""

    def __call__(self, hosts: list[str | None], probe: bool = True) -> None: ...


@dataclass(frozen=True)
class Requeued:
    """A requeue for lost nodes that SLURM made. Once ``scontrol requeuehold`` succeeded the
    job is requeued whatever SLURM says of the two commands after it, so their refusals are
    told here, not raised."""

    excluded: list[str]  # the job's ExcNodeList as SLURM holds it for the next run
    exclude_error: str | None = None  # why the lost nodes are not in it: SLURM refused the update
    held: bool = False  # SLURM refused to release it: it waits until ``scontrol release JOB``
    # Lost nodes its ``--nodelist`` names, left out of ExcNodeList: the next run waits for them.
    required: list[str] = field(default_factory=list)
    # Lost nodes SLURM refused to add to ExcNodeList (``exclude_error``): the next run may get them.
    exclude_refused: list[str] = field(default_factory=list)


def requeue_excluding(job_id: str, lost: Iterable[str]) -> Requeued | None:
    """Requeue ``job_id`` excluding ``lost`` (SLURM node names) but those its ``--nodelist``
    names (those are told in ``required``); None when the job may not be requeued. Raises
    ``SlurmCommandError`` when SLURM refuses the requeue itself."""
    info = commands.show_job(job_id)
    if _state(info) != "RUNNING":
        log.warning("job %s is %s, not RUNNING: not requeued for a lost node", job_id, _state(info))
        return None
    if info is None or info.get("Requeue") != "1":
        log.warning("job %s is not requeueable (--no-requeue): not requeued", job_id)
        return None
    excluded = info.get("ExcNodeList", "")
    before = commands.show_hostnames(excluded) if excluded not in _NONE else []
    asked = info.get("ReqNodeList", "")
    required = set(commands.show_hostnames(asked)) if asked not in _NONE else set()
    lost = list(dict.fromkeys(n for n in lost if n))  # each once; read twice below
    kept = [n for n in lost if n in required]
    if kept:  # excluded, a node the job asked for by name would leave it pending for ever
        log.warning("job %s asked for %s by name (--nodelist): not excluded, the next run waits "
                    "for it", job_id, ", ".join(kept))  # fmt: skip
    added = [n for n in lost if n not in before and n not in required]
    # requeuehold sends SIGTERM to every process of this job, the next two commands included
    commands.run_command(["scontrol", "requeuehold", str(job_id)], outlive_job_end=True)
    return replace(_exclude_and_release(job_id, before, added), required=kept)


def _exclude_and_release(job_id: str, before: list[str], added: list[str]) -> Requeued:
    """Add ``added`` to the ``ExcNodeList`` of ``job_id``, requeued held, and release it. A
    refusal of either leaves the job requeued: the update's, with the nodes it had excluded
    before; the release's, held until someone releases it. With nothing to add (each lost
    node asked for by name, or still answering) the list is left as it is, unasked."""
    names, error = before, None
    try:
        if added:
            commands.run_command(
                ["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(before + added)}"],
                outlive_job_end=True,
            )
            names = before + added
    except (commands.SlurmCommandError, OSError) as exc:
        error = str(exc)
        log.error("job %s is requeued, but its next run may land on %s: SLURM did not exclude "
                  "them (%s)", job_id, ", ".join(added), exc)  # fmt: skip
    held = False
    try:
        commands.run_command(["scontrol", "release", str(job_id)], outlive_job_end=True)
    except (commands.SlurmCommandError, OSError) as exc:
        held = True
        log.error("job %s is requeued but held: SLURM did not release it (%s); run "
                  "`scontrol release %s` to let it start", job_id, exc, job_id)  # fmt: skip
    return Requeued(names, error, held, exclude_refused=added if error is not None else [])


def _state(info: Mapping[str, str] | None) -> str | None:
    """The ``JobState`` of ``scontrol show job``; None for a job slurmctld no longer knows."""
    return None if info is None else info.get("JobState")


def _running_job(job_id: str, env: Mapping[str, str] | None = None) -> Mapping[str, str] | None:
    """``scontrol show job`` of ``job_id`` while SLURM says it is RUNNING; None when it is not
    (cancelled, timed out, ending or requeued already) or SLURM cannot be asked."""
    try:
        info = commands.show_job(job_id, env=env)
    except (commands.SlurmCommandError, OSError) as exc:
        log.warning("cannot ask SLURM whether job %s runs: %s", job_id, exc)
        return None
    return info if _state(info) == "RUNNING" else None


def job_running(job_id: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether SLURM says ``job_id`` is RUNNING. A job that is not must not be requeued for a loss."""
    return _running_job(job_id, env) is not None


def batch_host(info: Mapping[str, str]) -> str | None:
    """The node that runs the job's batch script (``BatchHost``); None for a job without one
    (``BatchFlag=0``: an allocation that ``salloc`` or ``srun`` holds from outside it)."""
    host = info.get("BatchHost", "")
    return None if info.get("BatchFlag") == "0" or host in _NONE else host


def step_nodes(env: Mapping[str, str] = os.environ) -> tuple[list[str], int] | None:
    """The nodes of this SLURM step (``SLURM_STEP_NODELIST``: slot ``i`` started on node ``i``)
    and this node's place among them
    (``SLURMD_NODENAME``); None when the list cannot be read, names a node twice, or does
    not hold this node."""
    try:
        nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST", ""))
    except ValueError:
        return None
    own = env.get("SLURMD_NODENAME")
    if len(set(nodes)) != len(nodes) or own not in nodes:
        return None
    return nodes, nodes.index(own)


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
class StepAnswers:
    """What SLURM said of nodes of this step (``probe_step_nodes``)."""

    nodes: tuple[str, ...]  # the step's nodes: slot i started on node i
    batch_host: str | None  # the node of the batch script (``batch_host``), asked first
    asked: tuple[str, ...]  # the nodes asked
    answered: frozenset[str]  # those of them that ran a no-op step of the job
    probe_s: Mapping[str, float]  # seconds each one's step took to run or to fail

    @property
    def batch_host_answered(self) -> bool:
        """Whether the batch script's node still runs steps; true of a job without a batch
        script, whose allocation ends with what holds it."""
        return self.batch_host is None or self.batch_host in self.answered

    @property
    def silent(self) -> list[tuple[int, str]]:
        """Slot and node of every node of the step asked that ran no step."""
        return [(self.nodes.index(n), n) for n in self.asked if n in self.nodes and n not in self.answered]

    @property
    def unanswered(self) -> list[str]:
        """Every node asked that ran no step: those of ``silent``, and the batch host when it
        is not a node of the step."""
        return [n for n in self.asked if n not in self.answered]


def _answers(
    job_id: str, nodes: Sequence[str], env: Mapping[str, str]
) -> dict[str, tuple[bool, float]] | None:
    """Whether each of ``nodes`` runs a no-op step of ``job_id``, and how long it took to
    tell; asked at once, so that silent nodes cost one probe's timeout, not one each. None
    when a step could not even be started here (no answer about the node, then)."""

    def ask(node: str) -> tuple[bool | None, float]:
        t0 = time.monotonic()
        try:
            answered: bool | None = commands.node_answers(job_id, node, env=env)
        except OSError as exc:
            log.warning("cannot ask SLURM whether node %s runs a step: %s", node, exc)
            answered = None
        return answered, round(time.monotonic() - t0, 3)

    with ThreadPoolExecutor(min(len(nodes), _PROBES_AT_ONCE), "nvrx-probe") as pool:
        try:
            asking = [pool.submit(ask, node) for node in nodes]
        except RuntimeError as exc:  # no thread can be started
            log.warning("cannot ask SLURM about nodes %s: %s", ", ".join(nodes), exc)
            return None
        told = {node: future.result() for node, future in zip(nodes, asking, strict=True)}
    if any(answered is None for answered, _ in told.values()):
        return None
    return {node: (bool(answered), took) for node, (answered, took) in told.items()}


def probe_step_nodes(
    job_id: str, slot: int, nslots: int, silent_slots: Iterable[int], settle_s: float, *,
    claim: Callable[[], bool] = lambda: True, env: Mapping[str, str] = os.environ,
) -> StepAnswers | None:  # fmt: skip
    """Ask SLURM whether the job's batch host and the nodes of ``silent_slots`` still run a
    step of the job, for the survivor at ``slot`` of ``nslots``, after a loss the job
    cannot survive (``failover``). Once this node answers, ``claim`` says whether this
    survivor is the one that asks about the others. When the batch host does not answer,
    the answers count only if the job is still RUNNING ``settle_s`` later.

    None when SLURM cannot tell or another survivor asks: the step is not of ``nslots``
    nodes, this node is not the step's node of ``slot``, the job is not RUNNING (cancelled,
    say: its nodes stop answering too), this node does not answer, the claim is another's,
    a step cannot be started, or the batch host does not answer and within ``settle_s``
    the job leaves RUNNING (a cancel, or a requeue by a store host that is alive beyond a
    partition)."""
    step = step_nodes(env)
    if step is None or step[1] != slot or len(step[0]) != nslots:
        log.warning("slot %d of %d: node %s is not node %d of a step of %d nodes "
                    "(SLURM_STEP_NODELIST=%s): SLURM is not asked about the others", slot, nslots,
                    env.get("SLURMD_NODENAME"), slot, nslots, env.get("SLURM_STEP_NODELIST"))  # fmt: skip
        return None
    nodes, own = step[0], step[0][slot]
    info = _running_job(job_id, env)
    if info is None:
        log.warning("job %s is not RUNNING: SLURM is not asked about its nodes", job_id)
        return None
    mine = _answers(job_id, [own], env)
    if mine is None or not mine[own][0]:
        log.warning("node %s (this one) runs no SLURM step of job %s either: SLURM cannot "
                    "tell which nodes were lost", own, job_id)  # fmt: skip
        return None
    if not claim():
        return None
    batch = batch_host(info)
    asked = [batch] if batch is not None else []
    asked += [nodes[s] for s in sorted(set(silent_slots) - {slot}) if s < nslots and nodes[s] != batch]
    others = [n for n in asked if n != own]
    told = _answers(job_id, others, env) if others else {}
    if told is None:
        return None
    told[own] = mine[own]
    answers = StepAnswers(
        tuple(nodes), batch, tuple(asked), frozenset(n for n in asked if told[n][0]),
        {n: told[n][1] for n in asked},
    )  # fmt: skip
    if answers.batch_host_answered:
        return answers
    if not _still_running_after(job_id, settle_s, env):
        log.warning("nodes %s ran no step, but job %s left RUNNING within %.0f s: they are not "
                    "counted as lost", answers.unanswered, job_id, settle_s)  # fmt: skip
        return None
    return answers


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


def orphaned_by(job_id: str) -> str | None:
    """The batch host of ``job_id`` when it runs no step of the job while the job is still
    RUNNING: the batch script died with it, and nothing would end the job before its time
    limit. None when the job is not RUNNING, has no batch script or its batch host answers
    (the script ends the job when its supervisors end)."""
    info = _running_job(job_id)
    host = None if info is None else batch_host(info)
    if host is None:
        return None
    if commands.node_answers(job_id, host):
        log.info("node %s still runs the batch script of job %s: it ends the job", host, job_id)
        return None
    return host


def end_orphaned_job(job_id: str, host: str) -> None:
    """``scancel`` a job whose batch script died with its node ``host``, once its work is done."""
    log.warning("job %s lost its batch host %s: ending it now that its training is done", job_id, host)
    commands.cancel([job_id])


def _record_answers(told: dict[str, tuple[bool, float]] | None, emit: Callable[..., None]) -> None:
    """The answers about lost nodes asked before a requeue that did not happen, as
    ``node_probe`` events (no ``requeue`` event carries them then): a node that still ran a
    step lost its supervisor, not itself, and is not one to exclude."""
    for host, (answered, took) in (told or {}).items():
        emit("node_probe", lost_slot=None, lost_host=host, responding=answered, probe_s=took, note=None)


def requeue_without(
    hosts: list[str | None],
    preemption: PreemptionHandler | None,
    emit: Callable[..., None],
    probe: bool = True,
) -> None:
    """Under SLURM, the job that stopped for lost nodes runs again on other nodes. ``probe``:
    first ask whether each node still answers, all at once (not for a node that left on purpose,
    nor for nodes just asked); when SLURM cannot be asked about one of them, all count as silent."""
    job_id = os.environ.get("SLURM_JOB_ID")
    lost = [host for host in hosts if host]
    if not job_id or not lost:
        return
    # SLURM's node state lags a node's death by its SlurmdTimeout; a step answers now.
    told = _answers(job_id, lost, os.environ) if probe else None
    answered = [host for host in lost if told is not None and told[host][0]]
    for host in answered:
        log.warning(
            "node %s still runs SLURM steps: its supervisor was lost, not the node; "
            "requeued without excluding it", host,
        )  # fmt: skip
    try:
        requeued = requeue_excluding(job_id, [host for host in lost if host not in answered])
    except (commands.SlurmCommandError, OSError) as exc:
        log.error("could not requeue job %s without %s: %s", job_id, ", ".join(lost), exc)
        requeued = None
    if requeued is None:
        _record_answers(told, emit)
        return
    count = run = None
    if preemption is not None:  # the next run's node 0 then knows who requeued, and why
        run = preemption.run_index
        count = preemption.ledger.append("node_failure", run, issued_by="nvrx")
    emit("requeue", cause="node_failure", count=count, excluded=requeued.excluded, answered=answered,
         run=run, issued_by="nvrx", exclude_error=requeued.exclude_error, held=requeued.held,
         required=requeued.required, exclude_refused=requeued.exclude_refused,
         slurm_job_id=job_id)  # fmt: skip
