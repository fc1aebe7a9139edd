"""Where the job's wall time went (``TimeLedger``), and the calls that never ended.

The ledger splits the wall time into start-up, kept training, work lost since
the state was last saved (the union of the spans from the last save to each fault,
stop or unclean process end, when ``checkpoint`` saves or the ``committed_wall`` of a
kept-state restore tell the saves), fault
detection, restart, rejoin wait, requeue wait and the rest, so that the parts sum to the wall time: each part is capped at what
the parts before it left, in the order of ``TimeLedger``'s fields, and
``other_s`` takes the remainder. Training is the per-rank time in the
training function, less the lost work and the faults' detection (ranks wait in the
function until a hang's timeout or a lost node's silence tells); the other parts are
read off the job's runs and rounds.
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING

from .model import RoundRow, TimeLedger

if TYPE_CHECKING:
    from .job_summary import JobSummary
    from .node_loss import LossIndex

#: The Wrapper's restart phase in which ranks wait for replacements to rejoin.
REJOIN_PHASE = "rejoin_wait"
#: Exit codes of a child that ended cleanly (done, or a stop of the job it asked for).
CLEAN_EXITS = (0, 130)


def unfinished_call_s(job: JobSummary, losses: LossIndex) -> float:
    """Seconds of calls that never ended beyond what their file's last event counted: each
    ends when its process did, by its supervisor's ``child_exit`` (same host and pid), or
    when its node was lost; a call whose end the events do not tell keeps its count."""
    exits: dict[tuple[str | None, int], list[float]] = {}
    for e in job.node_events:
        pid, wall = e.get("child_pid"), e.get("wall")
        if e.get("kind") == "child_exit" and isinstance(pid, int) and wall is not None:
            exits.setdefault((e.get("host"), pid), []).append(wall)
    extra = 0.0
    for host, pid, rank, start, counted in job.open_calls:
        ends = [w for w in exits.get((host, pid), []) if w >= start] if pid is not None else []
        ends += [x.start for x in losses.in_run() if rank in x.ranks and x.start >= start]
        if ends:
            extra += max(0.0, min(ends) - start - counted)
    return extra


def _run_spans(job: JobSummary) -> list[tuple[float, float]]:
    """(first, last) wall of each job run, by its supervisors' events; one span without them.

    A run lasts until its last event written before the next run began: a node cut off from
    it may write for longer, its events told under the run its writer recorded, but the job
    was requeued by then (the wait for the requeue is not the cut-off node's to shorten).
    """
    walls: dict[int, list[float]] = {}
    for e in job.node_events:
        wall = e.get("wall")
        if wall is not None:
            walls.setdefault(e["run"], []).append(wall)
    if not walls and job.first_wall is not None and job.last_wall is not None:
        return [(job.first_wall, job.last_wall)]
    runs = [sorted(w) for _, w in sorted(walls.items())]
    spans = []
    for k, w in enumerate(runs):
        before = bisect.bisect_right(w, runs[k + 1][0]) if k + 1 < len(runs) else len(w)
        spans.append((w[0], w[before - 1] if before else w[-1]))
    return spans


def _startup_s(job: JobSummary, spans: list[tuple[float, float]]) -> float:
    """Per run, from its first supervisor start to its first round's start."""
    firsts: dict[int, float] = {}
    for (run, _), r in job.rounds.items():
        if r.started_wall is not None:
            firsts[run] = min(firsts.get(run, math.inf), r.started_wall)
    return sum(max(0.0, firsts[run] - lo) for run, (lo, _) in enumerate(spans) if run in firsts)


def _fault_wall(job: JobSummary, row: RoundRow, losses: LossIndex) -> float | None:
    """When the round's first fault happened: the lost node's last beat, else its earliest
    fault, less the time it took to detect it (a hang is written when its timeout passed)."""
    lost = [x.start for x in losses.losses if (x.run, x.round) == (row.run, row.round)]
    r = job.rounds.get((row.run, row.round))
    faults = r.first_by_rank.values() if r else ()
    walls = [f.onset for f in faults if f.onset is not None]
    return min(lost or walls, default=None)


def _since_save(job: JobSummary, end: float, began: float) -> tuple[float, float] | None:
    """(since, end): the training from the last checkpoint save before ``end`` (or from
    ``began``, if later) that a fault or stop at ``end`` threw away."""
    saves = job.state_saves
    i = bisect.bisect_right(saves, end)
    since = max(saves[i - 1], began) if i else began
    return (since, end) if end > since else None


def _lost_spans(
    job: JobSummary, timeline: list[RoundRow], losses: LossIndex
) -> list[tuple[float, float]]:
    """Training thrown away: in each round that did not complete, up to its fault (else its
    last event); in each process that did not end cleanly, up to its end."""
    spans = []
    for row in timeline:
        r = job.rounds.get((row.run, row.round))
        began = (r.started_wall if r is not None else None) or row.start_wall
        end = _fault_wall(job, row, losses) or row.end_wall
        if row.outcome != "completed" and began is not None and end is not None:
            spans.append(_since_save(job, end, began))
    for e in job.node_events:
        wall, runtime = e.get("wall"), e.get("runtime_s")
        clean = e.get("exit_code") in CLEAN_EXITS and e.get("signal") is None
        if e.get("kind") == "child_exit" and not clean and wall is not None and runtime is not None:
            spans.append(_since_save(job, wall, wall - runtime))
    return [x for x in spans if x is not None]


def _covered(spans: list[tuple[float, float]]) -> float:
    """Seconds the union of ``spans`` covers."""
    total, reach = 0.0, -math.inf
    for lo, hi in sorted(spans):
        if hi > reach:
            total += hi - max(lo, reach)
            reach = hi
    return total


def _restart_parts(
    job: JobSummary, row: RoundRow, fault: float | None
) -> tuple[float, float, float]:
    """(detection, restart, rejoin wait) of a round that ended in a restart."""
    detection = row.detection_s or 0.0
    rejoin = row.phases.get(REJOIN_PHASE, 0.0)
    latency = row.restart_latency_s
    nxt = job.rounds.get((row.run, row.round + 1))
    if latency is None and nxt is not None and nxt.started_wall is not None and fault is not None:
        latency = max(0.0, nxt.started_wall - fault - detection)
    return detection, max(0.0, (latency or 0.0) - rejoin), rejoin


def _waiting_share(job: JobSummary, row: RoundRow, losses: LossIndex, ranks: int) -> float:
    """The share of the job's ranks that wait in the function while the round's fault goes
    undetected: the round's ranks (after a shrink, fewer than the job's), less those of a
    node lost in that round (their processes are gone)."""
    if not ranks:
        return 1.0
    r = job.rounds.get((row.run, row.round))
    size = r.world_size if r is not None and r.world_size else ranks
    lost = {k for x in losses.losses if (x.run, x.round) == (row.run, row.round) for k in x.ranks}
    return min(1.0, max(0.0, (size - len(lost)) / ranks))


def build_ledger(
    job: JobSummary,
    timeline: list[RoundRow],
    losses: LossIndex,
    training_s: float,
    wall_s: float,
    ranks: int = 0,
) -> TimeLedger:
    """The ledger of ``wall_s``, with ``training_s`` the per-rank time in the function of
    ``ranks`` ranks (0: unknown, every rank counts as waiting through a detection)."""
    spans = _run_spans(job)
    requeue = sum((max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:], strict=False)), 0.0)
    lost = _covered(_lost_spans(job, timeline, losses)) if job.state_saves else 0.0
    detection = restart = rejoin = waiting = 0.0
    for row in timeline:
        fault = _fault_wall(job, row, losses)
        if row.outcome == "restart":
            parts = _restart_parts(job, row, fault)
            detection, restart, rejoin = detection + parts[0], restart + parts[1], rejoin + parts[2]
            waiting += parts[0] * _waiting_share(job, row, losses, ranks)
    wanted = {
        "requeue_wait_s": requeue,
        "startup_s": _startup_s(job, spans),
        # ranks wait in the function while a fault goes undetected: not training either
        "training_s": max(0.0, training_s - lost - waiting),
        "lost_work_s": lost,
        "detection_s": detection,
        "rejoin_wait_s": rejoin,
        "restart_s": restart,
    }
    left, kept = max(0.0, wall_s), {}
    for name, seconds in wanted.items():
        kept[name] = min(seconds, left)
        left -= kept[name]
    other = max(0.0, wall_s) - math.fsum(kept.values())
    return TimeLedger(
        wall_s=max(0.0, wall_s), other_s=other, lost_work_known=bool(job.state_saves), **kept
    )
