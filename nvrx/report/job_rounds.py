"""Rounds of a job that ran without the Wrapper: the stretches between job-wide restarts.

Without the in-process Wrapper no rank writes round events. Under
``--ft-restart-policy any-failed`` the supervisors restart every rank together
and say so in ``job_restart`` events: epoch ``e`` ends stretch ``e - 1`` and
starts stretch ``e``. Each stretch becomes one timeline row: the failure the
restart announced (its supervisor won the restart's claim in the store, so no
clock decides who was first), the hangs inside it, and how long the restart
took, from the first node stopping its children to the last node starting them
again. The last stretch ends as the run's supervisors did. A restart announced for
a lost node is that loss's round (``BY_NODE_LOSS``), as a Wrapper round it interrupted is;
so is one announced for a survivor's failure that the loss explains (``consequence``):
one that began after the node's last heartbeat, or a follow-on fault (a hang among them:
a rank waiting for the lost peer stops progressing before its last heartbeat) in the
detection window before it (it follows from the loss, declared only later). A restart
announced for the lost node takes its loss before any other stretch can. A supervisor cut
off from the job may announce one after its run ended, for a node it declared lost then:
no loss of the job (``_node_lost_first``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nvrx.events.failures import (
    NODE,
    NODE_LOST_SIGNATURE,
    hang_signature,
    kind_of,
)

from .model import NodeLoss, RoundRow

if TYPE_CHECKING:
    from .job_summary import JobSummary
    from .model import Hang
    from .node_loss import LossIndex

#: ``ordering`` of a row whose first failure the job-wide restart's claim named.
BY_RESTART_CLAIM = "job_restart"
#: ``outcome_from`` of such rows.
FROM_JOB_RESTARTS = "job_restart"


def job_restart_rounds(job: JobSummary, losses: LossIndex) -> list[RoundRow]:
    """One row per stretch of each run that had a job-wide restart; none for other runs."""
    by_run: dict[int, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for e in job.node_events:
        if e.get("kind") == "job_restart" and isinstance(e.get("epoch"), int):
            by_run[e["run"]][e["epoch"]].append(e)
    world = job.supervised_world()
    rows: list[RoundRow] = []
    causes: list[tuple[RoundRow, dict[str, Any]]] = []
    for run, epochs in sorted(by_run.items()):
        start, abandoned = min(_walls(job, run, "child_start"), default=None), False
        for epoch, events in sorted(epochs.items()):
            stopping = [e["wall"] for e in events if e.get("phase") == "stopping"]
            started = [e["wall"] for e in events if e.get("phase") == "started"]
            end = min(stopping, default=None)
            cause = next((e["cause"] for e in events if e.get("cause")), None) or {}
            abandoned = not started and any(e.get("phase") == "timed_out" for e in events)
            row = _row(job, run, epoch - 1, start, end, run_end(job, run) if abandoned else "restart")
            _time_restart(row, events, end, started)
            causes.append((row, cause))
            rows.append(row)
            start = max(started, default=None)
        if not abandoned:  # (a restart that timed out started nothing: the run ended with it)
            last = max(epochs)
            rows.append(_row(job, run, last, start, max(_walls(job, run, "supervisor_end"), default=None), run_end(job, run)))
    blamed: set[int] = set()  # id() of the losses a stretch already has
    # A restart announced for a lost node takes its loss first: an earlier stretch whose
    # failure the loss's window would explain too does not take it from it.
    announced = [(row, cause) for row, cause in causes if _announces_loss(cause)]
    for row, cause in announced + [(row, cause) for row, cause in causes if not _announces_loss(cause)]:
        _name_cause(job, row, cause, world, losses, blamed)
    return rows


def _announces_loss(cause: dict[str, Any]) -> bool:
    """Whether a job-wide restart's cause names a lost node."""
    signature = cause.get("signature")
    return isinstance(signature, str) and kind_of(signature) == NODE


def _time_restart(
    row: RoundRow, events: list[dict[str, Any]], end: float | None, started: list[float]
) -> None:
    """How long the restart took, from the first node stopping its children to the last one
    starting them again, and its two phases. These are several hosts' wall clocks: a span
    that their skew makes negative counts as none."""
    if end is None or not started:
        return
    row.restart_latency_s = max(0.0, max(started) - end)
    ready = [e["wall"] for e in events if e.get("phase") == "ready"]
    if ready:
        row.phases = {
            "stop children": max(0.0, max(ready) - end),
            "start children": max(0.0, max(started) - max(ready)),
        }


def _row(
    job: JobSummary,
    run: int,
    rnd: int,
    start: float | None,
    end: float | None,
    outcome: str,
) -> RoundRow:
    """The stretch from ``start`` to ``end`` as a row, with the hangs told in it; its cause is
    named later (``_name_cause``), once every stretch of the job is known."""
    return RoundRow(
        run=run, round=rnd, start_wall=start, end_wall=end, outcome=outcome,
        hang_ranks=sorted({h.rank for h in _hangs(job, run, start, end) if h.rank is not None}),
        outcome_from=FROM_JOB_RESTARTS,
    )  # fmt: skip


def _hangs(job: JobSummary, run: int, start: float | None, end: float | None) -> list[Hang]:
    """The hangs of ranks of the run told between ``start`` and ``end``."""
    return [
        h
        for h in job.hangs
        if h.run == run and h.wall is not None and h.rank is not None and _within(h.wall, start, end)
    ]


def restart_ended(row: RoundRow) -> float | None:
    """When the job-wide restart that ended ``row`` had started every node's children again
    (its end, where it has no start): a failure of the stretch is told by then, whatever the
    hosts' clocks."""
    if row.end_wall is None:
        return None
    return row.end_wall + max(0.0, row.restart_latency_s or 0.0)


def _name_cause(
    job: JobSummary, row: RoundRow, cause: dict[str, Any], ranks: int, losses: LossIndex, blamed: set[int]
) -> None:
    """The announced failure as the row's first failure; every other rank restarted with it."""
    row.cause = cause.get("signature")
    row.first_rank, row.first_node = cause.get("rank"), cause.get("node")
    if row.cause is not None:
        row.fault_kind = kind_of(row.cause)
    loss = _node_lost_first(row, losses) if row.fault_kind == NODE else _loss_first(job, row, losses, blamed)
    if loss is not None and id(loss) in blamed:
        loss = None
    if loss is not None:
        blamed.add(id(loss))
        if row.fault_kind != NODE:  # a survivor's failure that followed from the loss
            row.cause, row.fault_kind = NODE_LOST_SIGNATURE, NODE
            row.first_rank, row.first_node = (loss.ranks[0] if loss.ranks else None), loss.node
        row.blame_node_loss(loss)
    elif row.first_rank is not None:
        row.ordering = BY_RESTART_CLAIM
        row.first_host = _host_of_node(job, row, losses)
    if loss is not None:  # the lost ranks and what the loss explains are no failures of their own
        hung = _hangs(job, row.run, row.start_wall, row.end_wall)
        own = {h.rank for h in hung if h.rank is not None and losses.explains_hang(h, among=lambda x: x is loss) is None}
        row.also_failed = sorted(own - set(loss.ranks))
        row.peer_notified = max(0, ranks - len(loss.ranks) - len(row.also_failed))
        return
    row.also_failed = [r for r in row.hang_ranks if r != row.first_rank]
    row.peer_notified = (
        max(0, ranks - 1 - len(row.also_failed)) if row.first_rank is not None else ranks
    )


def _node_lost_first(row: RoundRow, losses: LossIndex) -> NodeLoss | None:
    """The loss that a restart for a lost node stands for. A supervisor cut off from the
    job may announce one after its run ended, for the node it then declared lost
    (``NodeLoss.after_run_end``): that is no loss the job had, and the stretch is then the
    one of the loss the job had of that supervisor's own node, when the job declared it in
    the stretch; else the restart names no failure of the job (the row's cause is cleared)."""
    loss = _lost_node(row, losses, lambda x: x.node == row.first_node)
    if loss is None or not loss.after_run_end:
        return loss
    own = _lost_node(row, losses, lambda x: x.slot == loss.seen_by and not x.after_run_end)
    if own is None:
        row.cause = row.fault_kind = row.first_rank = row.first_node = None
        return None
    row.first_rank, row.first_node = (own.ranks[0] if own.ranks else None), own.node
    return own


def _lost_node(row: RoundRow, losses: LossIndex, which: Callable[[NodeLoss], bool]) -> NodeLoss | None:
    """The first loss of the row's run that ``which`` accepts, declared in the stretch. (Its
    ``round`` may be set already, by the app's own round counter's windows: the stretches
    are the rounds now.)"""
    until = restart_ended(row)
    return next(
        (
            x
            for x in losses.losses
            if x.run == row.run and which(x)
            and _within(x.declared_wall or x.start, row.start_wall, until)
        ),
        None,
    )


def _loss_first(
    job: JobSummary, row: RoundRow, losses: LossIndex, blamed: set[int]
) -> NodeLoss | None:
    """The loss that the announced failure followed from: one of the run that no other
    stretch has (a restart announced for the lost node takes it first), of a node that held ranks (not a lost spare), last seen no earlier than the
    stretch began, that explains the failure as ``consequence`` says, from its onset and by
    its shape (``_onset``): a follow-on fault may begin before the heartbeat, so the loss may
    begin after the restart was claimed. Stretches do not overlap: one loss is one stretch's."""
    if row.end_wall is None:
        return None
    onset, shape, signature = _onset(job, row, row.end_wall)

    def ours(loss: NodeLoss) -> bool:
        """Whether this stretch may take ``loss``: the run's, of a node that held ranks, last
        seen no earlier than the stretch began, and no other stretch's."""
        return (
            loss.run == row.run and bool(loss.ranks) and id(loss) not in blamed
            and _within(loss.start, row.start_wall, None)
        )  # fmt: skip

    return losses.explains(onset, shape, among=ours, signature=signature, run=row.run)


def _onset(job: JobSummary, row: RoundRow, end: float) -> tuple[float, str | None, str | None]:
    """When the announced failure began, its shape and signature: the failed rank's last
    fault told in the stretch of the announced signature (else its last one: what ended its
    process), from its onset (a hang's: the rank's last progress); without one, its
    process's last end in the stretch; without that, when the restart was claimed (``end``).
    Only the row's run's faults: a node cut off from an ended run may tell a late fault of
    a rank of the same number inside the stretch."""
    if row.first_rank is None:
        return end, None, None
    told: list[Told] = [
        (wall, onset, shape, signature)
        for signature, group in job.signatures.items()
        for wall, rank, _, _, _, shape, onset, run in group.seen
        if rank == row.first_rank and run == row.run and wall is not None and onset is not None
        and _within(wall, row.start_wall, end)
    ]  # fmt: skip
    told += [_hang_told(h) for h in _hangs(job, row.run, row.start_wall, end) if h.rank == row.first_rank]
    if told:
        announced = [t for t in told if t[3] == row.cause]
        _, onset, shape, signature = max(announced or told, key=lambda t: (t[0], t[1]))
        return onset, shape, signature
    ends = [
        e["wall"]
        for e in job.node_events
        if e["run"] == row.run and e.get("kind") == "child_exit" and "wall" in e
        and e.get("global_rank") == row.first_rank and _within(e["wall"], row.start_wall, end)
    ]  # fmt: skip
    return max(ends, default=end), None, None


#: (told, onset, shape, signature) of a fault or a hang.
Told = tuple[float, float, str | None, str]


def _hang_told(h: Hang) -> Told:
    """A hang event as a told fault: its report, onset (the rank's last progress), no shape of
    its own (``consequence.loss_shape`` reads it by its signature) and signature."""
    assert h.wall is not None and h.onset is not None  # ``_hangs`` keeps only hangs with a time
    return h.wall, h.onset, None, hang_signature(h.timeout)


def _host_of_node(job: JobSummary, row: RoundRow, losses: LossIndex) -> str | None:
    """The host of the announced failure: that of the supervisor that decided the job-wide
    restart for the failed rank in the stretch, else the one that held the announced node
    rank when the restart began (the slot of that number, or a spare that took it over:
    events name the slot, not the node rank), not one lost by then."""
    until = restart_ended(row)
    decided = [
        e["host"]
        for e in job.node_events
        if e["run"] == row.run and e.get("kind") == "restart_decision" and e.get("scope") == "job"
        and e.get("global_rank") == row.first_rank and e.get("host") and "wall" in e
        and _within(e["wall"], row.start_wall, until)
    ]
    if decided:
        return decided[-1]
    return _holder(job, row, losses, row.end_wall)


def _holder(job: JobSummary, row: RoundRow, losses: LossIndex, at: float | None) -> str | None:
    """The host whose slot held ``row``'s announced node rank at ``at``, not lost by then."""
    hosts = {
        e.get("node"): e.get("host")
        for e in job.node_events
        if e["run"] == row.run and isinstance(e.get("node"), int) and e.get("host")
    }
    held = [
        host
        for slot, host in hosts.items()
        if losses.node_rank(row.run, slot, at) == row.first_node
        and losses.of_slot(row.run, slot, at) is None
    ]
    return held[0] if held else None


def _within(wall: float, start: float | None, end: float | None) -> bool:
    return (start is None or wall >= start) and (end is None or wall <= end)


def _walls(job: JobSummary, run: int, kind: str) -> list[float]:
    """Wall times of the run's node events of ``kind``."""
    return [e["wall"] for e in job.node_events if e["run"] == run and e.get("kind") == kind and "wall" in e]


def run_end(job: JobSummary, run: int) -> str:
    """How the run's last stretch ended: its supervisors' exit codes."""
    codes = [
        e.get("exit_code")
        for e in job.node_events
        if e["run"] == run and e.get("kind") == "supervisor_end"
    ]
    if not codes:
        return "unfinished"
    if all(c == 0 for c in codes):
        return "completed"
    return "stopped"


def job_wide_restarts(job: JobSummary) -> tuple[int, int]:
    """Job-wide restarts that started children again, and the processes they relaunched
    (children started between the restart's first stopping node and its last started one)."""
    spans: dict[tuple[int, int], tuple[float, float]] = {}
    all_started = _phase_walls(job, "started")
    for (run, epoch), walls in _phase_walls(job, "stopping").items():
        started = all_started.get((run, epoch))
        if started:
            spans[(run, epoch)] = (min(walls), max(started))
    relaunched = sum(
        1
        for e in job.node_events
        if e.get("kind") == "child_start"
        and (e.get("attempt") or 0) > 0
        and any(
            run == e["run"] and lo <= e.get("wall", -1.0) <= hi
            for (run, _), (lo, hi) in spans.items()
        )
    )
    return len(spans), relaunched


def _phase_walls(job: JobSummary, phase: str) -> dict[tuple[int, int], list[float]]:
    walls: dict[tuple[int, int], list[float]] = defaultdict(list)
    for e in job.node_events:
        if (
            e.get("kind") == "job_restart"
            and e.get("phase") == phase
            and isinstance(e.get("epoch"), int)
            and "wall" in e
        ):
            walls[(e["run"], e["epoch"])].append(e["wall"])
    return walls
