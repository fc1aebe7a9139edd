"""Process restarts: each failed training process, what its supervisor decided, and what followed.

A supervisor records its children's ends (``child_exit``); whether an end was
a failure, part of the job's stop, or collateral of a peer's fault is decided
here, once every event is known.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .model import ProcessRestart
from .parts import LocalFault

if TYPE_CHECKING:
    from .aggregate import JobSummary

log = logging.getLogger(__name__)

#: A child's exit and a fault event of the same signature and host this close are one failure.
SAME_FAILURE_WINDOW_S = 30.0
#: A process's events and its supervisor's record of its exit share one host clock.
_SAME_HOST_SLACK_S = 1.0
#: Exit codes a child ends with when *we* stop it: not failures.
_STOP_EXIT_CODES = (0, 130)
_STOP_KINDS = ("job_stop", "supervisor_end")
_SLOT_KINDS = ("child_exit", "child_start", "restart_decision", "rejoin")


def same_process_end(fault: LocalFault, p: ProcessRestart) -> bool:
    """Whether a monitor's fault (``dead``, ``unresponsive``) and a supervisor's record of a
    process end are one failure: same host, same rank when both know it, close in time."""
    if fault.host != p.host or fault.wall is None or p.wall is None:
        return False
    if fault.rank is not None and p.rank is not None and fault.rank != p.rank:
        return False
    return abs(fault.wall - p.wall) <= SAME_FAILURE_WINDOW_S


def _stop_walls(job: JobSummary) -> dict[tuple[int, str | None], float]:
    """Earliest stop of each (run, host): child exits after it are part of the stop."""
    stops: dict[tuple[int, str | None], float] = {}
    for e in job.node_events:
        wall = e.get("wall")
        if e.get("kind") in _STOP_KINDS and isinstance(wall, (int, float)):
            key = (e["run"], e.get("host"))
            stops[key] = min(stops.get(key, wall), wall)
    return stops


def _global_rank(job: JobSummary, run: int, node: Any, local_rank: Any) -> int | None:
    """``node * nproc_per_node + local_rank``, the supervisor's rank layout."""
    if not isinstance(node, int) or not isinstance(local_rank, int):
        return None
    for e in job.node_events:
        if (
            e.get("kind") == "supervisor_start"
            and e["run"] == run
            and isinstance(e.get("nproc_per_node"), int)
        ):
            return node * e["nproc_per_node"] + local_rank
    return None


def _ending_fault(job: JobSummary, host: Any, pid: Any, wall: Any, runtime: Any) -> str | None:
    """What ended process ``pid``, by its own last fault event: "peer" or "fault" (own)."""
    if not isinstance(pid, int) or not isinstance(wall, (int, float)):
        return None
    life = runtime if isinstance(runtime, (int, float)) else SAME_FAILURE_WINDOW_S
    for last, kind in job.ending_faults.get((host, pid), []):
        # A pid can be reused: only the process that lived up to this exit counts.
        if wall - life - _SAME_HOST_SLACK_S <= last <= wall + _SAME_HOST_SLACK_S:
            return "peer" if kind == "peer" else "fault"
    return None


def _failed(e: dict[str, Any], stop: float | None) -> bool:
    """Whether a ``child_exit`` is a failure, not a clean end or part of the job's stop."""
    code = e.get("exit_code") if isinstance(e.get("exit_code"), int) else None
    if not isinstance(e.get("signal"), str) and code in _STOP_EXIT_CODES:
        return False
    wall = e.get("wall")
    return stop is None or not isinstance(wall, (int, float)) or wall < stop


def _row(job: JobSummary, e: dict[str, Any], later: list[dict[str, Any]]) -> ProcessRestart:
    """The row of one failed ``child_exit``, with the decision and replacement after it."""
    run, host, local_rank, wall = e["run"], e.get("host"), e.get("local_rank"), e.get("wall")
    decision = next((x for x in later if x.get("kind") == "restart_decision"), None)
    restart = next((x for x in later if x.get("kind") == "child_start"), None)
    rejoin = next((x for x in later if x.get("kind") == "rejoin"), None)
    relaunch = None
    if (
        restart is not None
        and isinstance(wall, (int, float))
        and isinstance(restart.get("wall"), (int, float))
    ):
        relaunch = max(0.0, restart["wall"] - wall)
    return ProcessRestart(
        run=run,
        node=e.get("node"),
        host=host,
        local_rank=local_rank,
        rank=_global_rank(job, run, e.get("node"), local_rank),
        wall=wall,
        exit_code=e.get("exit_code") if isinstance(e.get("exit_code"), int) else None,
        signal=e.get("signal") if isinstance(e.get("signal"), str) else None,
        runtime_s=e.get("runtime_s"),
        decision=decision.get("decision") if decision else None,
        reason=decision.get("reason") if decision else None,
        relaunch_s=relaunch,
        rejoin_wait_s=rejoin.get("wait_s") if rejoin else None,
        explained_by=_ending_fault(job, host, e.get("child_pid"), wall, e.get("runtime_s")),
    )


def process_restarts(job: JobSummary) -> list[ProcessRestart]:
    """Failed child processes, paired with the decision and replacement that followed."""
    stops = _stop_walls(job)
    by_slot: dict[tuple[int, str | None, Any], list[dict[str, Any]]] = {}
    for e in job.node_events:
        if e.get("kind") in _SLOT_KINDS:
            by_slot.setdefault((e["run"], e.get("host"), e.get("local_rank")), []).append(e)
    rows: list[ProcessRestart] = []
    for (run, host, _), events in by_slot.items():
        events.sort(key=lambda e: e.get("wall") or 0.0)
        for i, e in enumerate(events):
            if e.get("kind") == "child_exit" and _failed(e, stops.get((run, host))):
                rows.append(_row(job, e, events[i + 1 :]))
    rows.sort(key=lambda p: p.wall or 0.0)
    return rows
