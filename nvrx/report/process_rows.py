"""Process restarts: each failed training process, what its supervisor decided, and what followed.

A supervisor records its children's ends (``child_exit``); whether an end was
a failure, part of the job's stop, or collateral of a peer's fault is decided
here, once every event is known.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from nvrx.events.failures import PEER

from .model import ProcessRestart, RecordedError
from .node_events import STOP_KINDS
from .round_windows import RoundWindows
from .same_failure import SAME_FAILURE_WINDOW_S

if TYPE_CHECKING:
    from .job_summary import JobSummary
    from .node_loss import LossIndex

#: A process's events and its supervisor's record of its exit share one host clock.
_SAME_HOST_SLACK_S = 1.0
#: ``explained_by`` of a process that ended while the job was getting over a lost node.
NODE_LOST = "node_lost"
#: ``explained_by`` of a process its supervisor stopped for a job-wide restart (any-failed).
JOB_RESTART = "job_restart"
#: Exit codes a child ends with when *we* stop it: not failures.
_STOP_EXIT_CODES = (0, 130)
_SLOT_KINDS = ("child_exit", "child_start", "restart_decision")


def _stop_walls(job: JobSummary) -> dict[tuple[int, Any, str | None], float]:
    """Earliest stop of each (run, slot, host): its child exits after it are part of the stop.

    By slot, not by host alone: a node that stops (one fenced off after its loss) says
    nothing of the other nodes that share its host.
    """
    stops: dict[tuple[int, Any, str | None], float] = {}
    for e in job.node_events:
        wall = e.get("wall")
        if e.get("kind") in STOP_KINDS and wall is not None:
            key = (e["run"], e.get("node"), e.get("host"))
            stops[key] = min(stops.get(key, wall), wall)
    return stops


def nprocs(job: JobSummary) -> dict[int, int]:
    """Run -> children per node, as its ``supervisor_start`` events say."""
    out: dict[int, int] = {}
    for e in job.node_events:
        nproc = e.get("nproc_per_node")
        if e.get("kind") == "supervisor_start" and isinstance(nproc, int) and nproc > 0:
            out.setdefault(e["run"], nproc)
    return out


def _ending_fault(job: JobSummary, host: Any, pid: Any, wall: Any, runtime: Any) -> str | None:
    """What ended process ``pid``, by its own last fault event: PEER or "fault" (own)."""
    if pid is None or wall is None:
        return None
    life = runtime if runtime is not None else SAME_FAILURE_WINDOW_S
    for last, kind in job.ending_faults.get((host, pid), []):
        # A pid can be reused: only the process that lived up to this exit counts.
        if wall - life - _SAME_HOST_SLACK_S <= last <= wall + _SAME_HOST_SLACK_S:
            return PEER if kind == PEER else "fault"
    return None


def _failed(e: dict[str, Any], stop: float | None) -> bool:
    """Whether a ``child_exit`` is a failure, not a clean end or part of the job's stop.

    (A node event's own fields are of the type the report expects, or None: ``node_events``.)
    """
    if e.get("signal") is None and e.get("exit_code") in _STOP_EXIT_CODES:
        return False
    wall = e.get("wall")
    return stop is None or wall is None or wall < stop


def _restart_windows(job: JobSummary) -> dict[tuple[int, Any], list[tuple[float, float]]]:
    """Per (run, node): from stopping its children for a job-wide restart to counting itself
    ready (their exits in between are the restart's, not failures)."""
    begun: dict[tuple[int, Any, Any], float] = {}
    ended: dict[tuple[int, Any, Any], float] = {}
    for e in job.node_events:
        if e.get("kind") == "job_restart" and e.get("wall") is not None:
            key = (e["run"], e.get("node"), e.get("epoch"))
            if e.get("phase") == "stopping":
                begun[key] = e["wall"]
            elif e.get("phase") in ("ready", "started"):
                ended[key] = min(ended.get(key, e["wall"]), e["wall"])
    windows: dict[tuple[int, Any], list[tuple[float, float]]] = {}
    for (run, node, epoch), lo in begun.items():
        windows.setdefault((run, node), []).append((lo, ended.get((run, node, epoch), float("inf"))))
    return windows


def _peers_wait(
    job: JobSummary, windows: RoundWindows, run: int, wall: float | None
) -> float | None:
    """How long the Wrapper's ranks waited for replacements to rejoin (``rejoin_wait``) in the
    restart of the round that ran when a process ended at ``wall`` (the round whose window
    holds it: ``round_windows``, as the timeline places deaths); None without one."""
    rnd = windows.round_at(run, wall)
    return None if rnd is None else job.rounds[(run, rnd)].phases.get("rejoin_wait")


def _explained(
    job: JobSummary,
    e: dict[str, Any],
    losses: LossIndex,
    restarts: dict[tuple[int, Any], list[tuple[float, float]]],
) -> str | None:
    """PEER or "fault" by the process's own last fault; else JOB_RESTART when its supervisor
    stopped it for a job-wide restart; else NODE_LOST when it ended while the job got over a
    lost node (or its own node was the lost one)."""
    run, wall = e["run"], e.get("wall")
    own = _ending_fault(job, e.get("host"), e.get("child_pid"), wall, e.get("runtime_s"))
    if own is None and wall is not None and restarts:
        if any(lo <= wall <= hi for lo, hi in restarts.get((run, e.get("node")), [])):
            return JOB_RESTART
    if own == PEER:
        return own
    if losses.explains(wall, run=run) is not None or losses.of_slot(run, e.get("node"), wall) is not None:
        return NODE_LOST
    return own


def _row(
    job: JobSummary,
    e: dict[str, Any],
    later: list[dict[str, Any]],
    losses: LossIndex,
    start: dict[str, Any] | None,
    restarts: dict[tuple[int, Any], list[tuple[float, float]]],
    windows: RoundWindows,
) -> ProcessRestart:
    """The row of one failed ``child_exit``, with the decision and replacement after it
    (``later``: its slot's events up to the slot's next ``child_exit``; ``start``: its own
    ``child_start``). Its node is the node rank its slot held then (a spare's, the one it
    took over). Its error file and log files are only named here (``rank_files`` reads them)."""
    run, host, local_rank, wall = e["run"], e.get("host"), e.get("local_rank"), e.get("wall")
    node = losses.node_rank(run, e.get("node"), wall)
    rank = e.get("global_rank")
    decision = next((x for x in later if x.get("kind") == "restart_decision"), None)
    restart = next((x for x in later if x.get("kind") == "child_start"), None)
    relaunch = None
    if restart is not None and wall is not None and restart.get("wall") is not None:
        relaunch = max(0.0, restart["wall"] - wall)
    return ProcessRestart(
        run=run,
        node=node,
        host=host,
        local_rank=local_rank,
        rank=rank,
        wall=wall,
        exit_code=e.get("exit_code"),
        signal=e.get("signal"),
        runtime_s=e.get("runtime_s"),
        decision=decision.get("decision") if decision else None,
        reason=decision.get("reason") if decision else None,
        relaunch_s=relaunch,
        rejoin_wait_s=_peers_wait(job, windows, run, wall) if restart is not None else None,
        explained_by=_explained(job, e, losses, restarts),
        files=[start["files"]] if start is not None and isinstance(start.get("files"), str) else [],
        error=RecordedError(e["error_file"])
        if isinstance(e.get("error_file"), str)
        else None,
    )


def events_by_slot(
    job: JobSummary, kinds: Collection[str]
) -> dict[tuple[int, Any, str | None, Any], list[dict[str, Any]]]:
    """Node events of ``kinds`` per (run, node, host, local rank), in arrival order. A slot is
    one local rank of one node: several node ranks may share a host."""
    by_slot: dict[tuple[int, Any, str | None, Any], list[dict[str, Any]]] = {}
    for e in job.node_events:
        if e.get("kind") in kinds:
            key = (e["run"], e.get("node"), e.get("host"), e.get("local_rank"))
            by_slot.setdefault(key, []).append(e)
    return by_slot


def process_restarts(job: JobSummary, losses: LossIndex) -> list[ProcessRestart]:
    """Failed child processes, paired with the decision and replacement that followed."""
    stops = _stop_walls(job)
    restarts = _restart_windows(job)
    by_slot = events_by_slot(job, _SLOT_KINDS)
    windows = RoundWindows(job.rounds)
    rows: list[ProcessRestart] = []
    for (run, slot, host, _), events in by_slot.items():
        events.sort(key=lambda e: e.get("wall") or 0.0)
        exits = [i for i, e in enumerate(events) if e.get("kind") == "child_exit"]
        for n, i in enumerate(exits):
            end = exits[n + 1] if n + 1 < len(exits) else len(events)  # the slot's next exit
            if _failed(events[i], stops.get((run, slot, host))):
                pid = events[i].get("child_pid")
                start = next(
                    (x for x in events[:i] if x.get("kind") == "child_start" and x.get("child_pid") == pid),
                    None,
                )  # fmt: skip
                later = events[i + 1 : end]
                rows.append(_row(job, events[i], later, losses, start, restarts, windows))
    per_node = nprocs(job)  # a row without its global rank: the supervisor's rank layout
    for p in rows:
        if p.rank is None and None not in (p.node, p.local_rank) and p.run in per_node:
            p.rank = p.node * per_node[p.run] + p.local_rank
    rows.sort(key=lambda p: p.wall or 0.0)
    return rows
