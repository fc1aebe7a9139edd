"""Rendering a ``Report`` as terminal tables, Markdown (for issue trackers) or JSON."""

from __future__ import annotations

import json
from collections.abc import Callable

from nvrx.events.failures import PEER

from .failure_order import causes_first, is_follow_on
from .model import Failure, Hang, ProcessRestart, ReportData
from .process_rows import JOB_RESTART, NODE_LOST
from .render_answer import answer_section, first_failure, no_exclude_reason
from .render_losses import node_losses_section
from .render_restores import restores_section
from .render_stragglers import stragglers_section
from .stacks import stuck_first
from .text_doc import TEXT_WIDTH, Doc, ranks_text, secs, trim, when, where

FORMATS = ("table", "json", "markdown")


def _nodes(count: int, hosts: list[str], slurm_nodes: str | None) -> str:
    text = f"{count} ({', '.join(hosts[:8])}{', ...' if len(hosts) > 8 else ''})"
    return f"{text}; SLURM: {slurm_nodes}" if slurm_nodes else text


def _process_restart_count(failed: int, relaunched: int) -> str:
    if relaunched > failed:
        return f"{failed} ({relaunched} processes relaunched, peers included)"
    return str(failed)


_EXPLAINED = {
    PEER: "a peer failed",
    "fault": "own fault",
    NODE_LOST: "a node was lost",
    JOB_RESTART: "job-wide restart",
}


def _summary(doc: Doc, r: ReportData) -> None:
    s = r.summary
    doc.heading("Summary")
    goodput = f"{s.goodput * 100:.1f} %" if s.goodput is not None else "-"
    rows = [
        ["job", s.job or "-"],
        ["nodes", _nodes(s.nodes, s.hosts, s.slurm_nodes)],
        ["ranks", str(s.ranks)],
        ["start / end (UTC)", f"{when(s.start_wall)} / {when(s.end_wall)}"],
        ["wall time", secs(s.wall_time_s)],
        ["training time (per rank)", secs(s.training_time_s)],
        ["goodput", goodput],
        ["rounds", str(s.rounds)],
        ["in-process restarts", str(s.restarts.in_process)],
        ["job-wide restarts", str(s.restarts.job_wide)],
        ["process restarts", _process_restart_count(s.restarts.process, s.processes_relaunched)],
        ["job requeues", str(s.restarts.requeue)],
        ["node losses", str(s.restarts.node_loss)],
        ["outcome", s.outcome],
        ["reason", s.reason or "-"],
    ]
    doc.pairs(rows)


#: The ledger's parts, in its order, with the words the text report uses.
LEDGER_PARTS = (
    ("startup_s", "start-up"),
    ("training_s", "training kept"),
    ("lost_work_s", "work lost since the state was last saved"),
    ("detection_s", "fault detection"),
    ("restart_s", "restart"),
    ("rejoin_wait_s", "waiting for replacements to rejoin"),
    ("requeue_wait_s", "requeue wait (in SLURM's queue)"),
    ("other_s", "other (shut-down, process restarts, gaps)"),
)


def _time_ledger(doc: Doc, r: ReportData) -> None:
    """Where the wall time went; the parts sum to it."""
    ledger = r.summary.time_ledger
    if not ledger.wall_s:
        return
    doc.heading("Where the time went")
    rows = [
        [words, secs(getattr(ledger, name)), f"{getattr(ledger, name) / ledger.wall_s:.1%}"]
        for name, words in LEDGER_PARTS
        if getattr(ledger, name) or name == "training_s"
    ]
    doc.table(rows, ["part", "time", "of wall"])
    lost = "" if ledger.lost_work_known else "; no checkpoint or kept-state events: work lost is not known"
    doc.text(f"sum: {secs(ledger.wall_s)} wall{lost}")


def _slurm(doc: Doc, r: ReportData) -> None:
    doc.heading("SLURM")
    sl = r.slurm
    if not sl.available:
        doc.text(f"sacct: {sl.error or 'no data'}")
    else:
        rows = [
            [
                x.job_id,
                x.name or "-",
                x.state or "-",
                x.exit_code or "-",
                x.elapsed or "-",
                x.node_list or "-",
                x.start or "-",
                x.end or "-",
            ]
            for x in [*sl.job, *sl.steps]
        ]
        doc.table(rows, ["job/step", "name", "state", "exit", "elapsed", "nodes", "start", "end"])
    if sl.output_files:
        doc.text("output files read: " + ", ".join(sl.output_files))


def _timeline(doc: Doc, r: ReportData) -> None:
    doc.heading("Restart timeline")
    if not r.timeline:
        doc.text("no rounds in the events (no Wrapper events, no job-wide restart)")
        return
    many_runs = r.summary.runs > 1
    rows = []
    for t in r.timeline:
        row = [
            str(t.round),
            when(t.start_wall),
            t.outcome,
            t.cause or "-",
            first_failure(t),
            t.ordering if t.first_rank is not None else "-",
            ranks_text(t.also_failed),
            str(t.peer_notified),
            secs(t.restart_latency_s),
        ]
        rows.append(([str(t.run)] if many_runs else []) + row)
    headers = (["run"] if many_runs else []) + [
        "round",
        "start (UTC)",
        "outcome",
        "cause",
        "first failure",
        "ordered by",
        "also failed",
        "peers",
        "restart latency",
    ]
    doc.table(rows, headers)
    phased = [t for t in r.timeline if t.phases or t.detection_s is not None]
    if phased:
        names: list[str] = []
        for t in phased:
            names.extend(p for p in t.phases if p not in names)
        rows = []
        for t in phased:
            cells = [
                secs(t.phases.get(p)) + (" FAILED" if p in t.failed_phases else "") for p in names
            ]
            rows.append(
                ([str(t.run)] if many_runs else []) + [str(t.round), secs(t.detection_s), *cells]
            )
        doc.text("Phase latency per round (slowest rank):")
        doc.table(rows, (["run"] if many_runs else []) + ["round", "detection", *names])


def _rejected_writes(doc: Doc, r: ReportData) -> None:
    """Control values in the store the job did not write: one row per rejected value;
    nothing when there was none."""
    if not r.rejected_writes:
        return
    doc.heading("Rejected writes")
    rows = [
        [when(x.wall), str(x.run), x.key or "-", str(x.value_bytes or 0), x.reason or "-"]
        for x in r.rejected_writes
    ]
    doc.table(rows, ["when (UTC)", "run", "key", "bytes", "why"])
    doc.text(
        "values of the job's control keys without a valid seal: not acted on; something that "
        "is not this job reaches its store (docs/security.md)"
    )


def _failures(doc: Doc, r: ReportData) -> None:
    doc.heading("Failures by signature")
    if not r.failures:
        doc.text("no failures")
        return
    failures = causes_first(r)
    rows = [[f.signature, *failure_cells(f), f.source] for f in failures]
    doc.table(rows, ["signature", *FAILURE_HEADERS, "source"])
    hung = {trim(h.stack) for h in r.hangs if h.stack}
    for f in failures:
        body = trim(f.traceback) or (f.message or "")
        if body in hung:
            doc.text(f"[{f.signature}]: its stack is under Hangs")
        elif body:
            doc.block(f"[{f.signature}]", body)


#: The columns of a failure's row between its signature and its source (``failure_cells``).
FAILURE_HEADERS = ["kind", "count", "ranks", "hosts", "rounds"]
#: The columns of a hang's row after its rank (``hang_cells``).
HANG_HEADERS = ["where", "round", "timeout", "detected (UTC)"]


def failure_cells(f: Failure) -> list[str]:
    """A failure's row between its signature and its source (the HTML page's too)."""
    kind = f.category + (" (follow-on)" if is_follow_on(f) else "")
    return [kind, str(f.count), ranks_text(f.ranks), ", ".join(f.hosts) or ranks_text(f.nodes), ranks_text(f.rounds)]


def hang_cells(h: Hang) -> list[str]:
    """A hang's row after its rank (the HTML page's too)."""
    return [where(h.node, h.host), "-" if h.round is None else str(h.round), h.timeout or "-", when(h.wall)]


def _hangs(doc: Doc, r: ReportData) -> None:
    if not r.hangs:
        return
    doc.heading("Hangs")
    doc.table([[str(h.rank), *hang_cells(h)] for h in r.hangs], ["rank", *HANG_HEADERS])
    for h in r.hangs:
        if h.stack:  # a hang outside the Wrapper (its supervisor's) has no round
            in_round = "" if h.round is None else f" in round {h.round}"
            doc.block(f"[rank {h.rank} stuck{in_round}]", trim(stuck_first(h.stack)))


def _process_restarts(doc: Doc, r: ReportData) -> None:
    if not r.process_restarts:
        return
    doc.heading("Process restarts")
    rows = [
        [
            when(p.wall),
            where(p.node, p.host),
            str(p.local_rank),
            str(p.rank) if p.rank is not None else "-",
            p.signal or f"exit {p.exit_code}",
            _EXPLAINED.get(p.explained_by or "", "-"),
            secs(p.runtime_s),
            p.decision or "-",
            p.reason or "-",
            secs(p.relaunch_s),
            secs(p.rejoin_wait_s),
        ]
        for p in r.process_restarts
    ]
    doc.table(
        rows,
        [
            "ended (UTC)",
            "where",
            "local rank",
            "rank",
            "end",
            "its events say",
            "ran",
            "decision",
            "reason",
            "relaunch",
            "rejoin wait",
        ],
    )
    lines = [
        f"  rank {p.rank}, ended {when(p.wall)}: " + ", ".join(files)
        for p in r.process_restarts
        if (files := _error_file(p) + p.files)
    ]
    if lines:
        doc.text(f"their files, under {r.reading.log_dir}:\n" + "\n".join(lines))


def _error_file(p: ProcessRestart) -> list[str]:
    """Its error file, when it wrote one (a cause read from ``stderr.log`` is among its files)."""
    return [p.error.path] if p.error is not None and p.error.path not in p.files else []


def _suspects(doc: Doc, r: ReportData) -> None:
    doc.heading("Suspect nodes")
    if not r.suspects:
        doc.text("no node-level faults")
        return
    slow = any(n.slow for n in r.suspects)  # a column only when some node was slow
    rows = [
        [
            n.host,
            str(n.node) if n.node is not None else "-",
            str(n.faults),
            str(n.first_failures),
            str(n.hangs),
            str(n.deaths),
            str(n.lost),
            *([str(n.slow)] if slow else []),
            "; ".join(n.signatures),
            "yes" if n.suspect else "no",
        ]
        for n in r.suspects
    ]
    headers = ["host", "node", "faults", "first failures", "hangs", "deaths", "lost"]
    doc.table(rows, [*headers, *(["slow"] if slow else []), "signatures", "suspect"])
    if r.exclude:
        doc.text(f"next submission: --exclude={r.exclude}")
    else:
        doc.text(f"no host to exclude: {no_exclude_reason(r)}")


def _findings(doc: Doc, r: ReportData) -> None:
    if not r.log_findings:
        return
    doc.heading("Found only in SLURM/submitit output")
    rows = [
        [f"{f.path}:{f.line}", f.signature, str(f.count), f.printed_by or "-"]
        for f in r.log_findings
    ]
    doc.table(rows, ["where", "signature", "count", "printed by"])


def _reading(doc: Doc, r: ReportData) -> None:
    g = r.reading
    doc.heading("Read")
    line = f"{g.files} file(s), {g.events} event(s) in {g.log_dir}"
    if g.events_used != g.events:
        line += f"; {g.events_used} matched the filters"
    if g.skipped_count:
        line += f"; {g.skipped_count} line(s)/file(s) skipped"
    doc.text(line)
    for s in g.skipped[:10]:
        doc.text(f"  skipped {s['path']}:{s['line']}: {s['reason']}")
    for note in g.notes:
        doc.text(f"note: {note}")


#: The report's sections by name, in order; another renderer (``render_html``) reuses them.
SECTIONS: dict[str, Callable[[Doc, ReportData], None]] = {
    "answer": answer_section,
    "summary": _summary,
    "time_ledger": _time_ledger,
    "slurm": _slurm,
    "node_losses": node_losses_section,
    "timeline": _timeline,
    "restores": restores_section,
    "stragglers": stragglers_section,
    "rejected_writes": _rejected_writes,
    "failures": _failures,
    "hangs": _hangs,
    "process_restarts": _process_restarts,
    "suspects": _suspects,
    "findings": _findings,
    "reading": _reading,
}


def render(report: ReportData, format: str = "table", width: int | None = TEXT_WIDTH) -> str:
    """The report as ``table`` (terminal, lines fitted to ``width``; None: no limit),
    ``markdown`` or ``json`` text."""
    if format == "json":
        return json.dumps(report.to_dict(), indent=2, default=str) + "\n"
    if format not in FORMATS:
        raise ValueError(f"unknown report format {format!r}; choose one of {', '.join(FORMATS)}")
    doc = Doc(markdown=format == "markdown", width=width)
    for section in SECTIONS.values():
        section(doc, report)
    return doc.render()
