"""``--format html``: the report as one self-contained page to look at in a browser.

The page holds the text report's sections (the same rows, by the same section
functions of ``render``, written as HTML tables) and, under the summary, a timeline
of the job: one lane per rank (``html_lanes``, drawn by ``html_timeline``). Each
failure and each hang has a ``<details>`` block (``id="fault-N"``, ``id="hang-N"``)
that the timeline's marks link to. Nothing is fetched: the CSS and the SVG are
inline, and a few lines of inline script open a block when a link to it is
followed. Every text from the events is escaped (``html.escape``): it is untrusted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from html import escape
from typing import Any

from nvrx.events.failures import hang_signature
from nvrx.version import __version__

from .failure_order import causes_first
from .html_lanes import MAX_RANK_LANES, build_lanes
from .html_timeline import PLOT_W, render_svg
from .html_timeline import css as timeline_css
from .model import ReportData
from .render import FAILURE_HEADERS, HANG_HEADERS, SECTIONS, failure_cells, hang_cells
from .stacks import stuck_first
from .text_doc import Doc, ranks_text, when

log = logging.getLogger(__name__)

HTML = "html"

_PAGE_CSS = """
body{font:14px/1.4 sans-serif;color:#1d1f23;margin:16px 24px;max-width:1500px}
h1{font-size:22px;margin:8px 0 12px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d6d9de}
table{border-collapse:collapse;margin:6px 0}th,td{border:1px solid #d6d9de;padding:3px 8px;text-align:left;vertical-align:top}
thead th{background:#eef0f3}table.pairs th{background:#f6f7f9;font-weight:normal;color:#444}
p{white-space:pre-wrap;margin:6px 0}pre{background:#f6f7f9;border:1px solid #e0e3e7;padding:8px;overflow:auto;margin:4px 0 10px}
details{margin:4px 0}details>summary{cursor:pointer}details:target>summary,details[open]>summary{font-weight:bold}
.timeline-wrap{overflow-x:auto;border:1px solid #d6d9de;padding:4px 0}footer{color:#777;margin-top:32px;font-size:12px}
p.outcome{font-weight:bold;padding:6px 10px;border-radius:4px;color:#fff}
p.outcome-ok{background:#2e7d32}p.outcome-failed{background:#c62828}p.outcome-unfinished{background:#f9a825;color:#1d1f23}p.outcome-unknown{background:#616161}
"""
# Opens the <details> a followed link (a fault mark, a table link) points at.
_SCRIPT = """
function nvrxOpen(id){var e=document.getElementById(id);if(e&&e.tagName==="DETAILS"){e.open=true;}}
document.addEventListener("click",function(ev){var a=ev.target.closest("a");var h=a&&a.getAttribute("href");if(h&&h.charAt(0)==="#"){nvrxOpen(h.slice(1));}});
window.addEventListener("hashchange",function(){nvrxOpen(location.hash.slice(1));});nvrxOpen(location.hash.slice(1));
"""


class Markup(str):
    """A table cell that is HTML already (a link made here): not escaped again."""


def _cell(value: Any) -> str:
    return str(value) if isinstance(value, Markup) else escape(str(value))


def link(href: str, text: str) -> Markup:
    """A link inside the page, as a table cell (both escaped)."""
    return Markup(f'<a href="{escape(href)}">{escape(text)}</a>')


class HtmlDoc(Doc):
    """``Doc`` written as HTML: the report's sections fill it as they fill the text one."""

    def __init__(self) -> None:
        super().__init__(markdown=False)

    def heading(self, title: str) -> None:
        tag = "h2" if self.parts else "h1"
        self.parts.append(f"<{tag}>{escape(title)}</{tag}>")

    def table(self, rows: list[list[Any]], headers: Sequence[str]) -> None:
        head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
        body = "\n".join("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in row) + "</tr>" for row in rows)
        self.parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>")

    def pairs(self, rows: list[list[str]]) -> None:
        body = "\n".join(f"<tr><th>{escape(k)}</th><td>{_cell(v)}</td></tr>" for k, v in rows)
        self.parts.append(f'<table class="pairs">\n{body}\n</table>')

    def text(self, line: str) -> None:
        self.parts.append(f"<p>{escape(line)}</p>")

    def outcome(self, line: str, verdict: str) -> None:
        """How the job ended, in its colour: a failed job never looks like a healthy one."""
        v = escape(verdict)
        self.parts.append(f'<p class="outcome outcome-{v}" data-outcome="{v}">{escape(line)}</p>')

    def block(self, title: str, body: str, ident: str | None = None) -> None:
        attr = f' id="{escape(ident)}"' if ident else ""
        self.parts.append(
            f"<details{attr}><summary>{escape(title)}</summary><pre>{escape(body)}</pre></details>"
        )

    def raw(self, html: str) -> None:
        """HTML made here (the timeline): added as it is."""
        self.parts.append(html)

    def render(self) -> str:
        return "\n".join(self.parts)


def fault_ids(r: ReportData) -> dict[str, str]:
    """Failure signature -> the id of its block (the first row of that signature); a hang's
    failure -> its hang's block, which holds the stack (printed once)."""
    hung = {(h.stack or "").rstrip(): f"hang-{i}" for i, h in enumerate(r.hangs) if h.stack}
    ids: dict[str, str] = {}
    for i, f in enumerate(r.failures):
        ids.setdefault(f.signature, hung.get((f.traceback or "").rstrip(), f"fault-{i}"))
    return ids


def _timeline(doc: HtmlDoc, r: ReportData) -> None:
    doc.heading("Job timeline")
    lanes = build_lanes(r, fault_ids(r), PLOT_W)
    if lanes is None:
        doc.text("no wall times in the events: nothing to draw")
        return
    ranks = sum(1 for lane in lanes.lanes if lane.kind == "rank")
    who = (
        f"one lane per rank ({ranks})"
        if lanes.by == "rank"
        else f"one lane per node rank (more than {MAX_RANK_LANES} ranks)"
    )
    spares = sum(1 for lane in lanes.lanes if lane.kind == "slot")
    doc.text(
        f"{who}{f', and one per spare slot ({spares})' if spares else ''}; time from "
        f"{when(lanes.start)} to {when(lanes.end)} UTC. Point at a period or a mark for "
        "details; click a red mark for its failure's traceback, a hung period for its stack."
    )
    doc.raw(f'<div class="timeline-wrap">{render_svg(lanes)}</div>')


def _failures(doc: HtmlDoc, r: ReportData) -> None:
    doc.heading("Failures by signature")
    if not r.failures:
        doc.text("no failures")
        return
    index = {id(f): i for i, f in enumerate(r.failures)}  # a block's id: its row in the data
    ordered = causes_first(r)
    rows = [
        [link(f"#fault-{index[id(f)]}", f.signature), *failure_cells(f), when(f.first_wall), f.source]
        for f in ordered
    ]
    doc.table(rows, ["signature", *FAILURE_HEADERS, "first (UTC)", "source"])
    hung = {(h.stack or "").rstrip(): i for i, h in enumerate(r.hangs) if h.stack}
    for f in ordered:
        body = (f.traceback or "").rstrip() or f.message or "(no traceback or message in the events)"
        if body in hung:  # each stack once: under Hangs
            body = f"its stack is under Hangs (#hang-{hung[body]})"
        title = f"{f.signature} ({f.category}, {f.count}x, ranks {ranks_text(f.ranks)})"
        doc.block(title, body, f"fault-{index[id(f)]}")


def _hangs(doc: HtmlDoc, r: ReportData) -> None:
    if not r.hangs:
        return
    doc.heading("Hangs")
    rows = [[link(f"#hang-{i}", f"rank {h.rank}"), *hang_cells(h)] for i, h in enumerate(r.hangs)]
    doc.table(rows, ["rank", *HANG_HEADERS])
    for i, h in enumerate(r.hangs):
        in_round = "" if h.round is None else f" in round {h.round}"
        body = stuck_first((h.stack or "").rstrip()) or "(no stack in the hang report)"
        what = hang_signature(h.timeout)
        doc.block(f"rank {h.rank} stuck{in_round}: {what}, {when(h.wall)}", body, f"hang-{i}")


def _sections() -> list[Callable[[HtmlDoc, ReportData], None]]:
    """The text report's sections (``render.SECTIONS``), failures and hangs given their
    anchors, and the job timeline under the summary."""
    own: dict[str, Callable[[HtmlDoc, ReportData], None]] = {"failures": _failures, "hangs": _hangs}
    out: list[Callable[[HtmlDoc, ReportData], None]] = []
    for name, section in SECTIONS.items():
        out.append(own.get(name, section))
        if name == "summary":
            out.append(_timeline)
    return out


def render_html(report: ReportData) -> str:
    """``report`` as one HTML page (a str), with nothing to fetch."""
    doc = HtmlDoc()
    for section in _sections():
        section(doc, report)
    title = f"nvrx report: job {report.summary.job or '?'}"
    made = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(report.generated_at))
    log.debug("html report: %d part(s)", len(doc.parts))
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{escape(title)}</title>\n<style>{_PAGE_CSS}{timeline_css()}\n</style>\n</head>\n<body>\n"
        f"{doc.render()}\n<footer>nvrx-report {escape(__version__)}, {made}</footer>\n"
        f"<script>{_SCRIPT}</script>\n</body>\n</html>\n"
    )
