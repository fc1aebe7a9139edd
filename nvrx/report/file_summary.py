"""What the report keeps of one event file (``FileSummary``), and where the job's runs begin.

One file is one process: ``file_fold`` fills a summary event by event, in a
worker process when there are many files, and ``build.aggregate_files`` merges them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nvrx.events.reader import ReadStats
from nvrx.events.validation import MAX_ID
from nvrx.slurm.job_ids import array_task_name

from .parts import LocalFault, RoundState, SignatureGroup
from .values import as_int, as_str, num

Ev = dict[str, Any]


def run_key(host: Any, node: Any) -> str | None:
    """Whose supervisor starts mark the job's runs: the node rank's, else the host's.

    A node rank's supervisor starts once per run wherever SLURM places it, and
    several local supervisors on one host are several node ranks, not several runs.
    """
    node = as_int(node)
    if node is not None:
        return f"node {node}"
    host = as_str(host)
    return f"host {host}" if host is not None else None


def slurm_run_of(event: Any) -> int | None:
    """The run of its SLURM job the writer of ``event`` recorded (``slurm_run``: 0 for the first
    run), or None: an older writer's event, one written outside SLURM, or not a count."""
    run = as_int(event.get("slurm_run"))
    return run if run is not None and 0 <= run <= MAX_ID else None


def run_start(event: Ev) -> tuple[str, float] | None:
    """(``run_key``, wall) where ``event`` begins a job run: each ``supervisor_start`` does."""
    if event.get("kind") != "supervisor_start":
        return None
    key, wall = run_key(event.get("host"), event.get("node")), num(event.get("wall"))
    return (key, wall) if key is not None and wall is not None else None


@dataclass
class FileSummary:
    """Everything the report needs from one event file."""

    path: str
    stats: ReadStats
    # Where job runs begin, from every supervisor_start read (even one the filters drop).
    run_starts: list[tuple[str, float]] = field(default_factory=list)
    # (run_key, wall) of each of those starts that recorded its SLURM run -> that run (slurm_run).
    start_runs: dict[tuple[str, float], int] = field(default_factory=dict)
    # The SLURM run its process ran in (slurm_run of its first event that records one).
    slurm_run: int | None = None
    # Wall of the file's last event of the job, whatever the filters keep: how far the
    # supervisor of its last start ran (``run_ends``).
    final_wall: float | None = None
    kept: int = 0
    host: str | None = None
    boot: str | None = None
    component: str | None = None
    first_wall: float | None = None
    last_wall: float | None = None
    jobs: set[str] = field(default_factory=set)
    # SLURM job id -> wall of the latest supervisor_start that ran in it, from every start read
    # (as run_starts).
    slurm_jobs: dict[str, float] = field(default_factory=dict)
    # ``<array id>_<index>`` of each job array element the supervisors ran in (as slurm_jobs):
    # the name SLURM gives its default output file.
    array_tasks: set[str] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    node_hosts: dict[int, str] = field(default_factory=dict)
    world_size: int = 0
    pid: int | None = None
    calls: int = 0  # call_start/call_end events seen
    call_us: int = 0  # time inside the training function, integer microseconds
    # The last fault of a process that never resumed after it (PEER or "own"): it explains
    # the process's exit, which its supervisor records by pid.
    ending_fault: str | None = None
    interrupted_calls: int = 0
    # (wall of its call_start, seconds counted up to the file's last event) of a call that
    # never ended: its process's end, known only job-wide, ends it (``time_ledger``).
    open_call: tuple[float, float] | None = None
    state_saves: list[float] = field(default_factory=list)  # checkpoint saves, restored commits
    # The process's events stop inside the training function with no fault: it died unexplained.
    vanished: bool = False
    rounds: dict[int, RoundState] = field(default_factory=dict)
    signatures: dict[str, SignatureGroup] = field(default_factory=dict)
    # Every fault by which a monitor said its process is gone (dead, unresponsive), round or not.
    monitor_deaths: list[LocalFault] = field(default_factory=list)
    hangs: list[dict[str, Any]] = field(default_factory=list)
    # Children that a supervisor declared hung and ended ((pid, wall) of each declaration):
    # the hang explains the child's exit.
    hung_children: list[tuple[int, float]] = field(default_factory=list)
    node_events: list[dict[str, Any]] = field(default_factory=list)
    wrapper_ends: dict[str, int] = field(default_factory=dict)
    # Every signature the fault events tell of, peers' included: output files that show the
    # same tracebacks add nothing new.
    told_signatures: set[str] = field(default_factory=set)
    told_types: set[str] = field(default_factory=set)  # exception types told without a traceback

    def note_seen(self, event: Ev) -> None:
        """An event of the job read under filters, kept or not: what a ``supervisor_start``
        tells (``note_start``), and how far the file goes (``final_wall``)."""
        if event["kind"] == "supervisor_start":
            self.note_start(event)
        wall = num(event.get("wall"))
        if wall is not None and (self.final_wall is None or wall > self.final_wall):
            self.final_wall = wall

    def note_start(self, event: Ev) -> None:
        """What a ``supervisor_start`` tells of the whole job, noted whatever the filters keep:
        where a job run begins (and which SLURM run it is, when recorded), and the SLURM job its
        supervisor ran in (sacct's id, and the array element's name when it was one)."""
        start = run_start(event)
        if start is not None:
            self.run_starts.append(start)
            slurm_run = slurm_run_of(event)
            if slurm_run is not None:
                self.start_runs[start] = slurm_run
        task = array_task_name(event.get("slurm_array_job_id"), event.get("slurm_array_task_id"))
        if task is not None:
            self.array_tasks.add(task)
        slurm_job, wall = as_str(event.get("slurm_job_id")), num(event.get("wall"))
        if slurm_job is not None and wall is not None:
            self.slurm_jobs[slurm_job] = max(wall, self.slurm_jobs.get(slurm_job, wall))
