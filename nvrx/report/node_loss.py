"""Lost nodes: each ``node_lost`` event read into a ``NodeLoss``, and what a loss explains.

A supervisor that falls silent is declared lost by a peer, which writes
``node_lost``; a spare that takes over its node rank writes ``node_takeover``.
The lost node's ranks write nothing more, and what the survivors write while
the job gets over the loss (their exceptions, hangs, process ends) follows
from it: ``LossIndex.explains`` tells which (``consequence``), so that the
timeline, the failure groups and the suspect table blame the lost node.
Supervisor events name their writer's *slot* as ``node``; a spare's slot holds
the node rank it took over from its ``node_takeover`` on (``node_rank``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nvrx.events.failures import hang_signature

from .consequence import loss_explains
from .model import Hang, NodeLoss, StoreFailover
from .node_events import STOP_KINDS
from .round_windows import RoundWindows
from .same_failure import SAME_FAILURE_WINDOW_S

if TYPE_CHECKING:
    from .job_summary import JobSummary
    from .parts import LocalFault

log = logging.getLogger(__name__)

#: A supervisor's exit code when it was declared lost while it stalled
#: (``ExitCode.FENCED`` of ``nvrx.supervisor``, a higher layer).
FENCED_EXIT = 9
#: ... and when it was excluded (``ExitCode.EXCLUDED``: a rank asked to exclude its node,
#: or it was named a straggler). Either ends one supervisor; the job goes on without it.
EXCLUDED_EXIT = 10
ONE_NODE_EXITS = (FENCED_EXIT, EXCLUDED_EXIT)
#: ``node_lost``'s ``cause``: its supervisor fell silent; it beat on, but its supervisor never
#: counted itself ready for a job-wide restart (stuck); it left the job itself (excluded).
SILENT, NEVER_READY, EXCLUDED = "silent", "never_ready", "excluded"
#: How a ``job_stop`` reason begins when a lost node left too few (``ExitCode.NODE_LOST``).
STOP_REASON = "node lost, no spare"
#: Seconds after a loss's declaration within which a stop still counts as the one in effect
#: (a loss that stops the job writes its ``job_stop`` just after its ``node_lost``).
STOPPING_SLACK_S = 1.0


@dataclass
class LossIndex:
    """The job's node losses, and what each one explains."""

    losses: list[NodeLoss] = field(default_factory=list)
    # (start, end, loss): wall times in which the job was getting over the loss.
    windows: list[tuple[float, float, NodeLoss]] = field(default_factory=list)
    # (run, slot) -> (wall, node rank) of a spare's takeover.
    takeovers: dict[tuple[int, int], tuple[float, int]] = field(default_factory=dict)

    def explains(
        self,
        wall: float | None,
        shape: str | None = None,
        among: Callable[[NodeLoss], bool] | None = None,
        signature: str | None = None,
        *,
        run: int | None,
    ) -> NodeLoss | None:
        """The loss that what a survivor wrote at ``wall`` (a fault of ``signature`` and
        ``shape`` begun then, when it is one) follows from, if any:
        ``consequence.loss_explains`` is the rule. Only losses of the job run the report files
        it under (``run``) are tried: a loss of another run (a requeued job's, or a cut-off
        node's late one) explains nothing of this one, whatever the times (None: an
        occurrence filed under no run yet, which every loss is tried for, by time alone).
        ``among``: only the losses it accepts are tried (the first loss whose window holds
        ``wall`` may be one the caller cannot use, and a later one explain it too)."""
        return next(
            (
                loss
                for _, hi, loss in self.windows
                if (run is None or loss.run == run) and (among is None or among(loss))
                and loss_explains(loss, hi, wall, shape, signature)
            ),
            None,
        )  # fmt: skip

    def explains_fault(self, f: LocalFault, run: int) -> NodeLoss | None:
        """The loss that fault ``f`` of job run ``run`` follows from, if any: from its onset,
        by its shape."""
        return self.explains(f.onset, f.shape, signature=f.signature, run=run)

    def explains_hang(self, h: Hang, among: Callable[[NodeLoss], bool] | None = None) -> NodeLoss | None:
        """The loss that hang ``h`` follows from, if any: from the rank's last progress."""
        return self.explains(h.onset, among=among, signature=hang_signature(h.timeout), run=h.run)

    def of_slot(self, run: int, slot: Any, wall: float | None) -> NodeLoss | None:
        """The loss of slot ``slot`` when ``wall`` is at or after it: what its own supervisor
        wrote then (a fenced node ending its children) follows from the loss. Not one
        declared after its run ended (``in_run``): the slot was not lost then."""
        if wall is None:
            return None
        return next(
            (x for x in self.in_run() if (x.run, x.slot) == (run, slot) and wall >= x.start), None
        )

    def node_rank(self, run: int, slot: Any, wall: float | None) -> Any:
        """The node rank slot ``slot`` held at ``wall``: a spare's is the one it took over."""
        taken = self.takeovers.get((run, slot)) if isinstance(slot, int) else None
        if taken is not None and wall is not None and wall >= taken[0]:
            return taken[1]
        return slot

    def lost_slots(self) -> set[tuple[int, int]]:
        """(run, slot) of every node the job lost (``in_run``): a node a cut-off supervisor
        declared lost after its run ended may have stayed healthy, and ended as the events
        of its own supervisor tell."""
        return {(loss.run, loss.slot) for loss in self.in_run() if loss.slot is not None}

    def lost_ranks(self) -> set[int]:
        """Global ranks the nodes the job lost held (``in_run``, as ``lost_slots``)."""
        return {rank for loss in self.in_run() for rank in loss.ranks}

    def in_run(self) -> list[NodeLoss]:
        """The losses the job had: all but those declared after their run ended, by a
        supervisor cut off from the job (``_declared_late``), which tell of their declarer."""
        return [loss for loss in self.losses if not loss.after_run_end]


def _recovery(job: JobSummary, loss: NodeLoss) -> tuple[float, int | None] | None:
    """(first round_start, world size) of the first round after the loss at full size again:
    at the size before the loss (a spare took over), or of any size after a shrink; after a
    stop, the first round of a later run (the job was requeued). A round that began before
    the loss was declared is no recovery at full size: the survivors may restart between
    the node's last beat and its declaration, still counting the lost ranks. A smaller
    round after a shrink is, even before the declaration's event: the declarer takes the
    ranks out of the round before it writes that event. A run without Wrapper rounds
    recovers by its job-wide restart (``_restarted_without_wrapper``)."""
    if loss.action == "stop":
        later = [
            (r.started_wall, r.world_size)
            for (run, _), r in job.rounds.items()
            if run > loss.run and r.started_wall is not None
        ]
        return min(later, key=lambda x: x[0], default=None)
    if loss.action not in ("spare", "shrink"):
        return None
    if not any(run == loss.run for run, _ in job.rounds):
        return _restarted_without_wrapper(job, loss)
    start = loss.start
    declared = max(start, loss.declared_wall or start)
    rounds = sorted(
        (r.started_wall, r.world_size)
        for (run, _), r in job.rounds.items()
        if run == loss.run and r.started_wall is not None
    )
    before = [size for wall, size in rounds if wall <= start and size is not None]
    full = max(before, default=job.world_size or 0)
    for wall, size in rounds:
        if wall <= start:
            continue
        if loss.action == "shrink" and (wall > declared or (size or 0) < full):
            return wall, size  # smaller: its survivors went on (it may begin before the event)
        if loss.action == "spare" and wall > declared and (size or 0) >= full:
            return wall, size
    return None


def _restarted_without_wrapper(job: JobSummary, loss: NodeLoss) -> tuple[float, int | None] | None:
    """Without Wrapper rounds: (when the last node started its children, world size) in the
    first job-wide restart that every training node (a spare, after its takeover, among
    them) started after the loss was declared; after a shrink, any node that started."""
    declared = _declared(loss)
    started: dict[int, dict[Any, float]] = {}
    for e in job.node_events:
        wall, epoch = e.get("wall"), e.get("epoch")
        if (e.get("kind"), e.get("phase"), e["run"]) != ("job_restart", "started", loss.run):
            continue
        if isinstance(epoch, int) and isinstance(wall, (int, float)) and wall > declared:
            started.setdefault(epoch, {})[e.get("node")] = wall
    needed = 1 if loss.action == "shrink" else _training_nodes(job, loss.run) or 1
    for epoch in sorted(started):
        if len(started[epoch]) >= needed:
            return max(started[epoch].values()), (job.supervised_world() if loss.action == "spare" else None)
    return None


def _training_nodes(job: JobSummary, run: int) -> int | None:
    """Nodes that train in ``run`` (spares left out), by its supervisors' ``supervisor_start``."""
    for e in job.node_events:
        if e.get("kind") == "supervisor_start" and e["run"] == run and e.get("nnodes"):
            return int(e["nnodes"]) - int(e.get("spare_nodes") or 0)
    return None


def store_moved(move: StoreFailover) -> str:
    """The failover in words: 'the store moved to slot 1 (host:port) in 0.8 s'."""
    where = f"slot {move.successor}" if move.successor is not None else "a successor"
    if move.new_store:
        where += f" ({move.new_store})"
    took = f" in {move.duration_s:.1f} s" if move.duration_s is not None else ""
    return f"the job's store moved to {where}{took}"


def _outcome(job: JobSummary, loss: NodeLoss, losses: list[NodeLoss]) -> str:
    if loss.action == "spare":
        return f"spare slot {loss.replaced_by} took over node rank {loss.node}"
    if loss.action == "shrink":
        nodes = _training_nodes(job, loss.run)
        earlier = [x for x in losses if x.run == loss.run and x.action == "shrink"]
        if nodes is None:
            return f"job shrank: it went on without node rank {loss.node}"
        left = nodes - len(earlier[: earlier.index(loss) + 1])
        return f"job shrank to {left} node{'' if left == 1 else 's'}"
    if loss.action == "stop":
        own = [r for r in _stop_reasons(job, loss.run) if r.startswith(STOP_REASON)]
        stopping = _stop_reasons(job, loss.run, until=_declared(loss) + STOPPING_SLACK_S)
        return f"job stopped: {(own or stopping or [STOP_REASON])[0]}"  # e.g. its store, lost with it
    if loss.action == "none" and loss.node is not None:
        return f"node rank {loss.node} had ended its training: nothing to replace"
    if loss.action == "none":
        stopping = _stop_reasons(job, loss.run, until=_declared(loss) + STOPPING_SLACK_S)
        return "a spare node was lost" + ("" if stopping else "; training went on")
    return f"action {loss.action}"


def _declared(loss: NodeLoss) -> float:
    return loss.declared_wall if loss.declared_wall is not None else loss.start


def _stop_reasons(job: JobSummary, run: int, until: float = math.inf) -> list[str]:
    """The reasons the job of ``run`` was stopping for, by ``until``, first first: its
    ``job_stop`` events, but for the ends of one node the job goes on without (a fenced
    node's, an excluded one's)."""
    stops = sorted(
        (e for e in job.node_events
         if e.get("kind") == "job_stop" and e["run"] == run and e.get("reason")
         and e.get("exit_code") not in ONE_NODE_EXITS and (e.get("wall") or 0.0) <= until),
        key=lambda e: e.get("wall") or 0.0,
    )  # fmt: skip
    return [str(e["reason"]) for e in stops]


def _loss(e: dict[str, Any]) -> NodeLoss:
    declared = e.get("wall")
    return NodeLoss(
        run=e["run"],
        node=e.get("lost_node"),
        slot=e.get("lost_slot"),
        host=e.get("lost_host"),
        ranks=sorted(e.get("ranks") or []),
        last_seen_wall=e.get("last_seen_wall"),
        declared_wall=declared if isinstance(declared, (int, float)) else None,
        silent_s=e.get("silent_s"),
        cause=str(e.get("cause") or SILENT),  # (events of older versions have none)
        seen_by=e.get("seen_by"),
        slurm_state=e.get("slurm_state"),
        action=e.get("action") or "unknown",
        replaced_by=e.get("replaced_by"),
    )


def _followed(job: JobSummary, loss: NodeLoss, windows: RoundWindows) -> None:
    """What followed the loss: the spare's takeover, the recovery, a fenced supervisor; and
    the round it interrupted: the one running when the node fell silent (its survivors may
    have found the lost peers and begun the next round before the declaration), else the
    one whose window holds the declaration."""
    for e in job.node_events:
        kind, run, slot = e.get("kind"), e["run"], e.get("node")
        if kind == "node_takeover" and run == loss.run and slot == loss.replaced_by:
            if e.get("lost_slot") in (None, loss.slot):
                loss.takeover_s = e.get("wait_s")
        own_end = kind in STOP_KINDS and (run, slot) == (loss.run, loss.slot)
        if own_end and e.get("exit_code") == FENCED_EXIT and (e.get("wall") or 0.0) >= loss.start:
            loss.fenced = True
    loss.store_failover = _store_failover(job, loss)
    recovered = _recovery(job, loss)
    if recovered is not None:
        loss.recovered_wall, loss.world_size = recovered
        loss.recovery_s = max(0.0, loss.recovered_wall - loss.start)
    silent = windows.round_at(loss.run, loss.start)
    if silent is not None and _interrupted_before(job, loss, silent):
        silent = windows.round_at(loss.run, loss.declared_wall)  # the loss came in a later round
    loss.round = silent if silent is not None else windows.round_at(loss.run, loss.declared_wall)


def _interrupted_before(job: JobSummary, loss: NodeLoss, rnd: int) -> bool:
    """Whether round ``rnd`` had a fault of its own before ``loss``'s node fell silent, one
    that does not follow from the loss: the loss then did not interrupt that round (the
    node's last beat came before the next round began, and the node died in that one). A
    fault counts from its onset: a hang from the rank's last progress (its detection time
    less ``detection_s``), for it may be told only after the node's last beat."""
    state = job.rounds.get((loss.run, rnd))
    if state is None:
        return False
    return any(
        f.onset is not None and f.onset < loss.start
        and not loss_explains(loss, math.inf, f.onset, f.shape, f.signature)
        for f in state.first_by_rank.values()
    )


def _store_failover(job: JobSummary, loss: NodeLoss) -> StoreFailover | None:
    """Where the store went when ``loss`` took its host: every survivor writes
    ``store_failover``; the successor's own event is the one that says how long serving took."""
    moves = [
        e for e in job.node_events
        if e.get("kind") == "store_failover" and e["run"] == loss.run
        and loss.slot is not None and e.get("lost_slot") == loss.slot
    ]  # fmt: skip
    if not moves:
        return None
    own = [e for e in moves if e.get("node") == e.get("successor")]
    e = min(own or moves, key=lambda e: e.get("wall") or 0.0)
    return StoreFailover(
        successor=e.get("successor"),
        old_store=e.get("old_store"),
        new_store=e.get("new_store"),
        epoch=e.get("epoch"),
        duration_s=e.get("duration_s"),
    )


def _run_end(job: JobSummary, run: int) -> float:
    """When job run ``run`` ended for the job: where a later run's first per-node event
    was written (a requeued job runs again only after its run ended); none for the last run.
    A node cut off from ``run`` may write after that, its events filed under ``run``, but
    the job was not getting over a loss of ``run`` by then: a loss's window ends there."""
    later = [
        e["wall"] for e in job.node_events
        if e["run"] > run and isinstance(e.get("wall"), (int, float))
    ]  # fmt: skip
    return min(later, default=math.inf)


def _own_end(job: JobSummary, loss: NodeLoss) -> float:
    """Until when the job was getting over ``loss``: its recovery; for a stop, the end of
    the run; for a lost spare, nothing to get over; else SAME_FAILURE_WINDOW_S past it."""
    start = loss.start
    if loss.recovered_wall is not None and loss.action != "stop":
        return loss.recovered_wall
    if loss.action == "none":
        return start
    if loss.action == "stop":
        later = [w for walls in job.starts.values() for w in walls if w > start]
        return min(later, default=math.inf)
    declared = loss.declared_wall if loss.declared_wall is not None else start
    return declared + SAME_FAILURE_WINDOW_S


def _declarer_hosts(job: JobSummary, loss: NodeLoss) -> set[str]:
    """The host names of the supervisor that declared ``loss`` (its slot, in the loss's run)."""
    return {str(host) for host in job.slot_hosts().get((loss.run, loss.seen_by), ())}


def _after_run_end(job: JobSummary, loss: NodeLoss, run_end: float) -> bool:
    """Whether ``loss`` was declared after its run ended. Where the declarer's host wrote in
    a later run, its own clock decides: its first event there. The run's end
    (``_run_end``) is read from other hosts' clocks, and a skew longer than the requeue took
    would make a survivor's declaration just before the requeue seem later than it."""
    hosts = _declarer_hosts(job, loss)
    own = [
        e["wall"] for e in job.node_events
        if e["run"] > loss.run and e.get("host") in hosts and isinstance(e.get("wall"), (int, float))
    ]  # fmt: skip
    return _declared(loss) > min(own, default=run_end)


def _declared_late(job: JobSummary, loss: NodeLoss) -> None:
    """Mark ``loss``, declared after its run ended, as no loss the job had. The job had gone
    on to a later run, so the supervisor that declared it was still running the ended run:
    cut off from the job, it could no longer see its peers, whatever their state. Such a
    loss interrupts no round and explains nothing (it has no window), and tells nothing
    against the node it names."""
    loss.after_run_end = True
    hosts = _declarer_hosts(job, loss)
    by = f"slot {loss.seen_by}" if loss.seen_by is not None else "a supervisor"
    if hosts:
        by += f" ({', '.join(sorted(hosts))})"
    loss.outcome = (
        f"declared by {by} after run {loss.run} ended: its declarer was cut off from the job, "
        "which had gone on without it; no evidence against this node"
    )


def node_losses(job: JobSummary) -> LossIndex:
    """The job's node losses (one per lost slot and run, the first declaration), in order."""
    index = LossIndex()
    seen: set[tuple[int, Any]] = set()
    events = sorted(
        (e for e in job.node_events if e.get("kind") in ("node_lost", "node_takeover")),
        key=lambda e: e.get("wall") or 0.0,
    )
    for e in events:
        if e["kind"] == "node_takeover":
            if isinstance(e.get("node"), int) and e.get("node_rank") is not None:
                index.takeovers[(e["run"], e["node"])] = (e.get("wall") or 0.0, e["node_rank"])
            continue
        key = (e["run"], e.get("lost_slot"))
        if key not in seen:
            seen.add(key)
            index.losses.append(_loss(e))
    windows = RoundWindows(job.rounds)
    run_ends = {run: _run_end(job, run) for run in {loss.run for loss in index.losses}}
    for loss in index.losses:
        if _after_run_end(job, loss, run_ends[loss.run]):
            _declared_late(job, loss)
            continue
        _followed(job, loss, windows)
        loss.outcome = _outcome(job, loss, index.losses)
        if loss.fenced:
            loss.outcome += "; its supervisor came back and was fenced off (exit 9)"
        if loss.store_failover is not None:
            loss.outcome += "; " + store_moved(loss.store_failover)
        index.windows.append((loss.start, min(_own_end(job, loss), run_ends[loss.run]), loss))
    index.windows.sort(key=lambda w: (w[0], w[1]))
    if index.losses:
        log.debug("%d node loss(es) in the events", len(index.losses))
    return index
