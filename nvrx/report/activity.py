"""Who ran when, and where each fault struck: the data of the HTML timeline (``render_html``).

Derived from what ``build_report`` already has: each supervised process's life is a
``child_start`` and the ``child_exit`` after it on the same slot and local rank (the
processes of a lost node write no exit: their life ends with the node's loss); a
spare is a slot past the run's training nodes (``nnodes - spare_nodes``), standing
by from its ``supervisor_start`` until its ``node_takeover``; a fault mark is one
occurrence of a failure signature of the report's failure table.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from nvrx.events.failures import NODE_LOST_SIGNATURE, hang_signature, process_end_signature

from .failure_groups import untold_hangs
from .model import (
    Activity,
    Failure,
    FaultMark,
    NodeLoss,
    ProcessRestart,
    ProcessSpan,
    RoundRow,
    RunSpan,
    SpareSpan,
)
from .process_rows import events_by_slot, nprocs

if TYPE_CHECKING:
    from .job_summary import JobSummary
    from .node_loss import LossIndex

log = logging.getLogger(__name__)

#: ``ProcessSpan.ended`` of a process whose node was declared lost while it ran.
LOST = "node lost"

_LIFE_KINDS = ("child_start", "child_exit")


def _runs(job: JobSummary, timeline: Sequence[RoundRow]) -> list[RunSpan]:
    """Each run from its first to its last supervisor event (or round bound); with no
    supervisor events (none written, or ``--rank`` left them out), each run of the rounds
    from its first to its last round bound, the first from the job's first event and the
    last to its last; without rounds of several runs, one run: the job's first to last event."""
    if not job.node_events:
        return _runs_of_rounds(job, timeline)
    walls: dict[int, list[float]] = {}
    for e in job.node_events:
        if e.get("wall") is not None:
            walls.setdefault(e["run"], []).append(e["wall"])
    for row in timeline:
        walls.setdefault(row.run, []).extend(w for w in (row.start_wall, row.end_wall) if w is not None)
    return [RunSpan(run, min(w), max(w)) for run, w in sorted(walls.items()) if w]


def _runs_of_rounds(job: JobSummary, timeline: Sequence[RoundRow]) -> list[RunSpan]:
    """``_runs`` without supervisor events."""
    if job.first_wall is None:
        return []
    walls: dict[int, list[float]] = {}
    for row in timeline:
        walls.setdefault(row.run, []).extend(w for w in (row.start_wall, row.end_wall) if w is not None)
    spans = [RunSpan(run, min(w), max(w)) for run, w in sorted(walls.items()) if w]
    if len(spans) < 2:
        return [RunSpan(0, job.first_wall, job.last_wall)]
    begun = max(job.run_starts.values(), key=len, default=[])  # supervisor starts: known whatever the filters
    for span in spans:
        if span.run < len(begun):
            span.start_wall = min(begun[span.run], span.start_wall or begun[span.run])
    spans[0].start_wall = min(job.first_wall, spans[0].start_wall or job.first_wall)
    last = job.last_wall if job.last_wall is not None else spans[-1].end_wall
    spans[-1].end_wall = max(last or 0.0, spans[-1].end_wall or 0.0)
    return spans


def _loss_during(
    losses: list[NodeLoss], start: float | None, end: float | None
) -> NodeLoss | None:
    """The loss of its slot (``losses``) while a process ran (from ``start`` to ``end``), if any.
    A process with no recorded end also died with a loss declared after it started (its node's
    last heartbeat may predate its start)."""
    for loss in losses:
        lost = loss.start
        if not math.isfinite(lost):
            continue
        declared = loss.declared_wall if loss.declared_wall is not None else lost
        after_start = start is None or lost >= start or (end is None and declared >= start)
        if after_start and (end is None or lost < end):
            return loss
    return None


def _span(
    nprocs: dict[int, int],
    losses: LossIndex,
    slot_losses: list[NodeLoss],
    slot_key: tuple[int, Any, str | None, Any],
    start: dict[str, Any] | None,
    end: dict[str, Any] | None,
) -> ProcessSpan:
    run, slot, host, local_rank = slot_key
    t0 = start.get("wall") if start is not None else None
    t1 = end.get("wall") if end is not None else None
    node = losses.node_rank(run, slot, t0 if t0 is not None else t1)
    told = [e.get("global_rank") for e in (end, start) if e is not None]
    rank = next((r for r in told if isinstance(r, int) and r >= 0), None)
    nproc = nprocs.get(run)
    if rank is None and isinstance(node, int) and isinstance(local_rank, int) and nproc:
        rank = node * nproc + local_rank if 0 <= local_rank < nproc else None
    ended = process_end_signature(end.get("exit_code"), end.get("signal")) if end else None
    loss = _loss_during(slot_losses, t0, t1)
    if loss is not None:  # dead to the job from its node's last sign of life on
        t1, ended = loss.start if t0 is None else max(t0, loss.start), LOST
    return ProcessSpan(
        run=run,
        rank=rank,
        node=node if isinstance(node, int) else None,
        slot=slot if isinstance(slot, int) else None,
        host=host,
        local_rank=local_rank,
        start_wall=t0,
        end_wall=t1,
        ended=ended,
    )


def _processes(job: JobSummary, losses: LossIndex) -> list[ProcessSpan]:
    """Each ``child_start`` paired with the next ``child_exit`` of its slot and local rank."""
    by_slot = events_by_slot(job, _LIFE_KINDS)
    spans: list[ProcessSpan] = []
    per_node = nprocs(job)
    of_slot: dict[tuple[int, Any], list[NodeLoss]] = {}
    for loss in losses.in_run():
        of_slot.setdefault((loss.run, loss.slot), []).append(loss)
    for key, events in by_slot.items():
        span = partial(_span, per_node, losses, of_slot.get(key[:2], []), key)
        # at one time, the old process's exit comes before its replacement's start
        events.sort(key=lambda e: (e.get("wall") or 0.0, e["kind"] != "child_exit"))
        started: dict[str, Any] | None = None
        for e in events:
            if e["kind"] == "child_start":
                if started is not None:  # its exit is not in the events read
                    spans.append(span(started, None))
                started = e
            else:
                spans.append(span(started, e))
                started = None
        if started is not None:
            spans.append(span(started, None))
    spans.sort(key=lambda s: (s.run, s.rank if s.rank is not None else -1, s.start_wall or 0.0))
    return spans


def _spares(job: JobSummary, losses: LossIndex) -> list[SpareSpan]:
    """Slots that started as spares: standing by until their takeover, else until their end."""
    starts = []
    for e in job.node_events:
        slot, nnodes = e.get("node"), e.get("nnodes")
        spare_nodes = e.get("spare_nodes") or 0
        if e.get("kind") != "supervisor_start" or not isinstance(slot, int) or not nnodes:
            continue
        if nnodes > 0 and spare_nodes > 0 and slot >= nnodes - spare_nodes:
            starts.append(e)
    last: dict[tuple[int, Any], float] = {}  # (run, slot) -> its last event's wall
    for x in job.node_events if starts else ():
        if x.get("wall") is not None:
            key = (x["run"], x.get("node"))
            last[key] = max(last.get(key, x["wall"]), x["wall"])
    spans = []
    for e in starts:
        run, slot, start = e["run"], e["node"], e.get("wall")
        taken = losses.takeovers.get((run, slot))
        if taken is not None and (start is None or taken[0] >= start):
            end, took = taken
        else:
            end, took = last.get((run, slot), start), None
        spans.append(SpareSpan(run, slot, e.get("host"), start, end, took))
    spans.sort(key=lambda s: (s.run, s.slot if s.slot is not None else -1))
    return spans


def _faults(
    job: JobSummary,
    failures: Sequence[Failure],
    process_rows: Sequence[ProcessRestart],
    losses: LossIndex,
) -> list[FaultMark]:
    """Each occurrence of a failure the events tell (``failures`` rows of source ``events``):
    the faults' own, failed processes, hangs no hang fault tells, lost nodes (one mark per
    rank each held). What a lost node explains is left out, as in the failure table."""
    wanted = {f.signature for f in failures if f.source == "events"}
    marks: dict[tuple[Any, ...], FaultMark] = {}

    def add(sig: str, rank: Any, node: Any, host: Any, rnd: Any, wall: float | None, run: Any) -> None:
        if sig in wanted:
            key = (sig, rank, node, None if wall is None else round(wall, 3))
            marks.setdefault(key, FaultMark(sig, rank, node, host, rnd, wall, run))

    for sig, group in job.signatures.items():
        for wall, rank, node, host, rnd, shape, onset, run in group.seen:
            if losses.explains(onset, shape, signature=sig, run=run) is None:  # as in the failure table
                add(sig, rank, node, host, rnd, wall, run)
    for p in process_rows:
        if p.explained_by is None:
            told = p.error.signature if p.error is not None else None
            add(told or process_end_signature(p.exit_code, p.signal), p.rank, p.node, p.host, None, p.wall, p.run)
    for h in untold_hangs(job, losses):  # as in the failure table
        add(hang_signature(h.timeout), h.rank, h.node, h.host, h.round, h.wall, h.run)
    for loss in losses.in_run():
        wall = loss.start if math.isfinite(loss.start) else None
        for rank in loss.ranks or [None]:
            add(NODE_LOST_SIGNATURE, rank, loss.node, loss.host, loss.round, wall, loss.run)
    return sorted(
        marks.values(),
        key=lambda m: (m.wall if m.wall is not None else math.inf, m.rank if m.rank is not None else -1, m.signature),
    )


def build_activity(
    job: JobSummary,
    timeline: Sequence[RoundRow],
    failures: Sequence[Failure],
    process_rows: Sequence[ProcessRestart],
    losses: LossIndex,
    ranks: list[int] | None = None,
) -> Activity:
    """The job's runs, process lives, spares' waits and fault marks (``Report.activity``);
    ``ranks``: the ranks that wrote the events kept when ``--rank``/``--node`` restricted them."""
    activity = Activity(
        runs=_runs(job, timeline),
        processes=_processes(job, losses),
        spares=_spares(job, losses),
        faults=_faults(job, failures, process_rows, losses),
        ranks=ranks,
    )
    log.debug(
        "activity: %d run(s), %d process(es), %d spare(s), %d fault mark(s)",
        len(activity.runs),
        len(activity.processes),
        len(activity.spares),
        len(activity.faults),
    )
    return activity
