"""The job's summary: per-file summaries merged into one, as they arrive.

Memory grows with the number of rounds and failures, not with the number of
events. A file's summary becomes a one-file ``JobSummary`` (its rounds filed
under the job run they belong to) and is merged like any other partial
summary, such as one built by a worker process over other files: there is one
merge, declared field by field (``merging``). The summary is data the
analyses read (``timeline``, ``failure_groups``, ``process_rows``,
``suspects``, ``job_facts``): it imports none of them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from nvrx.events.reader import Skipped

from .file_summary import FileSummary, run_key, slurm_run_of
from .merging import (
    COUNTS,
    EXTEND,
    EXTEND_EACH,
    MAX,
    MAX_EACH,
    MIN,
    PARTS,
    SUM,
    UNION,
    UNION_EACH,
    merge_fields,
    merged,
)
from .model import Hang
from .output_triage import Death
from .parts import LocalFault, RoundState, SignatureGroup, order_key

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
    # SLURM job id -> wall of the latest supervisor start in it: the jobs sacct knows the runs by.
    slurm_jobs: dict[str, float] = merged(MAX_EACH)
    # <array id>_<index> of each job array element they ran in: its default output file's name.
    array_tasks: set[str] = merged(UNION)
    ranks: set[int] = merged(UNION)
    hosts: set[str] = merged(UNION)
    node_hosts: dict[int, set[str]] = merged(UNION_EACH)
    world_size: int = merged(MAX, 0)
    calls: int = merged(SUM)
    call_us: int = merged(SUM)  # integer microseconds: the sum does not depend on merge order
    # (host, pid) -> (last wall, PEER | "own") of processes whose last fault ended them.
    ending_faults: dict[tuple[str | None, int], list[tuple[float, str]]] = merged(EXTEND_EACH)
    interrupted_calls: int = merged(SUM)
    # (host, pid, rank, wall of its call_start, seconds counted) of each call that never ended.
    open_calls: list[tuple[str | None, int | None, int | None, float, float]] = merged(EXTEND)
    state_saves: list[float] = merged(EXTEND)  # walls of checkpoint saves and restored kept commits
    # Processes whose events stop inside the training function with no fault (died unexplained).
    vanished: list[Death] = merged(EXTEND)
    fault_ended_ranks: set[int] = merged(UNION)  # ranks of processes whose last event is a fault
    rounds: dict[tuple[int, int], RoundState] = merged(PARTS)  # (run, round) -> state
    signatures: dict[str, SignatureGroup] = merged(PARTS)
    monitor_deaths: list[LocalFault] = merged(EXTEND)  # dead/unresponsive faults, round or not
    hangs: list[Hang] = merged(EXTEND)
    node_events: list[dict[str, Any]] = merged(EXTEND)  # each with the "run" it belongs to
    wrapper_ends: dict[tuple[int, str], int] = merged(COUNTS)  # (run, outcome) -> ranks
    told_signatures: set[str] = merged(UNION)
    told_types: set[str] = merged(UNION)
    # Wall times of supervisor_start per run_key, sorted: where each job run begins.
    starts: dict[str, list[float]] = field(default_factory=dict)
    # Where each job run but the last ended (``build.run_ends_of``): the run of a start of a
    # run_key that did not start in every run is the number of runs that ended before it.
    ends: list[float] = field(default_factory=list)
    # SLURM's run (the events' slurm_run) -> the job run it is (``build.slurm_runs_of``): an
    # event that recorded one is filed by it, whenever it was written.
    slurm_runs: dict[int, int] = field(default_factory=dict)
    _global_starts: list[float] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def starting(
        cls,
        run_starts: dict[str, list[float]] | None = None,
        run_ends: list[float] | None = None,
        slurm_runs: dict[int, int] | None = None,
    ) -> JobSummary:
        """An empty summary that files events under the job runs of ``run_starts``, which
        ended at ``run_ends``, and an event that recorded its SLURM run under the job run
        ``slurm_runs`` maps that to."""
        starts = {key: sorted(walls) for key, walls in (run_starts or {}).items()}
        return cls(starts=starts, ends=list(run_ends or []), slurm_runs=dict(slurm_runs or {}))

    # -- runs (a requeued job runs again under the same job id) -------------
    def note_run_start(self, key: str, wall: float) -> None:
        starts = self.starts.setdefault(key, [])
        if wall not in starts:
            bisect.insort(starts, wall)
            self._global_starts = None

    def run_of(self, key: str | None, wall: float | None, slurm_run: int | None = None) -> int:
        """Index of the job run an event belongs to: the one its recorded SLURM run
        (``slurm_run``) is, else inferred from the supervisor starts of its ``run_key``.

        Inferred, its key's latest start at or before ``wall`` is that key's start of the run.
        A key that did not start in every run (a slot the job had only in later runs) has its
        start counted among the runs by the runs that had ended before it (``ends``).
        """
        recorded = self.slurm_runs.get(slurm_run) if slurm_run is not None else None
        if recorded is not None:
            return recorded
        if wall is None or not self.starts:
            return 0
        if self._global_starts is None:
            self._global_starts = max(self.starts.values(), key=len, default=[])
        every = self._global_starts
        starts = (self.starts.get(key) if key is not None else None) or every
        i = bisect.bisect_right(starts, wall) - 1
        if i < 0 or len(starts) == len(every) or len(self.ends) != len(every) - 1:
            return max(0, i)
        return bisect.bisect_left(self.ends, starts[i])

    @property
    def run_starts(self) -> dict[str, list[float]]:
        """Wall times of ``supervisor_start`` per ``run_key``: the start of each job run."""
        return {key: list(walls) for key, walls in self.starts.items()}

    @property
    def run_slurm_runs(self) -> dict[int, int]:
        """SLURM's run -> job run, as ``starting`` takes them."""
        return dict(self.slurm_runs)

    @property
    def run_ends(self) -> list[float]:
        """Where each job run but the last ended, as ``starting`` takes them."""
        return list(self.ends)

    @property
    def runs(self) -> int:
        return max((len(s) for s in self.starts.values()), default=1) or 1

    def slurm_job_ids(self) -> list[str]:
        """The SLURM jobs the supervisors ran in, in the order their runs started: sacct's ids,
        not the events' job when ``NVRX_JOB_ID`` named it. One, unless the job was submitted
        again under one ``NVRX_JOB_ID`` (a requeue keeps its id); none in an older writer's
        events."""
        return sorted(self.slurm_jobs, key=lambda j: (self.slurm_jobs[j], j))

    def array_elements(self) -> list[str]:
        """The job array elements the supervisors ran in (``<array id>_<index>``), sorted:
        SLURM and submitit name the job's output files after them, as after the SLURM jobs
        (``slurm_job_ids``)."""
        return sorted(self.array_tasks)

    def slot_hosts(self) -> dict[tuple[int, object], set[str]]:
        """(run, slot) -> the hosts its supervisor's events name: where each srun task of a
        run ran, as its SLURM node name (``SLURMD_NODENAME``) when under SLURM."""
        hosts: dict[tuple[int, object], set[str]] = {}
        for e in self.node_events:
            if e.get("component") == "supervisor" and e.get("host") is not None:
                hosts.setdefault((e["run"], e.get("node")), set()).add(e["host"])
        return hosts

    def supervised_world(self) -> int:
        """Ranks of the job as its supervisors started them (training nodes, spares left out, x
        ranks per node, else the distinct global ranks of their children): the world without
        Wrapper events."""
        sizes = [
            (e["nnodes"] - (e.get("spare_nodes") or 0)) * e["nproc_per_node"]
            for e in self.node_events
            if e.get("kind") == "supervisor_start" and e.get("nnodes") and e.get("nproc_per_node")
        ]
        started = {
            e.get("global_rank")
            for e in self.node_events
            if e.get("kind") == "child_start" and e.get("global_rank") is not None
        }
        return max([*sizes, len(started)], default=0)

    def wrapper_ends_of(self, run: int) -> dict[str, int]:
        """How many ranks' Wrapper ended with each outcome (``wrapper_end``) in job run
        ``run``: an earlier run's ends say nothing of how a requeued job ended."""
        return {outcome: n for (r, outcome), n in self.wrapper_ends.items() if r == run}

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
        self.open_calls.sort(key=lambda c: (c[3], c[0] or "", c[1] if c[1] is not None else -1))
        self.state_saves.sort()

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
            slurm_jobs=fs.slurm_jobs,  # from every start of the job, kept by the filters or not
            array_tasks=fs.array_tasks,
        )
        if fs.kept == 0:
            return part
        part.first_wall, part.last_wall = fs.first_wall, fs.last_wall
        part.jobs, part.ranks, part.world_size = fs.jobs, fs.ranks, fs.world_size
        part.hosts = {fs.host} if fs.host is not None else set()
        part.node_hosts = {node: {host} for node, host in fs.node_hosts.items()}
        part.calls, part.call_us = fs.calls, fs.call_us
        part.interrupted_calls = fs.interrupted_calls
        part.told_signatures, part.told_types = fs.told_signatures, fs.told_types
        part.state_saves = fs.state_saves
        if fs.ending_fault is not None and fs.pid is not None and fs.last_wall is not None:
            part.ending_faults = {(fs.host, fs.pid): [(fs.last_wall, fs.ending_fault)]}
        for pid, wall in fs.hung_children:
            part.ending_faults.setdefault((fs.host, pid), []).append((wall, "own"))
        rank = next(iter(fs.ranks)) if len(fs.ranks) == 1 else None
        if fs.open_call is not None:
            part.open_calls = [(fs.host, fs.pid, rank, *fs.open_call)]
        file_node = next(iter(fs.node_hosts)) if len(fs.node_hosts) == 1 else None
        if fs.vanished:
            part.vanished = [Death(rank, file_node, fs.host, "vanished")]
        if fs.ending_fault is not None and rank is not None:
            part.fault_ended_ranks = {rank}
        run = self.run_of(run_key(fs.host, file_node), fs.first_wall, fs.slurm_run)
        part.rounds = {(run, rnd): state for rnd, state in fs.rounds.items()}
        part.wrapper_ends = {(run, outcome): n for outcome, n in fs.wrapper_ends.items()}
        for group in fs.signatures.values():  # the run of its marks on the HTML timeline
            group.seen = [(*o[:7], run) for o in group.seen]
        part.signatures = fs.signatures
        part.monitor_deaths = fs.monitor_deaths
        part.hangs = [Hang(run=run, **h) for h in fs.hangs]
        for e in fs.node_events:
            key, slurm_run = run_key(e.get("host"), e.get("node")), slurm_run_of(e)
            e.pop("slurm_run", None)
            e["run"] = self.run_of(key, e.get("wall"), slurm_run)
        part.node_events = fs.node_events
        return part
