"""The job's summary: per-file summaries merged into one, as they arrive.

Memory grows with the number of rounds and failures, not with the number of
events. A file's summary becomes a one-file ``JobSummary`` (its rounds filed
under the job run they belong to) and is merged like any other partial
summary, such as one built by a worker process over other files: there is one
merge, declared field by field (``merging``). What the report derives from the
merged summary lives in ``timeline``, ``failure_groups``, ``process_rows`` and
``suspects``; the few job-wide counts are here.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
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
from nvrx.events.reader import Skipped

from .file_summary import FileSummary, run_key
from .job_rounds import job_wide_restarts
from .merging import (
    COUNTS,
    EXTEND,
    EXTEND_EACH,
    MAX,
    MIN,
    PARTS,
    SUM,
    UNION,
    UNION_EACH,
    merge_fields,
    merged,
)
from .model import Hang, ProcessRestart, Restarts, RoundRow
from .node_events import STOP_KINDS
from .output_triage import Death, EventFacts
from .parts import LocalFault, RoundState, SignatureGroup, order_key
from .process_rows import NODE_LOST
from .summarize import Filters, fold_file, summarize_file

if TYPE_CHECKING:
    from .node_loss import LossIndex

MAX_SKIPPED_LISTED = 50


def _skipped_key(s: Skipped) -> tuple[str, int, str]:
    return s.path, s.line, s.reason


def _hang_key(h: Hang) -> tuple[Any, ...]:
    def n(value: Any) -> Any:
        return (value is None, value if value is not None else 0)

    return h.run, n(h.round), n(h.wall), n(h.host), n(h.rank), n(h.timeout), n(h.stack)


def _death_key(d: Death) -> tuple[Any, ...]:
    rank, node = (v if v is not None else -1 for v in (d.rank, d.node))
    return d.host or "", rank, node, d.how


@dataclass
class JobSummary:
    """Job-wide state folded from file summaries; ``add`` files or ``merge`` partial summaries."""

    files: int = merged(SUM)
    events: int = merged(SUM)
    events_used: int = merged(SUM)
    unknown_kinds: dict[str, int] = merged(COUNTS)
    skipped: list[Skipped] = field(default_factory=list)  # the first MAX_SKIPPED_LISTED
    skipped_count: int = merged(SUM)
    first_wall: float | None = merged(MIN)
    last_wall: float | None = merged(MAX)
    jobs: set[str] = merged(UNION)
    ranks: set[int] = merged(UNION)
    hosts: set[str] = merged(UNION)
    node_hosts: dict[int, set[str]] = merged(UNION_EACH)
    world_size: int = merged(MAX, 0)
    calls: int = merged(SUM)
    call_us: int = merged(SUM)  # integer microseconds: the sum does not depend on merge order
    # (host, pid) -> (last wall, PEER | "own") of processes whose last fault ended them.
    ending_faults: dict[tuple[str | None, int], list[tuple[float, str]]] = merged(EXTEND_EACH)
    interrupted_calls: int = merged(SUM)
    # Processes whose events stop inside the training function with no fault (died unexplained).
    vanished: list[Death] = merged(EXTEND)
    fault_ended_ranks: set[int] = merged(UNION)  # ranks of processes whose last event is a fault
    rounds: dict[tuple[int, int], RoundState] = merged(PARTS)  # (run, round) -> state
    signatures: dict[str, SignatureGroup] = merged(PARTS)
    monitor_deaths: list[LocalFault] = merged(EXTEND)  # dead/unresponsive faults, round or not
    hangs: list[Hang] = merged(EXTEND)
    node_events: list[dict[str, Any]] = merged(EXTEND)  # each with the "run" it belongs to
    wrapper_ends: dict[str, int] = merged(COUNTS)
    told_signatures: set[str] = merged(UNION)
    told_types: set[str] = merged(UNION)
    # Wall times of supervisor_start per run_key, sorted: where each job run begins.
    starts: dict[str, list[float]] = field(default_factory=dict)
    _global_starts: list[float] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def starting(cls, run_starts: dict[str, list[float]] | None = None) -> JobSummary:
        """An empty summary that files events under the job runs of ``run_starts``."""
        return cls(starts={key: sorted(walls) for key, walls in (run_starts or {}).items()})

    # -- runs (a requeued job runs again under the same job id) -------------
    def note_run_start(self, key: str, wall: float) -> None:
        starts = self.starts.setdefault(key, [])
        if wall not in starts:
            bisect.insort(starts, wall)
            self._global_starts = None

    def run_of(self, key: str | None, wall: float | None) -> int:
        """Index of the job run an event belongs to, by the supervisor starts of its ``run_key``."""
        if wall is None or not self.starts:
            return 0
        starts = self.starts.get(key) if key is not None else None
        if not starts:
            if self._global_starts is None:
                self._global_starts = max(self.starts.values(), key=len, default=[])
            starts = self._global_starts
        return max(0, bisect.bisect_right(starts, wall) - 1)

    @property
    def run_starts(self) -> dict[str, list[float]]:
        """Wall times of ``supervisor_start`` per ``run_key``: the start of each job run."""
        return {key: list(walls) for key, walls in self.starts.items()}

    @property
    def runs(self) -> int:
        return max((len(s) for s in self.starts.values()), default=1) or 1

    # -- folding ------------------------------------------------------------------
    def merge(self, other: JobSummary) -> None:
        """Fold in another partial summary (of other files); ``other`` is used up."""
        merge_fields(self, other)
        if other.skipped:  # the first ones by place, whichever part came first
            both = sorted(self.skipped + other.skipped, key=_skipped_key)
            self.skipped = both[:MAX_SKIPPED_LISTED]
        for key, walls in other.starts.items():
            for wall in walls:
                self.note_run_start(key, wall)

    def add(self, fs: FileSummary) -> None:
        """Fold in one file's summary: merging the one-file summary it makes."""
        for key, wall in fs.run_starts:
            self.note_run_start(key, wall)
        self.merge(self.part_of(fs))

    def settle(self) -> None:
        """Put the lists that merging fills in arrival order into one order, so that the
        report never depends on the order in which files and partial summaries were merged."""
        self.hangs.sort(key=_hang_key)
        self.vanished.sort(key=_death_key)
        self.monitor_deaths.sort(key=order_key)
        for ends in self.ending_faults.values():
            ends.sort()

    def part_of(self, fs: FileSummary) -> JobSummary:
        """``fs`` as a one-file job summary, its events filed under the runs known here."""
        stats = fs.stats
        part = JobSummary(
            files=stats.files,
            events=stats.events,
            events_used=fs.kept,
            unknown_kinds=dict(stats.unknown_kinds),
            skipped=stats.skipped[:MAX_SKIPPED_LISTED],
            skipped_count=len(stats.skipped),
        )
        if fs.kept == 0:
            return part
        part.first_wall, part.last_wall = fs.first_wall, fs.last_wall
        part.jobs, part.ranks, part.world_size = fs.jobs, fs.ranks, fs.world_size
        part.hosts = {fs.host} if fs.host is not None else set()
        part.node_hosts = {node: {host} for node, host in fs.node_hosts.items()}
        part.calls, part.call_us = fs.calls, fs.call_us
        part.interrupted_calls, part.wrapper_ends = fs.interrupted_calls, fs.wrapper_ends
        part.told_signatures, part.told_types = fs.told_signatures, fs.told_types
        if fs.ending_fault is not None and fs.pid is not None and fs.last_wall is not None:
            part.ending_faults = {(fs.host, fs.pid): [(fs.last_wall, fs.ending_fault)]}
        for pid, wall in fs.hung_children:
            part.ending_faults.setdefault((fs.host, pid), []).append((wall, "own"))
        rank = next(iter(fs.ranks)) if len(fs.ranks) == 1 else None
        file_node = next(iter(fs.node_hosts)) if len(fs.node_hosts) == 1 else None
        if fs.vanished:
            part.vanished = [Death(rank, file_node, fs.host, "vanished")]
        if fs.ending_fault is not None and rank is not None:
            part.fault_ended_ranks = {rank}
        run = self.run_of(run_key(fs.host, file_node), fs.first_wall)
        part.rounds = {(run, rnd): state for rnd, state in fs.rounds.items()}
        part.signatures = fs.signatures
        part.monitor_deaths = fs.monitor_deaths
        part.hangs = [Hang(run=run, **h) for h in fs.hangs]
        for e in fs.node_events:
            e["run"] = self.run_of(run_key(e.get("host"), e.get("node")), e.get("wall"))
        part.node_events = fs.node_events
        return part

    # -- job-wide counts ---------------------------------------------------------
    def child_runtime_s(self) -> float:
        """Seconds the supervised training processes ran, summed over processes."""
        return sum(
            e.get("runtime_s") or 0.0 for e in self.node_events if e.get("kind") == "child_exit"
        )

    def relaunches(self) -> int:
        """Processes relaunched by a supervisor, whatever ended them. A spare's first start
        of each local rank after its ``node_takeover`` replaces a lost node: not a relaunch."""
        decisions = [e for e in self.node_events if e.get("kind") == "restart_decision"]
        if decisions:
            alone = sum(
                1 for e in decisions if e.get("decision") == "restart" and e.get("scope") != "job"
            )
            return alone + job_wide_restarts(self)[1]
        takeovers = {
            (e["run"], e.get("node")): e.get("wall") or 0.0
            for e in self.node_events
            if e.get("kind") == "node_takeover"
        }
        replaced: set[tuple[int, Any, Any]] = set()
        relaunched = 0
        for e in sorted(self.node_events, key=lambda e: e.get("wall") or 0.0):
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
        self,
        timeline: list[RoundRow],
        extra_requeues: int = 0,
        process_rows: Sequence[ProcessRestart] = (),
        node_losses: int = 0,
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
            if p.explained_by in (PEER, NODE_LOST) and (p.decision == "restart" or not decisions)
        )
        requeue_events = {
            (e.get("count") if e.get("count") is not None else e.get("wall"))
            for e in self.node_events
            if e.get("kind") == "requeue"
        }
        requeue = max(len(requeue_events), self.runs - 1, extra_requeues)
        job_wide, with_job = job_wide_restarts(self)
        return Restarts(
            in_process=in_process,
            process=max(0, relaunched - with_job - collateral),
            job_wide=job_wide,
            requeue=requeue,
            node_loss=node_losses,
        )

    def event_signatures(self) -> tuple[set[str], set[str]]:
        """Signatures the events know (own and derived form), and exception types known without a traceback."""
        known = set(self.signatures) | self.told_signatures
        bare_types = {short_type(t) for t in self.told_types}
        for sig, g in self.signatures.items():
            parsed = parse_traceback(g.traceback) if g.traceback else None
            if parsed is not None:
                known.add(parsed.signature())
            elif kind_of(sig) == EXCEPTION:
                bare_types.add(short_type(g.exc_type or signature_type(sig) or sig))
        for e in self.node_events:
            if e.get("kind") == "child_exit":
                known.add(process_end_signature(e.get("exit_code"), e.get("signal")))
        return known, bare_types

    def output_facts(
        self, process_rows: Sequence[ProcessRestart], losses: LossIndex | None = None
    ) -> EventFacts:
        """What judging the output files needs from the events (``output_triage``). A lost
        node's end is told by its ``node_lost``: its ranks and srun task (slot) are known."""
        signatures, bare_types = self.event_signatures()
        facts = EventFacts(signatures=signatures, bare_types=bare_types)
        lost_ranks = losses.lost_ranks() if losses is not None else set()
        if losses is not None and losses.losses:
            facts.lost_slots = {slot for _, slot in losses.lost_slots()}
            facts.slurm_causes.add("node_failure")
        for p in process_rows:
            if p.explained_by is None and p.error is not None and p.error.signature:
                facts.signatures.add(p.error.signature)  # its error file told the cause
            elif p.explained_by is None:
                death = Death(p.rank, p.node, p.host, process_end_signature(p.exit_code, p.signal))
                (facts.killed if p.signal is not None else facts.deaths).append(death)
        exit_hosts = {e.get("host") for e in self.node_events if e.get("kind") == "child_exit"}
        if self.wrapper_ends:  # the job went on after them: they did not just stop being read
            facts.deaths += [
                d for d in self.vanished if d.host not in exit_hosts and d.rank not in lost_ranks
            ]
        facts.node_hosts = {n: sorted(h)[0] for n, h in self.node_hosts.items() if h}
        facts.fault_ended_ranks = set(self.fault_ended_ranks)
        for e in self.node_events:
            kind, node, code = e.get("kind"), e.get("node"), e.get("exit_code")
            if kind == "supervisor_start":
                facts.supervised = True
            elif kind == "supervisor_end" and node is not None and code is not None:
                facts.supervisor_exits.setdefault(node, set()).add(code)
            elif kind in ("requeue", "preempt_signal") and isinstance(e.get("cause"), str):
                facts.slurm_causes.add(e["cause"])
        return facts

    def final_outcome(
        self, timeline: list[RoundRow], lost_slots: Collection[tuple[int, int]] = ()
    ) -> tuple[str, str | None]:
        """How the job ended according to the events (last run, lowest node first). A lost
        slot's end (a fenced node's exit 9) says how the job ended only when no other does."""
        last_run = max((e["run"] for e in self.node_events), default=0)
        ends = [e for e in self.node_events if e["run"] == last_run and e.get("kind") in STOP_KINDS]
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
) -> JobSummary:
    """Summarize and merge ``paths`` into one ``JobSummary`` (the unit of work of a worker process).

    When the job ran once (each supervisor started once), every file's rounds are of run 0,
    and the files fold them straight into the job's: no round state of a file is merged.
    A file that starts a run itself, or is damaged, has the files folded one by one instead.
    """
    job = JobSummary.starting(run_starts)
    if job.runs == 1:
        for path in paths:
            fs = fold_file(path, filters, job_rounds=job.rounds)
            if fs is None or fs.run_starts:
                break
            job.add(fs)
        else:
            return job
        job = JobSummary.starting(run_starts)
    for path in paths:
        job.add(summarize_file(path, filters))
    return job


def run_starts_of(summaries: Iterable[FileSummary]) -> dict[str, list[float]]:
    """``supervisor_start`` wall times per ``run_key`` in ``summaries``: where each job run begins."""
    starts: dict[str, list[float]] = {}
    for fs in summaries:
        for key, wall in fs.run_starts:
            starts.setdefault(key, []).append(wall)
    return starts
