"""The report's first screen, the answer: how the job ended, what a requeue for lost nodes
left to do (a job SLURM left held, lost nodes it did not exclude), each fault in time order
with its root cause and what it cost, and which nodes to exclude next time, with the evidence.

Everything here but the requeues' outcomes (the JSON's ``node_requeues``) is also in the
sections below it; this one puts it first, one line a fault.
A fault that follows from another one (``consequence``: a peer's communication error, an
abort by the Wrapper) is marked ``follow-on`` when it is a round's only cause at hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nvrx.events.failures import kind_of, process_end_signature

from .consequence import FOLLOW_ON, fault_shape
from .job_facts import NOT_KNOWN
from .model import (
    BY_NODE_LOSS,
    NodeLoss,
    NodeRequeue,
    ProcessRestart,
    ReportData,
    RoundRow,
    Summary,
)
from .render_losses import recovery
from .text_doc import Command, Doc, ranks_text, secs, when, where
from .timeline import loss_of

#: What ``verdict`` says of a job's outcome (UNKNOWN: the filters left out its end).
OK, FAILED, UNFINISHED, UNKNOWN = "ok", "failed", "unfinished", "unknown"
#: Outcomes (ours, or SLURM's states, lowercase) of a job that has not ended, or not said how.
_UNFINISHED = ("unknown", "unfinished", "running", "pending", "requeued", "resizing", "suspended")
#: At most this many faults are listed on the first screen; the sections below have them all.
MAX_FAULT_LINES = 12
#: Nodes kept out of ``--exclude`` named on the first screen, with their evidence.
MAX_KEPT_LINES = 5


def verdict(summary: Summary) -> str:
    """``OK`` (the job completed), ``UNFINISHED`` (not ended, or not said how), ``UNKNOWN``
    (the filters left out the events that would tell) or ``FAILED``."""
    outcome = summary.outcome.lower()
    if outcome.startswith("completed"):
        return OK
    if outcome.startswith(NOT_KNOWN):
        return UNKNOWN
    return UNFINISHED if outcome.startswith(_UNFINISHED) else FAILED


def first_failure(row: RoundRow) -> str:
    """Who failed first in ``row``: a rank and its node, or the lost node."""
    if row.ordering == BY_NODE_LOSS:
        return f"lost node {where(row.first_node, row.first_host)}"
    if row.first_rank is not None or row.first_host is not None:
        return f"rank {row.first_rank} on {where(row.first_node, row.first_host)}"
    return "-"


@dataclass
class FaultLine:
    """One fault as the first screen tells it."""

    wall: float | None
    kind: str
    cause: str
    first: str
    round: str
    recovered: str
    cost: str


def clock(wall: float | None) -> str:
    """The time of day of ``wall`` (the summary gives the date)."""
    return when(wall).partition(" ")[2] or when(wall)


def _round_label(run: int, rnd: int | None, many_runs: bool) -> str:
    text = "-" if rnd is None else str(rnd)
    return f"{text} (run {run})" if many_runs else text


def _follow_on(row: RoundRow) -> bool:
    """Whether the round's cause tells that another fault went first."""
    return fault_shape(None, None, row.cause) == FOLLOW_ON


def _recovered(row: RoundRow, rows: list[RoundRow]) -> str:
    later = [t for t in rows if (t.run, t.round) > (row.run, row.round)]
    if any(t.run == row.run for t in later):
        return "yes"
    return "yes, requeued" if later else "no"


def _loss_cost(loss: NodeLoss) -> str:
    if loss.recovery_s is not None:
        return f"trained again after {secs(loss.recovery_s)}"
    return f"trained again after: {recovery(loss)}"


def _round_cost(r: ReportData, row: RoundRow) -> str:
    loss = loss_of(r.node_losses, row.run, row.round) if row.ordering == BY_NODE_LOSS else None
    if loss is not None:
        return _loss_cost(loss)
    parts = []
    if row.detection_s is not None:
        parts.append(f"detection {secs(row.detection_s)}")
    if row.restart_latency_s is not None:
        parts.append(f"restart {secs(row.restart_latency_s)}")
    return ", ".join(parts) or "-"


def _fault_wall(r: ReportData, row: RoundRow) -> float | None:
    """When ``row``'s first fault was told, else when its cause was first seen inside it,
    else when the round ended."""
    lo, hi = row.start_wall, row.end_wall
    if row.first_wall is not None:
        return row.first_wall
    for f in r.failures:
        at = f.first_wall
        inside = at is not None and (lo is None or lo <= at) and (hi is None or at <= hi)
        if f.signature == row.cause and inside:
            return at
    return hi if hi is not None else lo


def _round_lines(r: ReportData) -> list[FaultLine]:
    rows = sorted(r.timeline, key=lambda t: (t.run, t.round))
    many = r.summary.runs > 1
    return [
        FaultLine(
            _fault_wall(r, t),
            (kind_of(t.cause) if t.cause else "-") + (" (follow-on)" if _follow_on(t) else ""),
            t.cause or "-",
            first_failure(t),
            _round_label(t.run, t.round, many),
            _recovered(t, rows),
            _round_cost(r, t),
        )
        for t in rows
        if t.cause is not None
    ]


def _loss_lines(r: ReportData) -> list[FaultLine]:
    """Lost nodes that no round of the timeline names as its cause (no Wrapper, a spare)."""
    told = {(t.run, t.round) for t in r.timeline if t.ordering == BY_NODE_LOSS}
    many = r.summary.runs > 1
    return [
        FaultLine(
            x.start if x.last_seen_wall is not None or x.declared_wall is not None else None,
            "node",
            "node lost",
            f"lost node {where(x.node, x.host)}",
            _round_label(x.run, x.round, many),
            "no" if x.action == "stop" else f"yes ({x.action})",
            _loss_cost(x),
        )
        for x in r.node_losses
        if (x.run, x.round) not in told and not x.after_run_end
    ]


def _process_line(p: ProcessRestart, rnd: str = "-") -> FaultLine:
    told = p.error.signature if p.error is not None else None
    kind = "exception" if told else ("signal" if p.signal else "exit")
    return FaultLine(
        p.wall,
        kind,
        told or process_end_signature(p.exit_code, p.signal),
        f"rank {p.rank} on {where(p.node, p.host)}",
        rnd,
        "yes" if p.decision == "restart" and p.relaunch_s is not None else "no",
        f"relaunch {secs(p.relaunch_s)}" if p.relaunch_s is not None else "-",
    )


def _uncaused_ends(r: ReportData) -> list[FaultLine]:
    """Processes that failed on their own in a round with no cause (the last round of a job
    that stopped: no restart followed to name it)."""
    rows = sorted(r.timeline, key=lambda t: (t.run, t.round))
    many = r.summary.runs > 1
    out: list[FaultLine] = []
    for i, row in enumerate(rows):
        if row.start_wall is None:  # a round no event started (a restart still under way) holds no time
            continue
        later = (t.start_wall for t in rows[i + 1 :] if t.run == row.run and t.start_wall is not None)
        nxt = next(later, None)
        lo, hi = row.start_wall, nxt if nxt is not None else math.inf
        out += [
            _process_line(p, _round_label(row.run, row.round, many))
            for p in r.process_restarts
            if row.cause is None and p.explained_by is None and p.run == row.run
            and p.wall is not None and lo <= p.wall < hi
        ]  # fmt: skip
    return out


def fault_lines(r: ReportData) -> list[FaultLine]:
    """Every fault of the job, in time order: the rounds' causes, the processes that failed
    on their own in a round with no cause, and the lost nodes; without rounds, the processes
    that failed on their own; failing those, the failure signatures."""
    lines = _round_lines(r) + _uncaused_ends(r) + _loss_lines(r)
    if not r.timeline:
        lines += [_process_line(p) for p in r.process_restarts if p.explained_by is None]
    if not lines:
        lines = [
            FaultLine(
                f.first_wall,
                f.category,
                f.signature,
                f"ranks {ranks_text(f.ranks)}" if f.ranks else ", ".join(f.hosts) or "-",
                ranks_text(f.rounds),
                "-",
                "-",
            )
            for f in r.failures
        ]
    return sorted(lines, key=lambda x: (x.wall is None, x.wall or 0.0))


def no_exclude_reason(r: ReportData) -> str:
    """Why no host is to be excluded."""
    if not r.suspects:
        return "no node-level faults"
    if len(r.summary.hosts) < 2:
        return "the job ran on one host, with no other to compare it with"
    if any(n.lost for n in r.suspects):
        return "each lost node's host also ran nodes that stayed healthy, or SLURM saw it respond"
    return "no evidence against any node itself (a fault seen on several hosts is the code's)"


def _outcome(r: ReportData) -> str:
    s = r.summary
    said = {OK: "", FAILED: "FAILED: ", UNFINISHED: "NOT FINISHED: ", UNKNOWN: ""}[verdict(s)]
    reason = f" ({s.reason})" if s.reason else ""
    goodput = f", goodput {s.goodput * 100:.1f} %" if s.goodput is not None else ""
    size = f"{s.ranks} ranks on {s.nodes} node(s), {secs(s.wall_time_s)} wall{goodput}"
    return f"outcome: {said}{s.outcome}{reason}; {size}"


#: Stands for the SLURM job id in a command, for an older writer's event that did not name
#: it: the events' job may be ``NVRX_JOB_ID``, which SLURM does not know.
UNNAMED_SLURM_JOB = "<SLURM job id>"


def _requeue_said(q: NodeRequeue, started: bool) -> list[str | Command]:
    """What requeue ``q`` asks of the user, a line each, and the commands to run, for the
    SLURM job it requeued; ``started``: a later run of the job is in the events, so the
    requeued job did start."""
    job = q.slurm_job_id or UNNAMED_SLURM_JOB
    said: list[str | Command] = []
    if q.held and not started:
        said += [
            "HELD: SLURM refused to release the requeued job: it waits held until released. "
            "To let it start, run:",
            Command(f"scontrol release {job}"),
        ]
    elif q.held:
        said.append(
            f"held: SLURM refused to release the requeued job; run {q.run + 1} started once it "
            "was released"
        )
    if q.exclude_refused or q.exclude_error:
        nodes, (it, _) = ", ".join(q.exclude_refused) or "the lost nodes", _it(q.exclude_refused)
        why = " ".join((q.exclude_error or "no reason recorded").split())
        said.append(f"SLURM refused to exclude {nodes} ({why}): the next run may land on {it}")
    if q.required:
        nodes, (it, is_) = ", ".join(q.required), _it(q.required)
        named = f"{nodes} not excluded: the job names {it} in --nodelist, so"
        if started:
            said.append(
                f"{named} run {q.run + 1} could start only with {it}. Leave {it} out of "
                "--nodelist next time"
            )
        else:
            said += [
                f"{named} the requeued job waits pending while {it} {is_} down. To run without "
                f"{it}, cancel the job and submit it again with a --nodelist that leaves {it} "
                "out. To cancel it, run:",
                Command(f"scancel {job}"),
            ]
    return said


def _it(names: list[str]) -> tuple[str, str]:
    """The pronoun of ``names`` and its "to be": one node is "it", and "is"."""
    return ("it", "is") if len(names) == 1 else ("them", "are")


def requeue_lines(r: ReportData) -> list[str | Command]:
    """What the job's requeues for lost nodes ask of the user: to release a job SLURM left
    held, that lost nodes SLURM would not exclude may run it again, that it waits for lost
    nodes its ``--nodelist`` names. Only the events tell these once the log is gone."""
    out: list[str | Command] = []
    for q in r.node_requeues:
        said = _requeue_said(q, q.run + 1 < r.summary.runs)
        if said:
            out.append(f"requeued for lost nodes (run {q.run}):")
            out += [x.under(2) if isinstance(x, Command) else f"  {x}" for x in said]
    return out


def answer_section(doc: Doc, r: ReportData) -> None:
    """The first screen: outcome, what a requeue for lost nodes asks of the user, faults in
    time order, exclusion advice with its evidence."""
    doc.heading(f"nvrx report: job {r.summary.job or '?'}")
    doc.outcome(_outcome(r), verdict(r.summary))
    requeued = requeue_lines(r)
    if requeued:
        doc.lines(requeued)
    lines = fault_lines(r)
    if not lines:
        doc.text("faults: none")
    else:
        more = len(lines) - MAX_FAULT_LINES
        shown = f" (first {MAX_FAULT_LINES}; {more} more below)" if more > 0 else ""
        doc.text(f"faults, in time order{shown}:")
        rows = [
            [str(i), clock(x.wall), x.kind, x.cause, x.first, x.round, x.recovered, x.cost]
            for i, x in enumerate(lines[:MAX_FAULT_LINES], start=1)
        ]
        headers = [
            "#",
            "at (UTC)",
            "kind",
            "root cause",
            "first failure",
            "round",
            "recovered",
            "cost",
        ]
        doc.table(rows, headers)
    if r.exclude:
        said = [f"exclude next time: --exclude={r.exclude}"]
        said += [
            f"  {where(n.node, n.host)}: {'; '.join(n.evidence)}" for n in r.suspects if n.suspect
        ]
        doc.text("\n".join(said))
    else:
        doc.text(f"exclude next time: nothing ({no_exclude_reason(r)})")
    kept = [
        f"  kept {where(n.node, n.host)}: {'; '.join(n.evidence)}"
        for n in r.suspects
        if not n.suspect and n.evidence
    ]
    if len(kept) > MAX_KEPT_LINES:
        more = len(kept) - MAX_KEPT_LINES
        kept[MAX_KEPT_LINES:] = [f"  and {more} more (Suspect nodes, below; JSON: evidence)"]
    if kept:
        doc.text("\n".join(["not excluded, though it had faults:", *kept]))
