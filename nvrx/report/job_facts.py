"""What the report reads off the merged ``JobSummary`` as a whole.

The restarts of each kind, the processes relaunched, how the job ended, and
the facts of the events that judging the output files needs
(``output_triage``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from nvrx.events.failures import (
    EXCEPTION,
    PEER,
    kind_of,
    parse_traceback,
    process_end_signature,
    short_type,
    signature_type,
)

from .job_rounds import job_wide_restarts
from .job_summary import JobSummary
from .model import ProcessRestart, Restarts, RoundRow
from .node_events import STOP_KINDS
from .output_triage import Death, EventFacts
from .process_rows import NODE_LOST

if TYPE_CHECKING:
    from .node_loss import LossIndex


def child_runtime_s(job: JobSummary) -> float:
    """Seconds the supervised training processes ran, summed over processes."""
    return sum(
        e.get("runtime_s") or 0.0 for e in job.node_events if e.get("kind") == "child_exit"
    )


def relaunches(job: JobSummary) -> int:
    """Processes relaunched by a supervisor, whatever ended them. A spare's first start
    of each local rank after its ``node_takeover`` replaces a lost node: not a relaunch."""
    decisions = [e for e in job.node_events if e.get("kind") == "restart_decision"]
    if decisions:
        alone = sum(
            1 for e in decisions if e.get("decision") == "restart" and e.get("scope") != "job"
        )
        return alone + job_wide_restarts(job)[1]
    takeovers = {
        (e["run"], e.get("node")): e.get("wall") or 0.0
        for e in job.node_events
        if e.get("kind") == "node_takeover"
    }
    replaced: set[tuple[int, Any, Any]] = set()
    relaunched = 0
    for e in sorted(job.node_events, key=lambda e: e.get("wall") or 0.0):
        if e.get("kind") != "child_start" or (e.get("attempt") or 0) == 0:
            continue
        slot = (e["run"], e.get("node"))
        if slot in takeovers and (e.get("wall") or 0.0) >= takeovers[slot]:
            if (*slot, e.get("local_rank")) not in replaced:
                replaced.add((*slot, e.get("local_rank")))
                continue
        relaunched += 1
    return relaunched


def restarts(
    job: JobSummary,
    timeline: list[RoundRow],
    extra_requeues: int = 0,
    process_rows: Sequence[ProcessRestart] = (),
    node_losses: int = 0,
) -> Restarts:
    in_process = sum(
        1 for row in timeline if row.outcome == "restart" and row.outcome_from == "wrapper"
    )
    decisions = any(e.get("kind") == "restart_decision" for e in job.node_events)
    relaunched = relaunches(job)
    # A process that stopped only because a peer failed was relaunched, but did not fail.
    collateral = sum(
        1
        for p in process_rows
        if p.explained_by in (PEER, NODE_LOST) and (p.decision == "restart" or not decisions)
    )
    requeue_events = {
        (e.get("count") if e.get("count") is not None else e.get("wall"))
        for e in job.node_events
        if e.get("kind") == "requeue"
    }
    requeue = max(len(requeue_events), job.runs - 1, extra_requeues)
    job_wide, with_job = job_wide_restarts(job)
    return Restarts(
        in_process=in_process,
        process=max(0, relaunched - with_job - collateral),
        job_wide=job_wide,
        requeue=requeue,
        node_loss=node_losses,
    )


def event_signatures(job: JobSummary) -> tuple[set[str], set[str]]:
    """Signatures the events know (own and derived form), and exception types known without a traceback."""
    known = set(job.signatures) | job.told_signatures
    bare_types = {short_type(t) for t in job.told_types}
    for sig, g in job.signatures.items():
        parsed = parse_traceback(g.traceback) if g.traceback else None
        if parsed is not None:
            known.add(parsed.signature())
        elif kind_of(sig) == EXCEPTION:
            bare_types.add(short_type(g.exc_type or signature_type(sig) or sig))
    for e in job.node_events:
        if e.get("kind") == "child_exit":
            known.add(process_end_signature(e.get("exit_code"), e.get("signal")))
    return known, bare_types


def output_facts(
    job: JobSummary, process_rows: Sequence[ProcessRestart], losses: LossIndex
) -> EventFacts:
    """What judging the output files needs from the events (``output_triage``). A lost
    node's end is told by its ``node_lost``: its ranks and srun task (slot) are known, and
    SLURM's ``DUE TO NODE FAILURE`` by any node the job lost (``in_run``: a loss a cut-off
    supervisor declared after its run ended tells no failure of the job). Losses and
    supervisor ends are kept by run, with the hosts of each run's slots (its supervisor's
    events, a ``node_lost`` naming it): srun's lines name a task's host, not its run
    (``output_triage``)."""
    signatures, bare_types = event_signatures(job)
    facts = EventFacts(signatures=signatures, bare_types=bare_types)
    lost_ranks = losses.lost_ranks()
    if losses.in_run():
        for run, slot in losses.lost_slots():
            facts.lost_slots.setdefault(slot, set()).add(run)
        facts.slurm_causes.add("node_failure")
    for p in process_rows:
        if p.explained_by is None and p.error is not None and p.error.signature:
            facts.signatures.add(p.error.signature)  # its error file told the cause
        elif p.explained_by is None:
            death = Death(p.rank, p.node, p.host, process_end_signature(p.exit_code, p.signal))
            (facts.killed if p.signal is not None else facts.deaths).append(death)
    exit_hosts = {e.get("host") for e in job.node_events if e.get("kind") == "child_exit"}
    if job.wrapper_ends:  # the job went on after them: they did not just stop being read
        facts.deaths += [
            d for d in job.vanished if d.host not in exit_hosts and d.rank not in lost_ranks
        ]
    facts.node_hosts = {n: sorted(h)[0] for n, h in job.node_hosts.items() if h}
    facts.slot_hosts = {(run, s): h for (run, s), h in job.slot_hosts().items() if isinstance(s, int)}
    for loss in losses.losses:  # a lost slot's host, though its own supervisor wrote nothing
        if isinstance(loss.slot, int) and loss.host:
            facts.slot_hosts.setdefault((loss.run, loss.slot), set()).add(loss.host)
    facts.fault_ended_ranks = set(job.fault_ended_ranks)
    for e in job.node_events:
        kind, node, code = e.get("kind"), e.get("node"), e.get("exit_code")
        if kind == "supervisor_start":
            facts.supervised = True
        elif kind == "supervisor_end" and isinstance(node, int) and code is not None:
            facts.supervisor_exits.setdefault(node, {}).setdefault(e["run"], set()).add(code)
        elif kind in ("requeue", "preempt_signal") and isinstance(e.get("cause"), str):
            facts.slurm_causes.add(e["cause"])
    return facts


#: The outcome when ``--rank``/``--node``/``--since`` leave out every event that tells how the
#: job ended: it may have ended, or not; the events kept cannot say.
NOT_KNOWN = "not known under the filters"
NOT_KNOWN_REASON = (
    "the --rank/--node/--since filters leave out the events that tell how the job ended; "
    "run without them for its outcome"
)


def final_outcome(
    job: JobSummary,
    timeline: list[RoundRow],
    lost_slots: Collection[tuple[int, int]] = (),
    filtered: bool = False,
) -> tuple[str, str | None]:
    """How the job ended according to the events (last run, lowest node first). A lost
    slot's end (a fenced node's exit 9) says how the job ended only when no other does.
    ``filtered``: the events were filtered (``--rank``/``--node``/``--since``); without an
    end among them, the outcome is ``NOT_KNOWN``, not "unfinished"."""
    last_run = max((e["run"] for e in job.node_events), default=0)
    ends = [e for e in job.node_events if e["run"] == last_run and e.get("kind") in STOP_KINDS]
    kept = [e for e in ends if (last_run, e.get("node")) not in lost_slots]
    ends = sorted(
        kept or ends,
        key=lambda e: (
            e.get("node") if isinstance(e.get("node"), int) else 1 << 30,
            e.get("wall") or 0.0,
        ),
    )
    stop = next((e for e in ends if e["kind"] == "job_stop"), None)
    end = next((e for e in ends if e["kind"] == "supervisor_end"), None)
    reason = (stop or {}).get("reason") or (end or {}).get("reason")
    code = (end or {}).get("exit_code", (stop or {}).get("exit_code"))
    gave_up = _gave_up(job, timeline, last_run)
    if end is not None or stop is not None:
        if code in (0, RANK_STOPPED_EXIT) and gave_up is not None:
            return gave_up, reason
        if code == 0:
            return "completed", reason
        if code in REQUEUED_EXITS:
            return f"requeued (exit code {code})", reason
        return (f"failed (exit code {code})" if code is not None else "stopped"), reason
    if job.wrapper_ends:  # no end of a supervisor: the Wrappers' ends of the last run they ended in
        wrapper_run = max(r for r, _ in job.wrapper_ends)
        wrapper_ends = job.wrapper_ends_of(wrapper_run)
        if set(wrapper_ends) == {"completed"}:
            return "completed", f"all {sum(wrapper_ends.values())} ranks completed"
        summary = ", ".join(f"{k}: {v}" for k, v in sorted(wrapper_ends.items()))
        if set(wrapper_ends) == {"completed", "left"}:  # the others finished without them
            return "completed", f"wrapper ends: {summary}"
        worst = next((k for k in ("error", "restart_abort", "left") if k in wrapper_ends), "mixed")
        gave_up = _gave_up(job, timeline, wrapper_run)
        return gave_up if worst == "restart_abort" and gave_up else worst, f"wrapper ends: {summary}"
    if filtered:
        return NOT_KNOWN, NOT_KNOWN_REASON
    if timeline:
        return (
            "unfinished",
            f"no end event; last round {timeline[-1].round} {timeline[-1].outcome}",
        )
    return "unknown", "no end event (still running, or killed without a trace)"


#: ``nvrx-supervise``'s exit code when a rank stopped the job with exit 130 (``RestartAbort``);
#: older supervisors exited 0 for it.
RANK_STOPPED_EXIT = 12
#: ``nvrx-supervise``'s exit codes when a warning requeued the job (75; 144 under submitit's
#: local executor, which runs the task again on it): its next run goes on, it has not ended.
REQUEUED_EXITS = (75, 144)


def _gave_up(job: JobSummary, timeline: list[RoundRow], run: int) -> str | None:
    """``gave up: restart_abort after N rounds`` when a rank's Wrapper gave up restarting
    in job run ``run`` (its ``wrapper_end`` outcome ``restart_abort``), N that run's rounds."""
    if "restart_abort" not in job.wrapper_ends_of(run):
        return None
    rounds = sum(1 for row in timeline if row.run == run)
    return f"gave up: restart_abort after {rounds} round{'' if rounds == 1 else 's'}"

