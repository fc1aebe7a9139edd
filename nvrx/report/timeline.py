"""The restart timeline: one row per (run, round), with the first failure and how it was found.

Which fault came first: within one host boot monotonic clocks are exact, so
the earliest fault by ``mono`` (or ``detected_mono``) wins. Across hosts
monotonic clocks are not comparable; the rank that ``peer`` faults name as
``origin_rank`` (recorded in the store, so free of clock skew) decides, and
only without it wall clocks do, which the timeline says (``ordering``). A
round with no fault of its own is explained by a process death or a hang.
A round that a lost node interrupted is explained by the loss: the faults
written while the job got over it follow from it (``node_loss``). A follow-on
fault (``consequence``) is a round's cause only when no other fault is at hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nvrx.events.failures import (
    DEAD,
    NODE_LOST_SIGNATURE,
    PEER,
    UNRESPONSIVE,
    hang_signature,
    kind_of,
    process_end_signature,
)

from .consequence import FOLLOW_ON
from .job_rounds import run_end
from .model import NodeLoss, ProcessRestart, RoundRow
from .parts import LocalFault, RoundState, earlier, order_key
from .process_rows import NODE_LOST
from .round_windows import RoundWindows, Window
from .same_failure import same_process_end

if TYPE_CHECKING:
    from .job_summary import JobSummary
    from .node_loss import LossIndex

#: Round outcomes, most telling first, when ranks disagree.
_OUTCOME_ORDER = ("restart", "abort", "terminated", "completed")


def build_timeline(
    job: JobSummary, process_rows: Sequence[ProcessRestart], losses: LossIndex
) -> list[RoundRow]:
    """One row per (run, round). Rounds with no fault event of their own are explained by
    a process death (from its supervisor) or a hang report inside the round, if any; a
    round a node loss interrupted, by the loss (unless a fault came before it)."""
    rows = []
    windows = RoundWindows(job.rounds)
    for (run, rnd), r in sorted(job.rounds.items()):
        if losses.losses:
            r = _without_explained(r, run, losses)
        root, ordering = _root(r)
        row = _round_row(run, rnd, r, root, ordering)
        loss = loss_of(losses.losses, run, rnd)
        if loss is not None and (root is None or (root.onset or 0.0) >= loss.start):  # begun after its last beat
            _blame_loss(row, r, loss)
        elif row.first_rank is None and row.first_host is None:
            _explain(job, row, r, process_rows, windows.window(run, rnd))
        elif root is not None and kind_of(root.signature) in (DEAD, UNRESPONSIVE):
            _sharpen(row, root, process_rows)
        rows.append(row)
    _infer_outcomes(job, rows)
    return rows


def _infer_outcomes(job: JobSummary, rows: list[RoundRow]) -> None:
    """Outcomes of rounds no ``round_end`` reported (an app's own round counter under a
    supervisor): a later round of the run means its processes were restarted, and the
    run's last round ended as its supervisors did."""
    last_round: dict[int, int] = {}
    for row in rows:
        last_round[row.run] = max(last_round.get(row.run, row.round), row.round)
    ended = {run: run_end(job, run) for run in last_round}
    for row in rows:
        if job.rounds[(row.run, row.round)].outcomes:
            continue
        row.outcome_from = "inferred"
        if row.round < last_round[row.run]:
            row.outcome = "restart"
        elif ended[row.run] == "completed":
            row.outcome = "completed"


def _without_explained(r: RoundState, run: int, losses: LossIndex) -> RoundState:
    """``r``, a round of job run ``run``, without the faults that follow from a lost node of
    that run (``consequence``: from their onset, by their shape)."""
    kept = {k: f for k, f in r.first_by_rank.items() if losses.explains_fault(f, run) is None}
    if len(kept) == len(r.first_by_rank):
        return r
    copy = RoundState()
    copy.merge(r)
    copy.first_by_rank = kept
    return copy


def loss_of(losses: Sequence[NodeLoss], run: int, rnd: int) -> NodeLoss | None:
    """The loss that interrupted round ``rnd`` (a lost spare held no ranks: it interrupts none)."""
    return next((x for x in losses if (x.run, x.round) == (run, rnd) and x.ranks), None)


def _blame_loss(row: RoundRow, r: RoundState, loss: NodeLoss) -> None:
    """The lost node is the round's first failure; its silence was the detection time."""
    row.blame_node_loss(loss)
    row.cause, row.first_node = NODE_LOST_SIGNATURE, loss.node
    row.first_rank = loss.ranks[0] if loss.ranks else None
    lost = set(loss.ranks)
    local = {rank for rank in r.first_by_rank if rank is not None}
    row.also_failed = sorted(local - lost)
    row.peer_notified = len((r.peer_ranks | r.restarted_ranks) - lost - local)


def _blame(row: RoundRow, r: RoundState, how: str, cause: str, kind: str, who: Any) -> None:
    """Name ``who`` (a process row or a hang) as the first failure of ``row``."""
    row.cause, row.fault_kind, row.ordering = cause, kind, how
    row.first_rank, row.first_node, row.first_host = who.rank, who.node, who.host
    row.first_wall = who.wall
    row.peer_notified = len((r.peer_ranks | r.restarted_ranks) - {who.rank} - set(r.first_by_rank))


def _sharpen(row: RoundRow, root: LocalFault, process_rows: Sequence[ProcessRestart]) -> None:
    """A monitor saw the process vanish; its supervisor knows how it ended: say that."""
    for p in process_rows:
        if p.explained_by is None and same_process_end(root, p):
            row.cause = process_end_signature(p.exit_code, p.signal)
            return


def _explain(
    job: JobSummary,
    row: RoundRow,
    r: RoundState,
    process_rows: Sequence[ProcessRestart],
    window: Window | None,
) -> None:
    """Explain a round with no fault of its own by a process death in its ``window`` (its
    ``round_windows`` window: a process killed mid-round writes no last word), else a hang."""
    if window is None:
        return
    lo, hi = window
    voted = r.voted_origin()
    deaths = [
        p
        for p in process_rows
        if p.run == row.run
        and p.wall is not None
        and lo <= p.wall < hi
        and p.explained_by not in (PEER, NODE_LOST)
    ]
    if voted is not None and any(p.rank == voted for p in deaths):
        deaths = [p for p in deaths if p.rank == voted]
    if deaths:
        first = min(deaths, key=lambda p: p.wall or 0.0)
        cause = process_end_signature(first.exit_code, first.signal)
        _blame(row, r, "process_exit", cause, "dead", first)
        return
    hangs = [h for h in job.hangs if h.run == row.run and h.round == row.round]
    if voted is not None and any(h.rank == voted for h in hangs):
        hangs = [h for h in hangs if h.rank == voted]
    if hangs:
        first_hang = min(hangs, key=lambda h: h.wall or 0.0)
        _blame(row, r, "hang", hang_signature(first_hang.timeout), "hang", first_hang)
        return
    if voted is not None:
        row.first_rank, row.ordering = voted, "store_origin"
        row.cause = row.cause or f"fault reported by peers (rank {voted})"


def _clock(f: LocalFault) -> tuple[str, str | None]:
    """Whose monotonic clock ``f`` was read on: its host boot's, else (unknown boot) its host's."""
    return ("boot", f.boot) if f.boot is not None else ("host", f.host)


def _own(r: RoundState) -> dict[int | None, LocalFault]:
    """The round's faults that may be its cause: follow-on faults (``consequence``) only
    when no fault of another shape is at hand."""
    own = {k: f for k, f in r.first_by_rank.items() if f.shape != FOLLOW_ON}
    return own or r.first_by_rank


def _root(r: RoundState) -> tuple[LocalFault | None, str]:
    candidates = _own(r)
    faults = list(candidates.values())
    if not faults:
        return None, "none"
    by_clock: dict[tuple[str, str | None], LocalFault] = {}
    for f in faults:
        seen = by_clock.get(_clock(f))
        if seen is None or earlier(f, seen):
            by_clock[_clock(f)] = f
    if len(by_clock) == 1:
        only = next(iter(by_clock.values()))
        exact = only.boot is not None and only.mono is not None
        return only, "monotonic" if exact else "wall_clock"
    voted = r.voted_origin()
    if voted is not None and voted in candidates:
        return candidates[voted], "store_origin"
    return min(by_clock.values(), key=order_key), "wall_clock"


def _round_row(
    run: int, rnd: int, r: RoundState, root: LocalFault | None, ordering: str
) -> RoundRow:
    outcome = next((o for o in _OUTCOME_ORDER if o in r.outcomes), None)
    if outcome is None:
        outcome = next(iter(sorted(r.outcomes)), None) or "unfinished"
    local_ranks = {rank for rank in _own(r) if rank is not None}
    followers = {rank for rank in r.first_by_rank if rank is not None} - local_ranks
    root_rank = root.rank if root is not None else None
    return RoundRow(
        run=run,
        round=rnd,
        start_wall=r.first_wall,
        end_wall=r.last_wall,
        outcome=outcome,
        cause=root.signature if root is not None else None,
        fault_kind=root.fault_kind if root is not None else None,
        first_rank=root_rank,
        first_node=root.node if root is not None else None,
        first_host=root.host if root is not None else None,
        first_wall=root.wall if root is not None else None,
        ordering=ordering,
        also_failed=sorted(local_ranks - {root_rank}),
        peer_notified=len((r.peer_ranks | r.restarted_ranks | followers) - local_ranks),
        hang_ranks=sorted(r.hang_ranks),
        terminated_ranks=sorted(r.terminated),
        detection_s=root.detection_s if root is not None else None,
        phases=dict(sorted(r.phases.items())),
        failed_phases=sorted(r.failed_phases),
        restart_latency_s=r.restart_latency_s,
    )
