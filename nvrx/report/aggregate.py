"""Merging per-file summaries into the job's story: rounds, failures, restarts, nodes.

Summaries arrive one at a time and are folded in at once, so memory grows with
the number of rounds and failures, not with the number of events.

Which fault came first: within one host boot monotonic clocks are exact, so
the earliest fault by ``mono`` (or ``detected_mono``) wins. Across hosts
monotonic clocks are not comparable; the rank that ``peer`` faults name as
``origin_rank`` (recorded in the store, so free of clock skew) decides, and
only without it wall clocks do, which the timeline says (``ordering``).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nvrx.events.reader import Skipped

from ._nodelist import compress_nodelist
from .model import (
    Failure,
    Hang,
    ProcessRestart,
    Restarts,
    RoundRow,
    SuspectNode,
)
from .signatures import category, exit_signature, hang_signature, parse_traceback, short_type
from .summarize import FileSummary, Filters, LocalFault, RoundPart, SignaturePart, summarize_file

MAX_SKIPPED_LISTED = 50
#: A child's exit and a fault event of the same signature and host this close are one failure.
SAME_FAILURE_WINDOW_S = 30.0
#: A process's events and its supervisor's record of its exit share one host clock.
_SAME_HOST_SLACK_S = 1.0
#: Signals and exit codes a child gets when *we* stop it: not failures.
_STOP_EXIT_CODES = (0, 130)
#: Kinds of per-node events that mean "the job is being stopped on this host".
_STOP_KINDS = ("job_stop", "supervisor_end")
#: Round outcomes, most telling first, when ranks disagree.
_OUTCOME_ORDER = ("restart", "abort", "terminated", "completed")


@dataclass
class _Round:
    first_wall: float | None = None
    last_wall: float | None = None
    outcomes: dict[str, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    failed_phases: set[str] = field(default_factory=set)
    restart_latency_s: float | None = None
    first_by_rank: dict[int | None, LocalFault] = field(default_factory=dict)
    origin_votes: dict[int, int] = field(default_factory=dict)
    peer_ranks: set[int] = field(default_factory=set)
    hang_ranks: set[int] = field(default_factory=set)
    terminated: set[int] = field(default_factory=set)


def _earlier(a: LocalFault, b: LocalFault) -> bool:
    """Whether ``a`` happened before ``b``; monotonic within one boot, else wall clock."""
    if a.boot is not None and a.boot == b.boot and a.mono is not None and b.mono is not None:
        return a.mono < b.mono
    if a.wall is not None and b.wall is not None:
        return a.wall < b.wall
    return a.wall is not None


def run_key(host: Any, node: Any) -> str | None:
    """Whose supervisor starts mark the job's runs: the node rank's, else the host's.

    A node rank's supervisor starts once per run wherever SLURM places it, and
    several local supervisors on one host are several node ranks, not several runs.
    """
    if isinstance(node, int) and not isinstance(node, bool):
        return f"node {node}"
    return f"host {host}" if host is not None else None


def _min_opt(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _max_opt(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


class Aggregator:
    """Folds ``FileSummary`` objects into job-wide state; ``add`` them, then read results."""

    def __init__(self, run_starts: dict[str, list[float]] | None = None) -> None:
        self.files = 0
        self.events = 0
        self.events_used = 0
        self.unknown_kinds: dict[str, int] = {}
        self.skipped: list[Skipped] = []
        self.skipped_count = 0
        self.first_wall: float | None = None
        self.last_wall: float | None = None
        self.jobs: set[str] = set()
        self.ranks: set[int] = set()
        self.hosts: set[str] = set()
        self.node_hosts: dict[int, set[str]] = {}
        self.world_size = 0
        self.calls = 0
        self.call_us = 0  # integer microseconds: the sum does not depend on merge order
        # (host, pid) -> (last wall, "peer" | "own") of processes whose last fault ended them.
        self.ending_faults: dict[tuple[str | None, int], list[tuple[float, str]]] = {}
        self.interrupted_calls = 0
        self.rounds: dict[tuple[int, int], _Round] = {}
        self.signatures: dict[str, SignaturePart] = {}
        self.hangs: list[Hang] = []
        self.node_events: list[dict[str, Any]] = []
        self.wrapper_ends: dict[str, int] = {}
        self.told_signatures: set[str] = set()
        self.told_types: set[str] = set()
        self._run_starts: dict[str, list[float]] = {
            h: sorted(w) for h, w in (run_starts or {}).items()
        }
        self._global_starts: list[float] | None = None

    # -- runs (a requeued job runs again under the same job id) -------------
    def _note_run_start(self, key: str | None, wall: float | None) -> None:
        if key is None or not isinstance(wall, (int, float)):
            return
        starts = self._run_starts.setdefault(key, [])
        if wall not in starts:
            bisect.insort(starts, wall)
            self._global_starts = None

    def run_of(self, key: str | None, wall: float | None) -> int:
        """Index of the job run an event belongs to, by the supervisor starts of its ``run_key``."""
        if wall is None:
            return 0
        starts = self._run_starts.get(key) if key is not None else None
        if not starts:
            if self._global_starts is None:
                self._global_starts = max(self._run_starts.values(), key=len, default=[])
            starts = self._global_starts
        return max(0, bisect.bisect_right(starts, wall) - 1)

    @property
    def run_starts(self) -> dict[str, list[float]]:
        """Wall times of ``supervisor_start`` per ``run_key``: the start of each job run."""
        return {h: list(w) for h, w in self._run_starts.items()}

    @property
    def runs(self) -> int:
        return max((len(s) for s in self._run_starts.values()), default=1) or 1

    # -- merging ----------------------------------------------------------------
    def add(self, fs: FileSummary) -> None:
        stats = fs.stats
        self.files += stats.files
        self.events += stats.events
        self.events_used += fs.kept
        for kind, n in stats.unknown_kinds.items():
            self.unknown_kinds[kind] = self.unknown_kinds.get(kind, 0) + n
        self.skipped_count += len(stats.skipped)
        room = MAX_SKIPPED_LISTED - len(self.skipped)
        if room > 0:
            self.skipped.extend(stats.skipped[:room])
        if fs.kept == 0:
            return
        for e in fs.node_events:
            if e.get("kind") == "supervisor_start":
                self._note_run_start(run_key(e.get("host"), e.get("node")), e.get("wall"))
        self.first_wall = _min_opt(self.first_wall, fs.first_wall)
        self.last_wall = _max_opt(self.last_wall, fs.last_wall)
        self.jobs |= fs.jobs
        self.ranks |= fs.ranks
        if fs.host is not None:
            self.hosts.add(fs.host)
        for node, host in fs.node_hosts.items():
            self.node_hosts.setdefault(node, set()).add(host)
        self.world_size = max(self.world_size, fs.world_size)
        self.calls += fs.calls
        self.call_us += fs.call_us
        self.interrupted_calls += fs.interrupted_calls
        if fs.ending_fault is not None and fs.pid is not None and fs.last_wall is not None:
            self.ending_faults.setdefault((fs.host, fs.pid), []).append(
                (fs.last_wall, fs.ending_fault)
            )
        for outcome, n in fs.wrapper_ends.items():
            self.wrapper_ends[outcome] = self.wrapper_ends.get(outcome, 0) + n
        self.told_signatures |= fs.told_signatures
        self.told_types |= fs.told_types

        file_node = next(iter(fs.node_hosts)) if len(fs.node_hosts) == 1 else None
        run = self.run_of(run_key(fs.host, file_node), fs.first_wall)
        for rnd, part in fs.rounds.items():
            self._merge_round((run, rnd), part)
        for sig, part in fs.signatures.items():
            self._merge_signature(sig, part)
        for h in fs.hangs:
            self.hangs.append(
                Hang(
                    run=run,
                    **{
                        k: h[k]
                        for k in ("rank", "node", "host", "round", "wall", "timeout", "stack")
                    },
                )
            )
        for e in fs.node_events:
            e["run"] = self.run_of(run_key(e.get("host"), e.get("node")), e.get("wall"))
            self.node_events.append(e)

    def _merge_round(self, key: tuple[int, int], part: RoundPart) -> None:
        r = self.rounds.get(key)
        if r is None:
            r = self.rounds[key] = _Round()
        r.first_wall = _min_opt(r.first_wall, part.first_wall)
        r.last_wall = _max_opt(r.last_wall, part.last_wall)
        for outcome, n in part.outcomes.items():
            r.outcomes[outcome] = r.outcomes.get(outcome, 0) + n
        for phase, duration in part.phases.items():
            if duration > r.phases.get(phase, -1.0):
                r.phases[phase] = duration
        r.failed_phases |= part.failed_phases
        r.restart_latency_s = _max_opt(r.restart_latency_s, part.restart_latency_s)
        for fault in part.local_faults:
            seen = r.first_by_rank.get(fault.rank)
            if seen is None or _earlier(fault, seen):
                r.first_by_rank[fault.rank] = fault
        for rank, n in part.origin_votes.items():
            r.origin_votes[rank] = r.origin_votes.get(rank, 0) + n
        r.peer_ranks |= part.peer_ranks
        r.hang_ranks |= part.hang_ranks
        r.terminated |= part.ranks_terminated

    def merge(self, other: Aggregator) -> None:
        """Fold in another aggregator's state (built by a worker over other files)."""
        self.files += other.files
        self.events += other.events
        self.events_used += other.events_used
        for kind, n in other.unknown_kinds.items():
            self.unknown_kinds[kind] = self.unknown_kinds.get(kind, 0) + n
        self.skipped_count += other.skipped_count
        room = MAX_SKIPPED_LISTED - len(self.skipped)
        if room > 0:
            self.skipped.extend(other.skipped[:room])
        self.first_wall = _min_opt(self.first_wall, other.first_wall)
        self.last_wall = _max_opt(self.last_wall, other.last_wall)
        self.jobs |= other.jobs
        self.ranks |= other.ranks
        self.hosts |= other.hosts
        for node, hosts in other.node_hosts.items():
            self.node_hosts.setdefault(node, set()).update(hosts)
        self.world_size = max(self.world_size, other.world_size)
        self.calls += other.calls
        self.call_us += other.call_us
        self.interrupted_calls += other.interrupted_calls
        for proc, ends in other.ending_faults.items():
            self.ending_faults.setdefault(proc, []).extend(ends)
        for outcome, n in other.wrapper_ends.items():
            self.wrapper_ends[outcome] = self.wrapper_ends.get(outcome, 0) + n
        self.told_signatures |= other.told_signatures
        self.told_types |= other.told_types
        for key, starts in other._run_starts.items():
            for wall in starts:
                self._note_run_start(key, wall)
        for key, r in other.rounds.items():
            mine = self.rounds.get(key)
            if mine is None:
                self.rounds[key] = r
                continue
            mine.first_wall = _min_opt(mine.first_wall, r.first_wall)
            mine.last_wall = _max_opt(mine.last_wall, r.last_wall)
            for outcome, n in r.outcomes.items():
                mine.outcomes[outcome] = mine.outcomes.get(outcome, 0) + n
            for phase, duration in r.phases.items():
                if duration > mine.phases.get(phase, -1.0):
                    mine.phases[phase] = duration
            mine.failed_phases |= r.failed_phases
            mine.restart_latency_s = _max_opt(mine.restart_latency_s, r.restart_latency_s)
            for rank, fault in r.first_by_rank.items():
                seen = mine.first_by_rank.get(rank)
                if seen is None or _earlier(fault, seen):
                    mine.first_by_rank[rank] = fault
            for rank, n in r.origin_votes.items():
                mine.origin_votes[rank] = mine.origin_votes.get(rank, 0) + n
            mine.peer_ranks |= r.peer_ranks
            mine.hang_ranks |= r.hang_ranks
            mine.terminated |= r.terminated
        for sig, part in other.signatures.items():
            self._merge_signature(sig, part)
        self.hangs.extend(other.hangs)
        self.node_events.extend(other.node_events)

    def _merge_signature(self, sig: str, part: SignaturePart) -> None:
        g = self.signatures.get(sig)
        if g is None:
            self.signatures[sig] = part
            return
        g.count += part.count
        g.ranks |= part.ranks
        g.nodes |= part.nodes
        g.hosts |= part.hosts
        g.rounds |= part.rounds
        if part.first_wall is not None and (g.first_wall is None or part.first_wall < g.first_wall):
            g.first_wall = part.first_wall
            # Keep the details of the earliest occurrence.
            g.exc_type = part.exc_type or g.exc_type
            g.message = part.message or g.message
            g.traceback = part.traceback or g.traceback
        else:
            g.exc_type = g.exc_type or part.exc_type
            g.message = g.message or part.message
            g.traceback = g.traceback or part.traceback

    # -- results ----------------------------------------------------------------
    def timeline(self, process_rows: Sequence[ProcessRestart] = ()) -> list[RoundRow]:
        """One row per (run, round). Rounds with no fault event of their own are explained by
        a process death (from its supervisor) or a hang report inside the round, if any."""
        rows = []
        for (run, rnd), r in sorted(self.rounds.items()):
            row = self._round_row(run, rnd, r)
            if row.first_rank is None and row.first_host is None:
                self._explain(row, r, process_rows)
            rows.append(row)
        self._infer_outcomes(rows)
        return rows

    def _infer_outcomes(self, rows: list[RoundRow]) -> None:
        """Outcomes of rounds no ``round_end`` reported (an app's own round counter under a
        supervisor): a later round of the run means its processes were restarted, and the
        run's last round ended as its supervisors did."""
        last_round: dict[int, int] = {}
        for row in rows:
            last_round[row.run] = max(last_round.get(row.run, row.round), row.round)
        end_codes: dict[int, list[Any]] = {}
        for e in self.node_events:
            if e.get("kind") == "supervisor_end":
                end_codes.setdefault(e["run"], []).append(e.get("exit_code"))
        for row in rows:
            if self.rounds[(row.run, row.round)].outcomes:
                continue
            row.outcome_from = "inferred"
            if row.round < last_round[row.run]:
                row.outcome = "restart"
            elif end_codes.get(row.run) and all(c == 0 for c in end_codes[row.run]):
                row.outcome = "completed"

    def _death_window(self, run: int, rnd: int) -> tuple[float, float] | None:
        """Wall times in which a process death belongs to round ``rnd``: from its first event
        until the next round of the run starts (a process killed mid-round writes no last word)."""
        lo = self.rounds[(run, rnd)].first_wall
        if lo is None:
            return None
        later = [
            r.first_wall
            for (run2, rnd2), r in self.rounds.items()
            if run2 == run and rnd2 > rnd and r.first_wall is not None
        ]
        return lo, min(later, default=float("inf"))

    def _explain(self, row: RoundRow, r: _Round, process_rows: Sequence[ProcessRestart]) -> None:
        window = self._death_window(row.run, row.round)
        if window is None:
            return
        lo, hi = window
        voted = (
            max(r.origin_votes.items(), key=lambda kv: (kv[1], -kv[0]))[0]
            if r.origin_votes
            else None
        )
        deaths = [
            p
            for p in process_rows
            if p.run == row.run
            and p.wall is not None
            and lo <= p.wall < hi
            and p.explained_by != "peer"
        ]
        if voted is not None and any(p.rank == voted for p in deaths):
            deaths = [p for p in deaths if p.rank == voted]
        if deaths:
            first = min(deaths, key=lambda p: p.wall or 0.0)
            row.cause = exit_signature(first.exit_code, first.signal)
            row.fault_kind = "dead"
            row.first_rank, row.first_node, row.first_host = first.rank, first.node, first.host
            row.ordering = "process_exit"
            row.peer_notified = len(r.peer_ranks - {first.rank})
            return
        hangs = [h for h in self.hangs if h.run == row.run and h.round == row.round]
        if voted is not None and any(h.rank == voted for h in hangs):
            hangs = [h for h in hangs if h.rank == voted]
        if hangs:
            first_hang = min(hangs, key=lambda h: h.wall or 0.0)
            row.cause = hang_signature(first_hang.timeout)
            row.fault_kind = "hang"
            row.first_rank, row.first_node, row.first_host = (
                first_hang.rank,
                first_hang.node,
                first_hang.host,
            )
            row.ordering = "hang"
            row.peer_notified = len(r.peer_ranks - {first_hang.rank})
            return
        if voted is not None:
            row.first_rank, row.ordering = voted, "store_origin"
            row.cause = row.cause or f"fault reported by peers (rank {voted})"

    def _root(self, r: _Round) -> tuple[LocalFault | None, str]:
        faults = list(r.first_by_rank.values())
        if not faults:
            return None, "none"
        by_boot: dict[str | None, LocalFault] = {}
        for f in faults:
            seen = by_boot.get(f.boot)
            if seen is None or _earlier(f, seen):
                by_boot[f.boot] = f
        if len(by_boot) == 1:
            only = next(iter(by_boot.values()))
            return only, "monotonic" if only.mono is not None else "wall_clock"
        if r.origin_votes:
            voted = max(r.origin_votes.items(), key=lambda kv: (kv[1], -kv[0]))[0]
            if voted in r.first_by_rank:
                return r.first_by_rank[voted], "store_origin"
        best = None
        for f in by_boot.values():
            if best is None or (f.wall is not None and (best.wall is None or f.wall < best.wall)):
                best = f
        return best, "wall_clock"

    def _round_row(self, run: int, rnd: int, r: _Round) -> RoundRow:
        root, ordering = self._root(r)
        outcome = next((o for o in _OUTCOME_ORDER if o in r.outcomes), None)
        if outcome is None:
            outcome = next(iter(sorted(r.outcomes)), None) or "unfinished"
        local_ranks = {rank for rank in r.first_by_rank if rank is not None}
        root_rank = root.rank if root is not None else None
        cause = root.signature if root is not None else None
        return RoundRow(
            run=run,
            round=rnd,
            start_wall=r.first_wall,
            end_wall=r.last_wall,
            outcome=outcome,
            cause=cause,
            fault_kind=root.fault_kind if root is not None else None,
            first_rank=root_rank,
            first_node=root.node if root is not None else None,
            first_host=root.host if root is not None else None,
            ordering=ordering,
            also_failed=sorted(local_ranks - {root_rank}),
            peer_notified=len(r.peer_ranks - local_ranks),
            hang_ranks=sorted(r.hang_ranks),
            terminated_ranks=sorted(r.terminated),
            detection_s=root.detection_s if root is not None else None,
            phases=dict(sorted(r.phases.items())),
            failed_phases=sorted(r.failed_phases),
            restart_latency_s=r.restart_latency_s,
        )

    def _stop_walls(self) -> dict[tuple[int, str | None], float]:
        """Earliest stop of each (run, host): child exits after it are part of the stop."""
        stops: dict[tuple[int, str | None], float] = {}
        for e in self.node_events:
            wall = e.get("wall")
            if e.get("kind") in _STOP_KINDS and isinstance(wall, (int, float)):
                key = (e["run"], e.get("host"))
                stops[key] = min(stops.get(key, wall), wall)
        return stops

    def _global_rank(self, run: int, node: Any, local_rank: Any) -> int | None:
        """``node * nproc_per_node + local_rank``, the supervisor's rank layout."""
        if not isinstance(node, int) or not isinstance(local_rank, int):
            return None
        for e in self.node_events:
            if (
                e.get("kind") == "supervisor_start"
                and e["run"] == run
                and isinstance(e.get("nproc_per_node"), int)
            ):
                return node * e["nproc_per_node"] + local_rank
        return None

    def _ending_fault(self, host: Any, pid: Any, wall: Any, runtime: Any) -> str | None:
        """What ended process ``pid``, by its own last fault event: "peer" or "fault" (own)."""
        if not isinstance(pid, int) or not isinstance(wall, (int, float)):
            return None
        life = runtime if isinstance(runtime, (int, float)) else SAME_FAILURE_WINDOW_S
        for last, kind in self.ending_faults.get((host, pid), []):
            # A pid can be reused: only the process that lived up to this exit counts.
            if wall - life - _SAME_HOST_SLACK_S <= last <= wall + _SAME_HOST_SLACK_S:
                return "peer" if kind == "peer" else "fault"
        return None

    def process_restarts(self) -> list[ProcessRestart]:
        """Failed child processes, paired with the decision and replacement that followed."""
        stops = self._stop_walls()
        by_slot: dict[tuple[int, str | None, Any], list[dict[str, Any]]] = {}
        for e in self.node_events:
            if e.get("kind") in ("child_exit", "child_start", "restart_decision", "rejoin"):
                by_slot.setdefault((e["run"], e.get("host"), e.get("local_rank")), []).append(e)
        rows: list[ProcessRestart] = []
        for (run, host, local_rank), events in by_slot.items():
            events.sort(key=lambda e: e.get("wall") or 0.0)
            for i, e in enumerate(events):
                if e.get("kind") != "child_exit":
                    continue
                code = e.get("exit_code") if isinstance(e.get("exit_code"), int) else None
                sig = e.get("signal") if isinstance(e.get("signal"), str) else None
                if sig is None and code in _STOP_EXIT_CODES:
                    continue
                wall = e.get("wall")
                stop = stops.get((run, host))
                if stop is not None and isinstance(wall, (int, float)) and wall >= stop:
                    continue
                later = events[i + 1 :]
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
                rows.append(
                    ProcessRestart(
                        run=run,
                        node=e.get("node"),
                        host=host,
                        local_rank=local_rank,
                        rank=self._global_rank(run, e.get("node"), local_rank),
                        wall=wall,
                        exit_code=code,
                        signal=sig,
                        runtime_s=e.get("runtime_s"),
                        decision=decision.get("decision") if decision else None,
                        reason=decision.get("reason") if decision else None,
                        relaunch_s=relaunch,
                        rejoin_wait_s=rejoin.get("wait_s") if rejoin else None,
                        explained_by=self._ending_fault(
                            host, e.get("child_pid"), wall, e.get("runtime_s")
                        ),
                    )
                )
        rows.sort(key=lambda p: p.wall or 0.0)
        return rows

    def child_runtime_s(self) -> float:
        """Seconds the supervised training processes ran, summed over processes."""
        return sum(
            e["runtime_s"]
            for e in self.node_events
            if e.get("kind") == "child_exit"
            and isinstance(e.get("runtime_s"), (int, float))
            and not isinstance(e.get("runtime_s"), bool)
        )

    def relaunches(self) -> int:
        """Processes relaunched by a supervisor, whatever ended them."""
        decisions = [e for e in self.node_events if e.get("kind") == "restart_decision"]
        if decisions:
            return sum(1 for e in decisions if e.get("decision") == "restart")
        return sum(
            1
            for e in self.node_events
            if e.get("kind") == "child_start"
            and isinstance(e.get("attempt"), int)
            and e["attempt"] > 0
        )

    def restarts(
        self,
        timeline: list[RoundRow],
        extra_requeues: int = 0,
        process_rows: Sequence[ProcessRestart] = (),
    ) -> Restarts:
        in_process = sum(
            1 for row in timeline if row.outcome == "restart" and row.outcome_from == "wrapper"
        )
        decisions = any(e.get("kind") == "restart_decision" for e in self.node_events)
        relaunched = self.relaunches()
        # A process that stopped only because a peer failed was relaunched, but did not fail.
        collateral = sum(
            1
            for p in process_rows
            if p.explained_by == "peer" and (p.decision == "restart" or not decisions)
        )
        requeue_events = {
            (e.get("count") if e.get("count") is not None else e.get("wall"))
            for e in self.node_events
            if e.get("kind") == "requeue"
        }
        requeue = max(len(requeue_events), self.runs - 1, extra_requeues)
        return Restarts(
            in_process=in_process,
            process=max(0, relaunched - collateral),
            requeue=requeue,
        )

    def failures(self, process_rows: list[ProcessRestart]) -> list[Failure]:
        """Failure groups: faults of the events, failed processes, hangs that no fault names."""
        groups = dict(self.signatures)
        # A death that a monitor already reported as a fault is one failure, not two.
        reported: dict[tuple[str, str | None], list[float]] = {}
        for r in self.rounds.values():
            for f in r.first_by_rank.values():
                if f.wall is not None:
                    reported.setdefault((f.signature, f.host), []).append(f.wall)
        for p in process_rows:
            if p.explained_by is not None:  # collateral, or told by its own fault event
                continue
            sig = exit_signature(p.exit_code, p.signal)
            walls = reported.get((sig, p.host), [])
            if p.wall is not None and any(abs(w - p.wall) <= SAME_FAILURE_WINDOW_S for w in walls):
                continue
            part = groups.get(sig)
            if part is None:
                part = groups[sig] = SignaturePart()
            part.count += 1
            if p.rank is not None:
                part.ranks.add(p.rank)
            if p.node is not None:
                part.nodes.add(p.node)
            if p.host is not None:
                part.hosts.add(p.host)
            part.first_wall = _min_opt(part.first_wall, p.wall)
            if part.message is None:
                part.message = f"local rank {p.local_rank} ended ({sig})"
        faulted = {
            (run, rnd, rank) for (run, rnd), r in self.rounds.items() for rank in r.first_by_rank
        }
        for h in self.hangs:
            if (h.run, h.round, h.rank) in faulted:
                continue
            sig = hang_signature(h.timeout)
            part = groups.get(sig)
            if part is None:
                part = groups[sig] = SignaturePart()
            part.count += 1
            for target, value in (
                (part.ranks, h.rank),
                (part.nodes, h.node),
                (part.rounds, h.round),
            ):
                if value is not None:
                    target.add(value)
            if h.host is not None:
                part.hosts.add(h.host)
            part.first_wall = _min_opt(part.first_wall, h.wall)
            part.traceback = part.traceback or h.stack
        out = [
            Failure(
                signature=sig,
                category=category(sig),
                count=g.count,
                ranks=sorted(g.ranks),
                nodes=sorted(g.nodes),
                hosts=sorted(g.hosts),
                rounds=sorted(g.rounds),
                first_wall=g.first_wall,
                exc_type=g.exc_type,
                message=g.message,
                traceback=g.traceback,
                source="events",
            )
            for sig, g in groups.items()
        ]
        out.sort(key=lambda f: (-f.count, f.first_wall or 0.0))
        return out

    def suspects(
        self, timeline: list[RoundRow], failures: list[Failure], process_rows: list[ProcessRestart]
    ) -> tuple[list[SuspectNode], str | None]:
        """Node-level faults per host; a host is suspect when one of its signatures is seen nowhere else."""
        hosts_of = {f.signature: set(f.hosts) for f in failures}
        per: dict[str, dict[str, Any]] = {}

        def slot(host: str, node: int | None) -> dict[str, Any]:
            s = per.setdefault(
                host,
                {
                    "node": node,
                    "first": 0,
                    "hangs": 0,
                    "deaths": 0,
                    "sigs": set(),
                    "incidents": set(),
                },
            )
            if s["node"] is None:
                s["node"] = node
            return s

        # A hang or death that explains a round is one incident with that round, not two.
        explained: dict[tuple[int, int | None, str], list[RoundRow]] = {}
        for row in timeline:
            if row.first_host is not None and row.cause is not None:
                s = slot(row.first_host, row.first_node)
                s["first"] += 1
                s["sigs"].add(row.cause)
                s["incidents"].add(("round", row.run, row.round))
                if row.ordering in ("hang", "process_exit"):
                    explained.setdefault((row.run, row.first_rank, row.ordering), []).append(row)
        for h in self.hangs:
            if h.host is None:
                continue
            s = slot(h.host, h.node)
            s["hangs"] += 1
            s["sigs"].add(hang_signature(h.timeout))
            rows = [r for r in explained.get((h.run, h.rank, "hang"), []) if r.round == h.round]
            s["incidents"].add(
                ("round", h.run, h.round) if rows else ("hang", h.run, h.round, h.rank)
            )
        for p in process_rows:
            if p.host is None or p.explained_by is not None:
                continue
            s = slot(p.host, p.node)
            s["deaths"] += 1
            s["sigs"].add(exit_signature(p.exit_code, p.signal))
            rows = [
                r
                for r in explained.get((p.run, p.rank, "process_exit"), [])
                if p.wall is not None
                and (window := self._death_window(r.run, r.round)) is not None
                and window[0] <= p.wall < window[1]
            ]
            key = (
                ("round", rows[0].run, rows[0].round)
                if rows
                else ("death", p.run, p.host, p.local_rank, p.wall)
            )
            s["incidents"].add(key)
        nodes = []
        # On one host (a local job) "seen only here" compares it with nothing.
        several_hosts = len(self.hosts | set(per)) > 1
        for host, s in per.items():
            only_here = several_hosts and any(
                hosts_of.get(sig, {host}) <= {host} for sig in s["sigs"]
            )
            nodes.append(
                SuspectNode(
                    host=host,
                    node=s["node"],
                    faults=len(s["incidents"]),
                    first_failures=s["first"],
                    hangs=s["hangs"],
                    deaths=s["deaths"],
                    signatures=sorted(s["sigs"]),
                    suspect=only_here,
                )
            )
        nodes.sort(key=lambda n: (-n.faults, n.host))
        flagged = [n.host for n in nodes if n.suspect]
        return nodes, (compress_nodelist(flagged) if flagged else None)

    def event_signatures(self) -> tuple[set[str], set[str]]:
        """Signatures the events know (own and derived form), and exception types known without a traceback."""
        known = set(self.signatures) | self.told_signatures
        bare_types = {short_type(t) for t in self.told_types}
        for sig, g in self.signatures.items():
            parsed = parse_traceback(g.traceback) if g.traceback else None
            if parsed is not None:
                known.add(parsed.signature())
            elif category(sig) == "exception":
                bare_types.add(short_type(g.exc_type or sig.split(" ", 1)[0]))
        for e in self.node_events:
            if e.get("kind") == "child_exit":
                code = e.get("exit_code") if isinstance(e.get("exit_code"), int) else None
                sig = e.get("signal") if isinstance(e.get("signal"), str) else None
                known.add(exit_signature(code, sig))
        return known, bare_types

    def final_outcome(self, timeline: list[RoundRow]) -> tuple[str, str | None]:
        """How the job ended according to the events (last run, lowest node first)."""
        last_run = max((e["run"] for e in self.node_events), default=0)
        ends = sorted(
            (e for e in self.node_events if e["run"] == last_run and e.get("kind") in _STOP_KINDS),
            key=lambda e: (
                e.get("node") if isinstance(e.get("node"), int) else 1 << 30,
                e.get("wall") or 0.0,
            ),
        )
        stop = next((e for e in ends if e["kind"] == "job_stop"), None)
        end = next((e for e in ends if e["kind"] == "supervisor_end"), None)
        reason = (stop or {}).get("reason") or (end or {}).get("reason")
        code = (end or {}).get("exit_code", (stop or {}).get("exit_code"))
        if end is not None or stop is not None:
            if code == 0:
                return "completed", reason
            return (f"failed (exit code {code})" if code is not None else "stopped"), reason
        if self.wrapper_ends:
            if set(self.wrapper_ends) == {"completed"}:
                return "completed", f"all {sum(self.wrapper_ends.values())} ranks completed"
            summary = ", ".join(f"{k}: {v}" for k, v in sorted(self.wrapper_ends.items()))
            worst = next((k for k in ("error", "restart_abort") if k in self.wrapper_ends), "mixed")
            return worst, f"wrapper ends: {summary}"
        if timeline:
            return (
                "unfinished",
                f"no end event; last round {timeline[-1].round} {timeline[-1].outcome}",
            )
        return "unknown", "no end event (still running, or killed without a trace)"

    def skipped_dicts(self, skipped: Iterable[Skipped]) -> list[dict[str, Any]]:
        return [{"path": s.path, "line": s.line, "reason": s.reason} for s in skipped]


def aggregate_files(
    paths: Sequence[str | os.PathLike[str]],
    filters: Filters | None = None,
    run_starts: dict[str, list[float]] | None = None,
) -> Aggregator:
    """Summarize and merge ``paths`` into one ``Aggregator`` (the unit of work of a worker process)."""
    agg = Aggregator(run_starts)
    for path in paths:
        agg.add(summarize_file(path, filters))
    return agg


def run_starts_of(summaries: Iterable[FileSummary]) -> dict[str, list[float]]:
    """``supervisor_start`` wall times per ``run_key`` in ``summaries``: where each job run begins."""
    starts: dict[str, list[float]] = {}
    for fs in summaries:
        for e in fs.node_events:
            key, wall = run_key(e.get("host"), e.get("node")), e.get("wall")
            if (
                e.get("kind") == "supervisor_start"
                and key is not None
                and isinstance(wall, (int, float))
            ):
                starts.setdefault(key, []).append(wall)
    return starts
