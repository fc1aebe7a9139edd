"""``build_report``: a job's log directory (and SLURM's records) in, a ``Report`` out.

``Report`` is the report's data (``model.ReportData``) with its printed forms: the
renderers read ``ReportData``; ``Report``, above them, hands itself to the one its
format asks for. Event files are folded into one ``JobSummary`` (``aggregate_files``:
the unit of work of a worker process), in worker processes when there are many of them
(one file per process, so they are independent), and merged as they come. Nothing here
writes to the log directory.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import multiprocessing
import os
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import TextIO

from . import job_facts, time_ledger
from .activity import build_activity
from .compact import compress_ints
from .failure_groups import add_output_findings, build_failures
from .file_summary import FileSummary
from .job_rounds import job_restart_rounds
from .job_summary import JobSummary
from .loading import JobDir, ReportError, resolve_job_dir
from .model import (
    Hang,
    LogFinding,
    ProcessRestart,
    Reading,
    RejectedWrite,
    ReportData,
    Restarts,
    RoundRow,
    SlurmContext,
    Summary,
)
from .node_loss import LossIndex, node_losses
from .node_requeues import node_requeues
from .output_scan import scan_output_file
from .output_triage import Death, EventFacts, triage
from .process_rows import process_restarts
from .progress import Progress
from .rank_files import attach_rank_files, name_causes
from .render import render
from .render_html import render_html
from .restores import build_restores
from .slurm_context import (
    default_search_dirs,
    find_output_files,
    query_sacct,
    runs,
    sacct_requeues,
)
from .stragglers import build_stragglers
from .summarize import Filters, fold_file, summarize_file
from .suspects import build_suspects
from .text_doc import TEXT_WIDTH
from .timeline import build_timeline

#: Below this many rank files holding fewer bytes, worker processes cost more than they save.
PARALLEL_MIN_FILES = 64
PARALLEL_MIN_BYTES = 32 << 20
CHUNKS_PER_WORKER = 4
#: Files read in one piece without workers (progress is told after each piece).
SERIAL_CHUNK_FILES = 64
_NODE_FILE_PREFIXES = ("supervisor-", "store-")


def _node_file(path: Path) -> bool:
    return path.name.startswith(_NODE_FILE_PREFIXES)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # read (and reported) as unreadable by whichever process gets it


def _chunks(files: list[Path], sizes: dict[Path, int], n: int) -> list[list[Path]]:
    """``files`` in ``n`` chunks of about as many bytes (largest first, each to the lightest
    chunk), each chunk in the files' own order."""
    heap = [(0, i) for i in range(n)]
    chunks: list[list[Path]] = [[] for _ in range(n)]
    for path in sorted(files, key=lambda p: -sizes[p]):
        load, i = heapq.heappop(heap)
        chunks[i].append(path)
        heapq.heappush(heap, (load + sizes[path], i))
    order = {path: k for k, path in enumerate(files)}
    return [sorted(chunk, key=order.__getitem__) for chunk in chunks]


def aggregate_files(
    paths: Sequence[str | os.PathLike[str]],
    filters: Filters | None = None,
    run_starts: dict[str, list[float]] | None = None,
    run_ends: list[float] | None = None,
    slurm_runs: dict[int, int] | None = None,
) -> JobSummary:
    """Summarize and merge ``paths`` into one ``JobSummary`` (the unit of work of a worker process).

    When the job ran once (each supervisor started once), every file's rounds are of run 0,
    and the files fold them straight into the job's: no round state of a file is merged.
    A file that starts a run itself, or is damaged, has the files folded one by one instead.
    """
    job = JobSummary.starting(run_starts, run_ends, slurm_runs)
    if job.runs == 1:
        for path in paths:
            fs = fold_file(path, filters, job_rounds=job.rounds)
            if fs is None or fs.run_starts:
                break
            job.add(fs)
        else:
            return job
        job = JobSummary.starting(run_starts, run_ends, slurm_runs)
    for path in paths:
        job.add(summarize_file(path, filters))
    return job


def run_starts_of(summaries: Iterable[FileSummary]) -> dict[str, list[float]]:
    """``supervisor_start`` wall times per ``run_key`` in ``summaries``, in time order: where
    each job run begins."""
    starts: dict[str, list[float]] = {}
    for fs in summaries:
        for key, wall in fs.run_starts:
            starts.setdefault(key, []).append(wall)
    return {key: sorted(walls) for key, walls in starts.items()}


def run_ends_of(summaries: Iterable[FileSummary], starts: dict[str, list[float]]) -> list[float]:
    """Where each job run but the last ended, told by the supervisors of the ``run_key``s
    that started in every run (``starts``): the latest of their starts in the run and of the
    last events of the files whose last start is in it (one supervisor process, one file).

    A requeued job's run ends before the next begins: a start later than a run's end is of a
    later run, whichever supervisor started first in it.
    """
    runs = max(map(len, starts.values()), default=0)
    every = [walls for walls in starts.values() if len(walls) == runs]
    ends = [max(walls[k] for walls in every) for k in range(runs - 1)]
    for fs in summaries:
        if not fs.run_starts or fs.final_wall is None:
            continue
        key, wall = max(fs.run_starts, key=lambda start: start[1])
        walls = starts.get(key, [])
        k = bisect.bisect_left(walls, wall)
        if len(walls) == runs and k < runs - 1:
            ends[k] = max(ends[k], fs.final_wall)
    return list(itertools.accumulate(ends, max))  # a run ends no earlier than the one before


def slurm_runs_of(
    summaries: Iterable[FileSummary], starts: dict[str, list[float]]
) -> dict[int, int]:
    """SLURM's run -> the job run it is, from the supervisor starts that recorded their SLURM
    run (``slurm_run``): a ``run_key`` that started in every run has its k-th start in run k.

    Empty where that does not say it once (the starts name several SLURM jobs, each counting
    its runs from 0: a job submitted again under one ``NVRX_JOB_ID``; or two SLURM runs are one
    job run, or one is two): runs are then told apart by the starts alone (``run_of``).
    """
    summaries = list(summaries)
    if len({job for fs in summaries for job in fs.slurm_jobs}) > 1:
        return {}
    runs = max(map(len, starts.values()), default=0)
    pairs = set()
    for fs in summaries:
        for (key, wall), slurm_run in fs.start_runs.items():
            walls = starts.get(key, [])
            if len(walls) == runs:
                pairs.add((slurm_run, bisect.bisect_left(walls, wall)))
    found = dict(pairs)
    if len(found) != len(pairs) or len(set(found.values())) != len(found):
        return {}
    return found


def _aggregate(
    files: Sequence[Path], filters: Filters, workers: int, progress: Progress
) -> JobSummary:
    """All files folded into one ``JobSummary`` (``aggregate_files``); in worker processes
    when there are many.

    Per-node files go first, in this process: their ``supervisor_start``
    events date the job's runs, which workers need to file rounds under.
    """
    node_files = [p for p in files if _node_file(p)]
    rank_files = [p for p in files if not _node_file(p)]
    # All run starts must be known before any event is filed under a run.
    node_summaries = [summarize_file(p, filters) for p in node_files]
    progress.advance(len(node_files))
    starts = run_starts_of(node_summaries)
    ends, slurm_runs = run_ends_of(node_summaries, starts), slurm_runs_of(node_summaries, starts)
    agg = JobSummary.starting(starts, ends, slurm_runs)
    for summary in node_summaries:
        agg.add(summary)
    sizes = {p: _size(p) for p in rank_files}
    few = len(rank_files) < PARALLEL_MIN_FILES and sum(sizes.values()) < PARALLEL_MIN_BYTES
    if workers <= 1 or len(rank_files) < 2 or few:
        for i in range(0, len(rank_files), SERIAL_CHUNK_FILES):
            chunk = rank_files[i : i + SERIAL_CHUNK_FILES]
            agg.merge(
                aggregate_files(chunk, filters, agg.run_starts, agg.run_ends, agg.run_slurm_runs)
            )
            progress.advance(len(chunk))
        return agg
    # fork is cheapest, but unsafe when the caller runs other threads.
    method = (
        "fork"
        if threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods()
        else "spawn"
    )
    # A few chunks per worker, of about as many bytes each: even load, and few (small)
    # partial results to send back.
    chunks = _chunks(rank_files, sizes, min(len(rank_files), workers * CHUNKS_PER_WORKER))
    work = partial(
        aggregate_files,
        filters=filters,
        run_starts=agg.run_starts,
        run_ends=agg.run_ends,
        slurm_runs=agg.run_slurm_runs,
    )
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context(method)
    ) as pool:
        nonempty = [c for c in chunks if c]
        for chunk, part in zip(nonempty, pool.map(work, nonempty), strict=True):
            agg.merge(part)
            progress.advance(len(chunk))
    return agg


def _default_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


def _given_sources(
    slurm_output: Sequence[str | os.PathLike[str]],
    submitit_folders: Sequence[str | os.PathLike[str]],
    notes: list[str],
) -> tuple[list[Path], list[Path]]:
    """The ``--slurm-output`` files and ``--submitit-folder`` folders there are; a note for
    each one that is not (missing, not a file or folder, or a folder this user may not read)."""
    paths: list[Path] = []
    for given in map(Path, slurm_output):
        if given.is_file():
            paths.append(given)
        else:
            notes.append(f"SLURM output file {str(given)!r} not found; skipped")
    folders: list[Path] = []
    for folder in map(Path, submitit_folders):
        if not folder.is_dir():
            notes.append(f"submitit folder {str(folder)!r} not found; skipped")
        elif not os.access(folder, os.R_OK | os.X_OK):
            notes.append(f"cannot read submitit folder {str(folder)!r}: no permission; skipped")
        else:
            folders.append(folder)
    return paths, folders


def _log_findings(
    jobs: Sequence[str | None],
    job_dir: Path,
    slurm_output: Sequence[str | os.PathLike[str]],
    submitit_folders: Sequence[str | os.PathLike[str]],
    facts: EventFacts,
    notes: list[str],
    slurm: SlurmContext,
) -> tuple[list[LogFinding], list[Death]]:
    """Failures in the job's output files that the events cannot tell (``output_triage``),
    and the unexplained process ends they explain. ``jobs``: the ids the files are named
    after, the events' job, the SLURM jobs the supervisors ran in and the job array
    elements they were (``<array id>_<index>``)."""
    paths, folders = _given_sources(slurm_output, submitit_folders, notes)
    for job in dict.fromkeys(jobs):
        paths += find_output_files(job, default_search_dirs(job_dir), folders)
    unique = list(dict.fromkeys(p.resolve() for p in paths))
    items = []
    for path in unique:
        try:
            items.extend(scan_output_file(path))
        except OSError as exc:
            notes.append(f"cannot read output file {str(path)!r}: {exc.strerror or exc}; skipped")
            continue
        slurm.output_files.append(str(path))
    judged = triage(items, facts)
    if judged.in_events:
        notes.append(
            f"{judged.in_events} failure(s) in SLURM/submitit output also appear in the events"
        )
    if judged.live:
        notes.append(
            f"{judged.live} traceback(s)/stack dump(s) in output files printed by live processes "
            "(or by processes whose end the events explain), not counted"
        )
    return judged.findings, judged.explained


class Report(ReportData):
    """The whole report; ``to_dict`` is the JSON contract, ``to_text`` renders it."""

    def to_text(self, format: str = "table", width: int | None = TEXT_WIDTH) -> str:
        """Render as ``table`` (default), ``markdown``, ``json`` or ``html`` (a whole page).
        ``width``: the widest line of ``table`` (cells wrapped to fit; None: no limit)."""
        if format == "html":
            return render_html(self)
        return render(self, format, width)


def _node_losses(job: JobSummary) -> LossIndex:
    """The job's node losses; with them known, the hangs a supervisor reported (a plain
    script's, which name its slot as their node) are moved to the node rank a spare took
    over before them, as its ranks' events are."""
    losses = node_losses(job)
    for h in job.hangs:
        h.node = losses.node_rank(h.run, h.node, h.wall)
    return losses


def _ask_sacct(
    sacct: bool, job_id: str | None, slurm_jobs: list[str], notes: list[str]
) -> SlurmContext:
    """``sacct``'s records (``sacct`` False: none, --no-sacct) of the SLURM job of the last
    run, whose end is the outcome, else, with none known (an older writer's events), of
    ``job_id``; a note names them all when there are several."""
    if not sacct:
        return SlurmContext(error="sacct not asked (--no-sacct)")
    if len(slurm_jobs) > 1:
        notes.append(
            f"the supervisors ran in {len(slurm_jobs)} SLURM jobs ({', '.join(slurm_jobs)}, in "
            f"the order their runs started): sacct was asked about the last, {slurm_jobs[-1]}"
        )
    return query_sacct(slurm_jobs[-1] if slurm_jobs else job_id)


def build_report(
    log_dir: str | os.PathLike[str] | None = None,
    job: str | None = None,
    *,
    rank: int | None = None,
    node: int | None = None,
    since: float | None = None,
    sacct: bool = True,
    slurm_output: Sequence[str | os.PathLike[str]] = (),
    submitit_folders: Sequence[str | os.PathLike[str]] = (),
    workers: int | None = None,
    progress: TextIO | None = None,
) -> Report:
    """Read one job's events (and, when available, ``sacct`` and its output files) into a ``Report``.

    ``log_dir`` is the job's own event directory or the base holding one directory per job
    (default: the job-environment contract's, ``nvrx.jobenv``); ``job`` picks the job there.
    ``rank``/``node``/``since`` (epoch seconds) restrict the events considered. ``progress``:
    a terminal to show files read on (``progress``); nothing is shown on a stream that is
    not one. Raises ``ReportError`` when there is nothing to read."""
    job_dir = resolve_job_dir(log_dir, job)
    filters = Filters(job=job, rank=rank, node=node, since=since)
    notes = list(job_dir.notes)
    agg = _read_events(job_dir, filters, workers or _default_workers(), progress, notes)
    job_id = job or (sorted(agg.jobs)[0] if len(agg.jobs) == 1 else job_dir.job)
    slurm_jobs = agg.slurm_job_ids()
    slurm = _ask_sacct(sacct, job_id, slurm_jobs, notes)
    losses = _node_losses(agg)
    process_rows = process_restarts(agg, losses)
    attach_rank_files(process_rows, job_dir.path, notes)
    timeline = _rounds(agg, process_rows, losses, notes)
    failures = build_failures(agg, process_rows, losses)
    facts = job_facts.output_facts(agg, process_rows, losses)
    names = [job_id, *slurm_jobs, *agg.array_elements()]  # what the output files are named after
    findings, explained = _log_findings(names, job_dir.path, slurm_output, submitit_folders, facts, notes, slurm)
    add_output_findings(failures, findings, explained)
    kept = sorted(agg.ranks) if rank is not None or node is not None else None
    activity = build_activity(agg, timeline, failures, process_rows, losses, kept)
    stragglers = build_stragglers(agg)
    suspects, exclude = build_suspects(agg, timeline, failures, process_rows, losses, stragglers)
    restarts = job_facts.restarts(agg, timeline, sacct_requeues(slurm), process_rows, len(losses.in_run()))
    return Report(
        summary=_summary(agg, job_id, timeline, restarts, losses, slurm, filters, notes),
        timeline=timeline,
        failures=failures,
        hangs=sorted(agg.hangs, key=_hang_order),
        process_restarts=process_rows,
        suspects=suspects,
        exclude=exclude,
        slurm=slurm,
        log_findings=findings,
        reading=_reading(job_dir.path, agg, notes),
        generated_at=time.time(),
        node_losses=losses.losses,
        activity=activity,
        restores=build_restores(agg, timeline),
        stragglers=stragglers,
        rejected_writes=_rejected_writes(agg),
        node_requeues=node_requeues(agg),
    )


def _rejected_writes(agg: JobSummary) -> list[RejectedWrite]:
    """Every ``rejected_write`` event, in the order they were recorded: a value of a sealed
    control key whose seal did not verify (forged by a process without the job's secret, or
    replayed from another key, round or run). One process of the job records them
    (``docs/security.md`` names which, key by key); the job acted on none of them, and the
    report lists them as a sign that something else reaches the job's store."""
    found = [e for e in agg.node_events if e.get("kind") == "rejected_write"]
    return [
        RejectedWrite(
            run=e["run"],
            wall=e.get("wall"),
            node=e.get("node"),
            key=e.get("key"),
            reason=e.get("reason"),
            value_bytes=e.get("value_bytes"),
        )
        for e in sorted(found, key=lambda e: e.get("wall") or 0.0)
    ]


_WALL_CLOCK_NOTE = (
    "first failing rank of some rounds was ordered by wall clock (faults on several "
    "hosts and no store-recorded origin, or no boot id): clock skew between hosts, "
    "or a step of the clock, may reorder them"
)


def _rounds(
    agg: JobSummary, process_rows: list[ProcessRestart], losses: LossIndex, notes: list[str]
) -> list[RoundRow]:
    """The timeline's rows: the Wrapper's rounds, else the job-wide restarts, if any; a note
    when some round's first failure was ordered by wall clock."""
    timeline = build_timeline(agg, process_rows, losses)
    if not any(row.outcome_from == "wrapper" for row in timeline):
        # No Wrapper told its rounds: job-wide restarts, where there were some, tell them.
        timeline = job_restart_rounds(agg, losses) or timeline
    name_causes(timeline, process_rows)  # an exit code's exception, where its files tell it
    if any(row.ordering == "wall_clock" and row.first_rank is not None for row in timeline):
        notes.append(_WALL_CLOCK_NOTE)
    return timeline


def _hang_order(h: Hang) -> tuple[int, int, float]:
    return h.run, h.round if h.round is not None else -1, h.wall or 0.0


def _read_events(
    job_dir: JobDir,
    filters: Filters,
    workers: int,
    progress: TextIO | None,
    notes: list[str],
) -> JobSummary:
    """The job's events folded into one summary; raises ``ReportError`` when there are none,
    or when the job or rank the filters name is not in them. What was ignored goes to ``notes``."""
    shown = Progress(len(job_dir.files), progress) if progress is not None else Progress(0)
    try:
        agg = _aggregate(job_dir.files, filters, workers, shown)
    finally:
        shown.finish()
    agg.settle()
    if agg.events == 0 and agg.skipped_count == 0:
        raise ReportError(
            f"no events in the {len(job_dir.files)} event file(s) of {str(job_dir.path)!r}: all empty"
        )
    if agg.events == 0:
        raise ReportError(
            f"no readable events in {str(job_dir.path)!r}: {agg.skipped_count} line(s) or file(s) skipped, "
            f"first: {agg.skipped[0].path}:{agg.skipped[0].line} {agg.skipped[0].reason}"
        )
    if agg.events_used == 0:
        if filters.job is not None or filters.rank is not None or filters.node is not None:
            everything = _aggregate(job_dir.files, Filters(), workers, Progress(0))  # are they there?
            _check_named(filters, everything, job_dir.path)
        notes.append("no event matches the --job/--rank/--node/--since filters")
    if len(agg.jobs) > 1 and filters.job is None:
        notes.append(
            f"events of several jobs in one directory: {', '.join(sorted(agg.jobs))} (pass --job)"
        )
    if agg.unknown_kinds:
        kinds = ", ".join(f"{k} ({n})" for k, n in sorted(agg.unknown_kinds.items()))
        notes.append(f"event kinds unknown to this nvrx (newer writer?) were ignored: {kinds}")
    if agg.interrupted_calls:
        notes.append(
            f"{agg.interrupted_calls} call(s) of the training function never ended (process killed); "
            "counted up to the process's last event"
        )
    return agg


def _check_named(filters: Filters, everything: JobSummary, directory: Path) -> None:
    """``ReportError`` (exit 2) when ``filters`` ask for a job, rank or node that none of the
    events of ``directory`` (``everything``: all of them, unfiltered) names; the error says
    what is there. Without it a typo'd job id or a rank or node beyond the job's would print
    an empty report and exit 0."""
    jobs, ranks, nodes = everything.jobs, everything.ranks, set(everything.node_hosts)
    if filters.job is not None and jobs and filters.job not in jobs:
        raise ReportError(
            f"no job {filters.job!r} in {str(directory)!r}: jobs {', '.join(sorted(jobs))}"
        )
    if filters.rank is not None and filters.rank not in ranks:
        there = f"ranks {compress_ints(ranks)}" if ranks else "no rank wrote events"
        raise ReportError(f"no rank {filters.rank} in {str(directory)!r}: {there}")
    if filters.node is not None and filters.node not in nodes:
        there = f"nodes {compress_ints(nodes)}" if nodes else "no event names a node"
        raise ReportError(f"no node {filters.node} in {str(directory)!r}: {there}")


def _outcome(
    agg: JobSummary, timeline: list[RoundRow], losses: LossIndex, slurm: SlurmContext, filtered: bool
) -> tuple[str, str | None]:
    """How the job ended, and why: by ``sacct`` when it knows (the events' word in the
    reason), by the events otherwise (``filtered``: by ``--rank``/``--node``/``--since``)."""
    outcome, reason = job_facts.final_outcome(agg, timeline, losses.lost_slots(), filtered)
    slurm_runs = runs(slurm)
    if slurm_runs:
        last = slurm_runs[-1]
        events_said = outcome
        outcome = f"{last.state} (sacct, exit {last.exit_code})"
        reason = f"{reason}; events: {events_said}" if reason else f"events: {events_said}"
    return outcome, reason


def _summary(
    agg: JobSummary,
    job_id: str | None,
    timeline: list[RoundRow],
    restarts: Restarts,
    losses: LossIndex,
    slurm: SlurmContext,
    filters: Filters,
    notes: list[str],
) -> Summary:
    """The summary table: size, times, goodput, restarts and how the job ended (by ``sacct``
    when it knows, by the events otherwise), of the events ``filters`` keep."""
    restricted = filters.rank is not None or filters.node is not None
    # the end events are the latest: --since leaves them out only when it keeps none at all
    hides_end = restricted or (filters.since is not None and agg.events_used == 0)
    outcome, reason = _outcome(agg, timeline, losses, slurm, hides_end)
    slurm_runs = runs(slurm)
    wall = (
        (agg.last_wall - agg.first_wall)
        if agg.first_wall is not None and agg.last_wall is not None
        else 0.0
    )
    if restricted:
        n_ranks = len(agg.ranks)
    else:  # without Wrapper rounds, the supervisors' children: not every rank writes events
        n_ranks = agg.world_size or max(len(agg.ranks), agg.supervised_world())
    busy_s = agg.call_us / 1e6 + time_ledger.unfinished_call_s(agg, losses)
    if agg.calls == 0 and job_facts.child_runtime_s(agg) > 0:
        # No Wrapper marked the training function: the supervised processes' lives stand in.
        busy_s = job_facts.child_runtime_s(agg)
        notes.append(
            "no call_start/call_end events (training not under the in-process Wrapper): "
            "training time is the run time of the supervised processes, start-up included"
        )
    training = busy_s / n_ranks if n_ranks else 0.0
    ledger = time_ledger.build_ledger(agg, timeline, losses, training, wall, n_ranks)
    goodput = (ledger.training_s / wall) if wall > 0 and n_ranks else None
    nodes = {n for n in agg.node_hosts}
    return Summary(
        job=job_id,
        nodes=len(nodes) or len(agg.hosts),
        hosts=sorted(agg.hosts),
        ranks=n_ranks,
        start_wall=agg.first_wall,
        end_wall=agg.last_wall,
        wall_time_s=wall,
        training_time_s=training,
        goodput=goodput,
        rounds=len(timeline),
        runs=agg.runs,
        restarts=restarts,
        outcome=outcome,
        reason=reason,
        interrupted_calls=agg.interrupted_calls,
        processes_relaunched=job_facts.relaunches(agg),
        slurm_nodes=slurm_runs[-1].node_list if slurm_runs else None,
        time_ledger=ledger,
    )


def _reading(log_dir: Path, agg: JobSummary, notes: list[str]) -> Reading:
    """What was read, and what was skipped and why."""
    return Reading(
        log_dir=str(log_dir),
        files=agg.files,
        events=agg.events,
        events_used=agg.events_used,
        unknown_kinds=dict(sorted(agg.unknown_kinds.items())),
        skipped_count=agg.skipped_count,
        skipped=[dataclasses.asdict(s) for s in agg.skipped],
        notes=notes,
    )


__all__ = ["Report", "ReportError", "build_report"]
