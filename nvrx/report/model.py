"""The report as data: what ``nvrx-report`` prints and ``--format json`` writes.

The JSON form (``Report.to_dict``) is a versioned contract for scripts,
described by ``report.schema.json`` next to this module: add fields freely,
bump ``REPORT_SCHEMA_VERSION`` when a field changes meaning or goes away.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

REPORT_SCHEMA_NAME = "nvrx-report"
REPORT_SCHEMA_VERSION = 1


@dataclass
class Restarts:
    in_process: int = 0  # rounds of the Wrapper that ended in a restart
    process: int = 0  # processes restarted by a supervisor after a failure of their own
    requeue: int = 0  # times SLURM requeued the whole job
    node_loss: int = 0  # nodes declared lost by their peers (``node_lost`` events)
    job_wide: int = 0  # restarts of every rank together (``job_restart`` events, any-failed)


@dataclass
class SlurmRow:
    """One ``sacct`` line: the job (one per run when requeued) or one of its steps."""

    job_id: str
    name: str | None
    state: str | None
    exit_code: str | None
    elapsed: str | None
    node_list: str | None
    start: str | None
    end: str | None


@dataclass
class SlurmContext:
    available: bool = False
    error: str | None = None  # why sacct gave nothing (missing, failed, not a SLURM job)
    job: list[SlurmRow] = field(default_factory=list)
    steps: list[SlurmRow] = field(default_factory=list)
    output_files: list[str] = field(default_factory=list)  # stdout/stderr files scanned


@dataclass
class TimeLedger:
    """Where the job's wall time went; the parts sum to ``wall_s`` (``time_ledger``)."""

    wall_s: float = 0.0
    startup_s: float = 0.0  # each run's first supervisor start to its first round (training)
    training_s: float = 0.0  # time in the training function that was kept (lost work left out)
    lost_work_s: float = 0.0  # training since the state was last saved, lost to a fault or stop
    detection_s: float = 0.0  # from each fault to its detection
    restart_s: float = 0.0  # from each detection to the next round's start (rejoin wait out)
    rejoin_wait_s: float = 0.0  # ranks waiting for replacements to rejoin
    requeue_wait_s: float = 0.0  # between runs of a requeued job (in SLURM's queue)
    other_s: float = 0.0  # the rest: shut-down, restarts without the Wrapper, gaps
    # Whether ``checkpoint`` save events told the lost work (else it is 0, unknown).
    lost_work_known: bool = False


@dataclass
class Summary:
    job: str | None
    nodes: int
    hosts: list[str]
    ranks: int
    start_wall: float | None
    end_wall: float | None
    wall_time_s: float
    training_time_s: float  # time inside the training function, averaged over ranks
    goodput: float | None  # training_time_s / wall_time_s
    rounds: int
    runs: int  # job runs (1 + requeues seen in the events)
    restarts: Restarts
    outcome: str
    reason: str | None
    interrupted_calls: int  # calls that never ended (process killed inside the function)
    # Every process relaunch by a supervisor, peers that stopped only because another rank
    # failed included (``restarts.process`` counts only the failed ones).
    processes_relaunched: int = 0
    slurm_nodes: str | None = None  # the job's node list as sacct has it (last run)
    time_ledger: TimeLedger = field(default_factory=TimeLedger)  # where the wall time went


@dataclass
class RoundRow:
    """One restart round of the Wrapper (per job run)."""

    run: int
    round: int
    start_wall: float | None
    end_wall: float | None
    outcome: str
    cause: str | None = None  # signature of the first fault
    fault_kind: str | None = None
    first_rank: int | None = None
    first_node: int | None = None
    first_host: str | None = None
    first_wall: float | None = None  # when the first fault was told (its event; a lost node's last beat)
    # how "first" was decided: monotonic | store_origin | wall_clock | process_exit | hang |
    # node_lost | job_restart | none
    ordering: str = "none"
    also_failed: list[int] = field(default_factory=list)  # other ranks with a fault of their own (after the first)
    peer_notified: int = 0  # ranks that stopped only because a peer faulted
    hang_ranks: list[int] = field(default_factory=list)
    terminated_ranks: list[int] = field(default_factory=list)
    detection_s: float | None = None
    phases: dict[str, float] = field(default_factory=dict)  # phase -> longest duration over ranks (the critical path)
    failed_phases: list[str] = field(default_factory=list)
    restart_latency_s: float | None = None
    # "wrapper": round_end events gave the outcome; "inferred": none did (processes restarted by
    # their supervisor start the next round; the last round takes the job's end).
    outcome_from: str = "wrapper"

    def blame_node_loss(self, loss: NodeLoss) -> None:
        """``loss`` is this round's first failure: its host, its silence as the detection
        time; and this is the loss's round."""
        self.fault_kind, self.ordering = "node_lost", BY_NODE_LOSS
        self.first_host, self.detection_s = loss.host, loss.silent_s
        self.first_wall = loss.start if math.isfinite(loss.start) else None
        loss.round = self.round


#: ``RoundRow.ordering`` of a round that a lost node explains.
BY_NODE_LOSS = "node_lost"


@dataclass
class Failure:
    """One failure signature: how often, where, and one traceback."""

    signature: str
    category: str  # failure kind (nvrx.events.failures): exception, hang, dead, signal, exit, ...
    count: int
    ranks: list[int]
    nodes: list[int]
    hosts: list[str]
    rounds: list[int]
    first_wall: float | None
    exc_type: str | None
    message: str | None
    traceback: str | None
    source: str  # events | slurm_output


@dataclass
class Hang:
    rank: int | None
    node: int | None
    host: str | None
    run: int
    round: int | None
    wall: float | None
    timeout: str | None
    stack: str | None
    stale_s: float | None = None  # how long it had made no progress when the hang was declared

    @property
    def onset(self) -> float | None:
        """When the rank stopped making progress: the report less ``stale_s``."""
        return None if self.wall is None else self.wall - (self.stale_s or 0.0)


@dataclass
class RecordedError:
    """What a process wrote to its error file (torch's ``@record``) before it died."""

    path: str  # relative to the job's log directory
    exc_type: str | None = None
    message: str | None = None
    signature: str | None = None  # type and innermost user frame, as for an exception event
    traceback: str | None = None
    # Where it was read: "error_file" (torch's @record), or "stderr" (the last traceback of
    # the process's own stderr.log, when it wrote no error file).
    source: str = "error_file"


@dataclass
class ProcessRestart:
    """A training process that ended and what its supervisor decided."""

    run: int
    node: int | None
    host: str | None
    local_rank: int | None
    rank: int | None  # node * nproc_per_node + local_rank, when the supervisor said nproc_per_node
    wall: float | None
    exit_code: int | None
    signal: str | None
    runtime_s: float | None
    decision: str | None
    reason: str | None
    relaunch_s: float | None  # exit to the replacement's start
    rejoin_wait_s: float | None  # how long the Wrapper's ranks waited for it (its round's rejoin_wait)
    # What the process's own events say ended it: "peer" (it stopped because another rank
    # failed: collateral, not a failure of its own) or "fault" (its fault event tells it);
    # "node_lost": it ended while a lost node stopped the job (``NodeLoss``), not by itself.
    explained_by: str | None = None
    # Its log files (``--redirects``/``--tee``), relative to the job's log directory.
    files: list[str] = field(default_factory=list)
    error: RecordedError | None = None  # its error file, when it wrote one


@dataclass
class StoreFailover:
    """The job's store moved to a successor after its host was lost (``store_failover``)."""

    successor: int | None  # slot of the supervisor that hosts the new store
    old_store: str | None  # host:port of the lost store
    new_store: str | None  # host:port of the store serving the job since
    epoch: int | None  # store failovers of the job so far, this one included
    duration_s: float | None  # the successor's time from seeing the store lost to serving it


@dataclass
class NodeLoss:
    """A node its peers declared lost (its supervisor fell silent), and what followed."""

    run: int
    node: int | None  # node rank it held (None: a spare that held none)
    slot: int | None  # its supervisor's slot (SLURM_PROCID / --node-rank)
    host: str | None  # SLURM node name under SLURM, else host name
    ranks: list[int]  # global ranks it held
    last_seen_wall: float | None  # its last heartbeat, as the declaring supervisor saw it
    declared_wall: float | None  # when it was declared lost
    silent_s: float | None  # silent this long when declared lost
    cause: str  # why: silent | never_ready | excluded (``node_lost``'s; silent where it has none)
    seen_by: int | None  # slot of the supervisor that declared it lost
    slurm_state: dict[str, str] | None  # SLURM's State/Reason of the node, when asked
    action: str  # spare | shrink | stop | none
    replaced_by: int | None  # spare slot that took over its node rank
    takeover_s: float | None = None  # declared lost -> the spare's takeover (its node_takeover)
    round: int | None = None  # the round it interrupted
    recovered_wall: float | None = None  # first round_start of the job training at full size again
    recovery_s: float | None = None  # last_seen_wall -> recovered_wall
    world_size: int | None = None  # world size of that round
    fenced: bool = False  # its supervisor came back, found itself declared lost, and stopped (exit 9)
    # Declared after its run had ended (the job was in a later run), by a supervisor cut off from
    # the job: no loss the job had, nor evidence against the node (``node_loss._declared_late``).
    after_run_end: bool = False
    outcome: str = ""  # what happened, in words
    store_failover: StoreFailover | None = None  # the job's store moved off this node

    @property
    def start(self) -> float:
        """When the node was lost: its last heartbeat, else its silence back from the declaration."""
        if self.last_seen_wall is not None:
            return self.last_seen_wall
        if self.declared_wall is not None:
            return self.declared_wall - (self.silent_s or 0.0)
        return math.inf


@dataclass
class NodeRequeue:
    """A requeue the supervisor made for lost nodes (its ``requeue`` event, cause
    ``node_failure``): what it excluded, what not and why, and whether SLURM released it."""

    run: int  # the run that lost the nodes
    wall: float | None
    # The SLURM job id requeued: the events' job is NVRX_JOB_ID when one is set. None: an
    # older writer did not name it.
    slurm_job_id: str | None
    excluded: list[str]  # the job's ExcNodeList for its next run, as SLURM held it
    answered: list[str]  # lost nodes that still ran a SLURM step: not excluded
    required: list[str]  # lost nodes its --nodelist names: not excluded, the next run waits for them
    exclude_refused: list[str]  # lost nodes SLURM refused to exclude: the next run may land on them
    exclude_error: str | None  # why SLURM refused them
    held: bool  # SLURM refused to release it: it waits until ``scontrol release JOB``


@dataclass
class Restore:
    """A round that began by restoring the training state, and the training steps it lost."""

    run: int
    round: int
    wall: float | None  # its first ``state_restored`` or checkpoint load
    # The fault it follows: the first fault of the round before (its signature), and who.
    cause: str | None
    first_rank: int | None
    # Ranks per source: memory | peer | checkpoint (kept state's callback, or a checkpoint
    # load event) | none (nothing restored).
    sources: dict[str, int]
    restored: bool  # False: no rank restored anything (training started over from step 0)
    step: int | None  # the step restored; None when nothing was, or its step is not known
    newest_step: int | None  # the newest step reached before it (``restores``)
    steps_lost: int | None  # newest_step - step (- 0 when nothing was restored); None: unknown


@dataclass
class Straggler:
    """A rank or node named slow (a ``straggler`` event), and until when it stayed so."""

    run: int
    of: str  # rank | node
    who: int | None  # the global rank (of rank) or the slot (of node)
    node: int | None  # the training node rank of the node (the rank's node, of rank)
    slot: int | None
    host: str | None
    ranks: list[int]  # the node's global ranks (of node)
    start_wall: float | None  # when it was named slow
    step: int | None  # the step its ranks had reached then
    # When it stopped counting as slow (see end_reason); None: slow until its run ended.
    end_wall: float | None = None
    end_step: int | None = None  # the step of its ``recovered`` event
    recovered: bool = False  # end_reason == "recovered"
    # recovered (its ``recovered`` event) | store failover (the scorer moved: not known
    # whether it recovered) | node left (its node left the job for a spare, or was lost)
    # | None: still slow when its run ended.
    end_reason: str | None = None
    # The evidence, as it was named: its median step time against the job's reference.
    slower_pct: float | None = None
    median_s: float | None = None
    reference_s: float | None = None
    score: float | None = None
    threshold: float | None = None
    window: int | None = None  # steps each median covers
    source: str | None = None  # record_step | section NAME
    # report | exclude | store_host (exclude asked, the node hosts the store) | none (exclude
    # asked, no spare free) | unknown
    action: str = "unknown"
    replaced_by: int | None = None  # slot of the spare that took its place (action exclude)
    replaced_wall: float | None = None  # when that spare took over (or the node was declared lost)


@dataclass
class RejectedWrite:
    """A control value in the store whose seal did not verify (``rejected_write``)."""

    run: int
    wall: float | None
    node: int | None  # the slot of the supervisor that refused it
    key: str | None
    reason: str | None
    value_bytes: int | None


@dataclass
class SuspectNode:
    host: str
    node: int | None
    # Node-level incidents: rounds it failed first in, hangs, process deaths, losses (each once).
    faults: int
    first_failures: int
    hangs: int
    deaths: int
    signatures: list[str]
    suspect: bool  # listed in ``exclude``
    lost: int = 0  # times this node was lost (declared lost by its peers)
    slow: int = 0  # times it was named a straggler and stayed slow, or was excluded for it
    # Why it is (or is not) excluded: the evidence against the node itself (``suspects``).
    evidence: list[str] = field(default_factory=list)


@dataclass
class LogFinding:
    """A failure found in SLURM/submitit output that no event tells: a traceback of a process
    that ended unexplained, or a fatal line of srun, SLURM or the interpreter."""

    path: str
    line: int
    signature: str
    text: str
    count: int = 1  # occurrences of this signature in the output files
    ranks: list[int] = field(default_factory=list)  # who printed it, when known
    nodes: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    # How it was attributed, or that it could not be ("unknown process (...)").
    printed_by: str = ""


@dataclass
class RunSpan:
    """One job run (a requeued job runs again): its first and last supervisor event."""

    run: int
    start_wall: float | None
    end_wall: float | None


@dataclass
class ProcessSpan:
    """One supervised training process: from its supervisor's ``child_start`` to its end."""

    run: int
    rank: int | None  # global rank it ran as
    node: int | None  # node rank it ran as (a spare's: the one it took over)
    slot: int | None  # its supervisor's slot
    host: str | None
    local_rank: int | None
    start_wall: float | None  # None: its start is not in the events read
    end_wall: float | None  # None: no end recorded (still running, or the events stop)
    # How it ended: "exit code 0", "signal SIGKILL", "node lost" (its node was); None: unknown.
    ended: str | None


@dataclass
class SpareSpan:
    """A spare supervisor standing by, from its start until it took over a node rank (or ended)."""

    run: int
    slot: int | None
    host: str | None
    start_wall: float | None
    end_wall: float | None
    took_over: int | None  # node rank it took over at end_wall; None: it never did


@dataclass
class FaultMark:
    """One occurrence of a failure of ``failures`` (by its signature): who, when."""

    signature: str
    rank: int | None
    node: int | None
    host: str | None
    round: int | None
    wall: float | None
    # The job run the report files it under, as its round, hang, process or node loss is
    # (the one its writer recorded, else inferred); None: drawn under the run it falls in.
    run: int | None = None


@dataclass
class Activity:
    """Who ran when, each fault's time and place: what the HTML timeline draws."""

    runs: list[RunSpan] = field(default_factory=list)
    processes: list[ProcessSpan] = field(default_factory=list)
    spares: list[SpareSpan] = field(default_factory=list)
    faults: list[FaultMark] = field(default_factory=list)
    # Ranks whose events --rank/--node kept (only they get lanes); None: every rank of the job.
    ranks: list[int] | None = None


@dataclass
class Reading:
    """What was read, and what was skipped and why."""

    log_dir: str
    files: int
    events: int
    events_used: int
    unknown_kinds: dict[str, int]
    skipped_count: int
    skipped: list[dict[str, Any]]  # first entries: path, line, reason
    notes: list[str]


@dataclass
class ReportData:
    """The whole report's data; ``to_dict`` is the JSON contract. ``build.Report`` adds
    ``to_text``: the renderers read this type, so it knows none of them."""

    summary: Summary
    timeline: list[RoundRow]
    failures: list[Failure]
    hangs: list[Hang]
    process_restarts: list[ProcessRestart]
    suspects: list[SuspectNode]
    exclude: str | None  # ready value for ``sbatch --exclude=``
    slurm: SlurmContext
    log_findings: list[LogFinding]
    reading: Reading
    generated_at: float
    node_losses: list[NodeLoss] = field(default_factory=list)
    activity: Activity = field(default_factory=Activity)
    restores: list[Restore] = field(default_factory=list)
    stragglers: list[Straggler] = field(default_factory=list)
    rejected_writes: list[RejectedWrite] = field(default_factory=list)
    node_requeues: list[NodeRequeue] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = {"schema": REPORT_SCHEMA_NAME, "schema_version": REPORT_SCHEMA_VERSION}
        data.update(dataclasses.asdict(self))
        return data
