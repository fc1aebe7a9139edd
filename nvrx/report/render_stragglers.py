"""The report's *Stragglers* section: each rank or node named slow, until when, what was done."""

from __future__ import annotations

from .model import ReportData, Straggler
from .stragglers import BY_FAILOVER, BY_LEAVING, BY_RECOVERY, EXCLUDE, NODE, slower, step_times
from .text_doc import Doc, ranks_text, secs, when

#: How a straggler is named and when it is excluded, printed under the table.
SLOW_RULE = (
    "slower: its median step time (own work) against the job's reference, the lower quartile "
    "of the ranks' medians (of two, the faster one's); a node's: the median of its ranks', "
    "against the lower quartile of the nodes'; a node still slow at the end of the "
    "job or when it left it, or excluded for slowness, is in the exclusion advice as slow, "
    "not failed (Suspect nodes)"
)


def _who(x: Straggler) -> str:
    """'node 1 (slot 1, ranks 4-7)' or 'rank 5 (node 1)'."""
    if x.of == NODE:
        told = [f"slot {x.slot}"] if x.slot is not None else []
        told += [f"ranks {ranks_text(x.ranks)}"] if x.ranks else []
        node = "?" if x.node is None else str(x.node)
        return f"node {node}" + (f" ({', '.join(told)})" if told else "")
    rank = "?" if x.who is None else str(x.who)
    return f"rank {rank}" + (f" (node {x.node})" if x.node is not None else "")


def _at(wall: float | None, step: int | None, start: float | None) -> str:
    """'2026-01-01 10:00:05.000 (+5.0 s), step 120': the time, since the job's start."""
    text = when(wall)
    if wall is not None and start is not None:
        text += f" (+{secs(max(0.0, wall - start))})"
    return text + (f", step {step}" if step is not None else "")


def _until(x: Straggler, start: float | None, many_runs: bool) -> str:
    """How its row ended: recovered, left, unknown after a store failover, or still slow."""
    if x.end_reason == BY_RECOVERY:
        return "recovered " + _at(x.end_wall, x.end_step, start)
    if x.end_reason == BY_FAILOVER:  # the new scorer never clears what the old one named
        return "unknown: the store failed over at " + _at(x.end_wall, None, start)
    if x.end_reason == BY_LEAVING:
        left = "left the job " if x.of == NODE else "left with its node "
        return left + _at(x.end_wall, None, start)
    end = f"end of run {x.run}" if many_runs else "end of job"
    return f"{end} (still slow)"


def _action(x: Straggler) -> str:
    if x.action == EXCLUDE and x.replaced_by is not None:
        return f"exclude: spare slot {x.replaced_by} took over"
    if x.action == EXCLUDE:
        return "exclude: no takeover in the events"
    if x.action == "none":
        return "none: exclude asked, no spare free"
    if x.action == "store_host":
        return "store_host: exclude asked, it hosts the job's store"
    return x.action


def _evidence(x: Straggler) -> str:
    text = step_times(x)
    if x.score is not None and x.threshold is not None:
        text += f"; score {x.score:.2f} < {x.threshold:.2f}"
    return text + (f"; from {x.source}" if x.source else "")


def stragglers_section(doc: Doc, r: ReportData) -> None:
    """One row per rank or node named slow; nothing when none was."""
    if not r.stragglers:
        return
    doc.heading("Stragglers")
    start, many_runs = r.summary.start_wall, r.summary.runs > 1
    rows = [
        ([str(x.run)] if many_runs else [])
        + [
            _who(x),
            x.host or "-",
            _at(x.start_wall, x.step, start),
            _until(x, start, many_runs),
            slower(x),
            _action(x),
            _evidence(x),
        ]
        for x in r.stragglers
    ]
    headers = (["run"] if many_runs else []) + [
        "straggler",
        "host",
        "named slow (UTC)",
        "until",
        "how much",
        "action",
        "evidence",
    ]
    doc.table(rows, headers)
    doc.text(SLOW_RULE)
