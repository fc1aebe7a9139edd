"""Failures by signature: the events' faults, the processes that died, and unexplained hangs.

One failure is one occurrence whoever saw it: a process death that a monitor
already reported as a fault is one row (the process's signal or exit code, in
the monitor's round), and a hang that a hang fault of the same rank and round
tells is not counted again. A lost node is one ``node lost`` failure, and
what the job wrote while it got over the loss (the survivors' exceptions,
hangs and process ends) is not counted: the loss explains it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from nvrx.events.failures import (
    NODE_LOST_SIGNATURE,
    hang_signature,
    kind_of,
    process_end_signature,
)

from .model import Failure, Hang, LogFinding, ProcessRestart
from .parts import LocalFault, SignatureGroup
from .same_failure import SAME_FAILURE_WINDOW_S, same_process_end

if TYPE_CHECKING:
    from .job_summary import JobSummary
    from .node_loss import LossIndex
    from .output_triage import Death


def _group(groups: dict[str, SignatureGroup], sig: str) -> SignatureGroup:
    part = groups.get(sig)
    if part is None:
        part = groups[sig] = SignatureGroup()
    return part


def _add_deaths(
    job: JobSummary, groups: dict[str, SignatureGroup], process_rows: list[ProcessRestart]
) -> list[LocalFault]:
    """Failed processes, unless their own fault event (or a monitor's) tells the failure.

    A monitor's ``dead`` fault and the supervisor's record of the same end are one
    failure: it is counted once, by how the process ended (its signal or exit code;
    the exception in its error file, when it wrote one), in the monitor's round. Every
    such fault of the monitors is a candidate, not only a rank's first of its round (a
    hang, then the death). Returns the faults so counted.
    """
    reported: dict[tuple[str, str | None], list[float]] = {}
    for r in job.rounds.values():
        for f in r.first_by_rank.values():
            if f.wall is not None:
                reported.setdefault((f.signature, f.host), []).append(f.wall)
    merged: list[LocalFault] = []
    for p in process_rows:
        if p.explained_by is not None:  # collateral, or told by its own fault event
            continue
        sig = process_end_signature(p.exit_code, p.signal)
        walls = reported.get((sig, p.host), [])
        if p.wall is not None and any(abs(w - p.wall) <= SAME_FAILURE_WINDOW_S for w in walls):
            continue
        seen = next(
            (
                f
                for f in job.monitor_deaths
                if same_process_end(f, p) and all(f is not m for m in merged)
            ),
            None,
        )
        if seen is not None:
            merged.append(seen)
        rnd = seen.round if seen is not None else None
        error = p.error
        if error is not None and error.signature:  # its error file tells the cause
            _group(groups, error.signature).add(
                p.rank, p.node, p.host, rnd, p.wall,
                exc_type=error.exc_type, message=error.message, traceback=error.traceback,
            )  # fmt: skip
            continue
        _group(groups, sig).add(
            p.rank, p.node, p.host, rnd, p.wall, message=f"local rank {p.local_rank} ended ({sig})"
        )
    return merged


def _drop_merged(
    groups: dict[str, SignatureGroup], monitored: list[LocalFault], merged: list[LocalFault]
) -> None:
    """Take the monitor faults counted with their process's end out of their own groups:
    one fewer each; a group goes when none is left."""
    for sig in sorted({f.signature for f in merged}):
        group = groups.get(sig)
        if group is None:
            continue
        group.count -= sum(1 for f in merged if f.signature == sig)
        if group.count <= 0:
            del groups[sig]
            continue
        left = [f for f in monitored if f.signature == sig and all(f is not m for m in merged)]
        _refill(group, [(f.wall, f.rank, f.node, f.host, f.round) for f in left])


def _drop_explained(groups: dict[str, SignatureGroup], losses: LossIndex) -> None:
    """Take out the occurrences written while the job got over a lost node."""
    for sig in list(groups):
        group = groups[sig]
        left = [o for o in group.seen if losses.explains(o[6], o[5], signature=sig, run=o[7]) is None]  # from its onset
        if len(left) == len(group.seen):
            continue
        if not left:
            del groups[sig]
            continue
        group.count, group.seen = len(left), left
        _refill(group, left)


def _refill(group: SignatureGroup, left: list[tuple]) -> None:
    """``group``'s places and first time from the occurrences ``left``, each (wall, rank,
    node, host, round, ...) as in ``SignatureGroup.seen``."""
    group.ranks, group.nodes, group.hosts, group.rounds = (
        {o[i] for o in left if o[i] is not None} for i in (1, 2, 3, 4)
    )
    group.first_wall = min((o[0] for o in left if o[0] is not None), default=None)


def _add_losses(groups: dict[str, SignatureGroup], losses: LossIndex) -> None:
    """One ``node lost`` failure per node the job lost (``LossIndex.in_run``), with every rank
    it held."""
    for loss in losses.in_run():
        part = _group(groups, NODE_LOST_SIGNATURE)
        first = loss.ranks[0] if loss.ranks else None
        what = f"node rank {loss.node} (slot {loss.slot}, {loss.host}) lost: {loss.outcome}"
        wall = loss.start if math.isfinite(loss.start) else None
        part.add(first, loss.node, loss.host, loss.round, wall, message=what)
        part.ranks.update(loss.ranks)


def untold_hangs(job: JobSummary, losses: LossIndex) -> list[Hang]:
    """Hangs that no hang fault of the same rank and round already tells (nor a lost node:
    ``consequence``, from the rank's last progress)."""
    told = {(run, rnd, rank) for (run, rnd), r in job.rounds.items() for rank in r.hang_faults}
    return [h for h in job.hangs if (h.run, h.round, h.rank) not in told and losses.explains_hang(h) is None]


def build_failures(
    job: JobSummary, process_rows: list[ProcessRestart], losses: LossIndex
) -> list[Failure]:
    """Failure groups: faults of the events, failed processes, hangs that no fault names,
    lost nodes (instead of what the job wrote while it got over each loss)."""
    groups = {sig: _copy(g) for sig, g in job.signatures.items()}
    if losses.losses:
        _drop_explained(groups, losses)
    merged = _add_deaths(job, groups, process_rows)
    _drop_merged(groups, job.monitor_deaths, merged)
    for h in untold_hangs(job, losses):
        _group(groups, hang_signature(h.timeout)).add(h.rank, h.node, h.host, h.round, h.wall, traceback=h.stack)
    _add_losses(groups, losses)
    out = [
        Failure(
            signature=sig,
            category=kind_of(sig),
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
    out.sort(key=lambda f: (-f.count, f.first_wall or 0.0, f.signature))
    return out


def add_output_findings(
    failures: list[Failure], findings: list[LogFinding], explained: list[Death]
) -> None:
    """Failures found only in output files join the events' rows. A traceback printed by a
    process whose end the events record but do not explain is that end's cause: one
    failure, listed once, under the traceback's signature."""
    for death in explained:
        row = next(
            (
                f
                for f in failures
                if f.source == "events"
                and f.signature == death.how
                and (death.rank in f.ranks or (death.rank is None and death.host in f.hosts))
            ),
            None,
        )
        if row is not None:
            row.count -= 1
            if row.count <= 0:
                failures.remove(row)
    for finding in findings:
        failures.append(
            Failure(
                signature=finding.signature,
                category=kind_of(finding.signature),
                count=finding.count,
                ranks=list(finding.ranks),
                nodes=list(finding.nodes),
                hosts=list(finding.hosts),
                rounds=[],
                first_wall=None,
                exc_type=None,
                message=f"{finding.path}:{finding.line}; printed by {finding.printed_by}",
                traceback=finding.text,
                source="slurm_output",
            )
        )


def _copy(g: SignatureGroup) -> SignatureGroup:
    """A copy to add to, so that deriving failures leaves the job's summary as it was."""
    copy = SignatureGroup()
    copy.merge(g)  # merging into an empty group copies every container
    return copy
