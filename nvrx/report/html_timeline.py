"""The HTML page's timeline: ``Lanes`` (``html_lanes``) drawn as one inline SVG.

x is the job's wall time, y one lane per rank (or node, or spare slot). Every
lane is a ``<g class="lane" data-rank="N">`` (``data-node``, or ``class="lane
spare"`` with ``data-slot``) holding its label and periods; a rank's lane also
says its node rank and hosts (``data-node``, ``data-hosts``: comma-separated, in
order), and each move of
the rank to another host is a ``<g class="move">``. A period is a ``<rect
class="p-KIND">`` with its wall times (``data-start``, ``data-end``); each fault
is one red diamond (``class="fault"``) linking to its failure's block
(``#fault-N``), each hang period to its stack (``#hang-N``). A strip at the right
end says how the job ended, in its colour (``class="outcome"``,
``data-outcome``). Every period and mark has a ``<title>`` tooltip. Text from the
events is escaped; the SVG is well-formed XML, and refers to nothing outside it.
"""

from __future__ import annotations

import logging
import time
from html import escape

from .html_lanes import DEAD, HUNG, IDLE, REQUEUE, RESTART, SPARE, TRAINING, Lane, Lanes, Period
from .render_answer import FAILED, OK, UNFINISHED, UNKNOWN
from .text_doc import secs, when

log = logging.getLogger(__name__)

WIDTH = 1360
LABEL_W = 230
RIGHT_PAD = 28
#: Width of the outcome strip, in the right padding.
OUTCOME_W = 16
PLOT_W = WIDTH - LABEL_W - RIGHT_PAD
LEGEND_H = 26
AXIS_H = 22
ROUNDS_H = 16
#: Lane height: roomy for a few lanes, thinner for many (but never under MIN_LANE_H).
MAX_LANE_H, MIN_LANE_H, LANES_H = 20, 4, 720
#: Marks closer than this (px) on one lane, of one signature, are drawn once.
MARK_MERGE_PX = 3.0
_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 21600, 43200, 86400)

#: kind -> (fill colour, legend text); the page's CSS is built from it too.
COLOURS = {
    TRAINING: ("#2e9e44", "training"),
    IDLE: ("#a8dab5", "alive, outside a round"),
    RESTART: ("#f59c1a", "restart (between rounds)"),
    DEAD: ("#3c3c3c", "dead (until replaced)"),
    HUNG: ("#9c27b0", "hung"),
    SPARE: ("#64a8e8", "spare, standing by"),
    REQUEUE: ("#c9ced6", "requeued (between runs)"),
}
FAULT_COLOUR = "#e0201b"
#: verdict -> (colour, legend text) of the outcome strip and the page's outcome line.
OUTCOME_COLOURS = {
    OK: ("#2e9e44", "completed"),
    FAILED: ("#e0201b", "FAILED"),
    UNFINISHED: ("#f5c518", "not finished"),
    UNKNOWN: ("#9e9e9e", "not known under the filters"),
}
MOVE_COLOUR = "#1565c0"
#: Short periods that matter stay visible: at least this wide (px).
_MIN_W = {DEAD: 3.0, HUNG: 3.0}


def css() -> str:
    """The timeline's styles, for the page's ``<style>``."""
    rules = [f".p-{kind}{{fill:{fill}}}" for kind, (fill, _) in COLOURS.items()]
    rules += [
        f".fault{{fill:{FAULT_COLOUR};stroke:#fff;stroke-width:1}}",
        *(f".outcome-{v}{{fill:{fill}}}" for v, (fill, _) in OUTCOME_COLOURS.items()),
        f".move line{{stroke:{MOVE_COLOUR};stroke-width:2}}.move text{{fill:{MOVE_COLOUR}}}",
        "a:hover>.fault{stroke:#000;stroke-width:2}",
        ".lane-bg{fill:#f4f5f7}.lane-bg.odd{fill:#eceef1}",
        ".lane text,.axis text,.legend text,.rounds text{font:11px sans-serif;fill:#222}",
        ".axis line{stroke:#c4c8ce;stroke-width:1}",
        ".rounds rect{fill:#dfe3e8;stroke:#fff}",
        ".requeue-band{fill:#c9ced6;opacity:.6}",
    ]
    return "\n".join(rules)


def _step(span: float) -> float:
    """A round tick interval giving at most about 12 ticks over ``span`` seconds."""
    return next((float(s) for s in _STEPS if span / s <= 12), span / 12)


def _elapsed(seconds: float) -> str:
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"+{h}h{m:02d}m"
    return f"+{m}m{s:02d}s" if m else f"+{s}s"


class _Svg:
    """Accumulates SVG elements; ``x`` maps wall time to pixels."""

    def __init__(self, lanes: Lanes, lane_h: float) -> None:
        self.lanes, self.lane_h = lanes, lane_h
        self.parts: list[str] = []
        self.top = LEGEND_H + AXIS_H + ROUNDS_H

    def x(self, wall: float) -> float:
        span = self.lanes.end - self.lanes.start
        return LABEL_W + (wall - self.lanes.start) / span * PLOT_W

    def y(self, row: int) -> float:
        return self.top + row * self.lane_h

    def rect(
        self, a: float, b: float, y: float, h: float, cls: str, tip: str, href: str | None = None, min_w: float = 1.0
    ) -> None:
        x0, x1 = self.x(a), self.x(b)
        w = max(x1 - x0, min_w)
        el = (
            f'<rect class="{cls}" x="{x0:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
            f'data-start="{a:.3f}" data-end="{b:.3f}"><title>{escape(tip)}</title></rect>'
        )
        self.parts.append(f'<a href="{escape(href)}">{el}</a>' if href else el)


def _legend(svg: _Svg) -> None:
    x = float(LABEL_W)
    items = [*COLOURS.items(), ("fault", (FAULT_COLOUR, "fault (click: its traceback)"))]
    svg.parts.append('<g class="legend">')
    for kind, (_, text) in items:
        if kind == "fault":
            svg.parts.append(_diamond(x + 6, 13, 6, "fault", "a fault"))
        else:
            svg.parts.append(f'<rect class="p-{kind}" x="{x:.1f}" y="7" width="12" height="12"/>')
        svg.parts.append(f'<text x="{x + 16:.1f}" y="17">{escape(text)}</text>')
        x += 28 + 6.4 * len(text)
    svg.parts.append("</g>")


def _axis(svg: _Svg, height: float) -> None:
    lanes = svg.lanes
    span = lanes.end - lanes.start
    step = _step(span)
    y0 = LEGEND_H
    svg.parts.append('<g class="axis">')
    start = time.strftime("%H:%M:%S UTC", time.gmtime(lanes.start))
    svg.parts.append(f'<text x="4" y="{y0 + 14}">{start}<title>start: {when(lanes.start)} UTC</title></text>')
    t = 0.0
    while t <= span + 1e-9:
        x = svg.x(lanes.start + t)
        svg.parts.append(f'<line x1="{x:.1f}" y1="{y0 + 18}" x2="{x:.1f}" y2="{height:.1f}"/>')
        if 0 < t and x + 48 < WIDTH:  # the start is told in the label column; no label cut off
            svg.parts.append(f'<text x="{x + 2:.1f}" y="{y0 + 14}">{_elapsed(t)}</text>')
        t += step
    svg.parts.append("</g>")


def _rounds(svg: _Svg) -> None:
    y = LEGEND_H + AXIS_H
    svg.parts.append('<g class="rounds">')
    svg.parts.append(f'<text x="4" y="{y + 12}">rounds</text>')
    drawn_to = -1.0  # right edge of the last round drawn: rounds inside its pixel are left out
    for a, b, label in sorted(svg.lanes.rounds):
        x0, x1 = svg.x(a), svg.x(b)
        if x1 < drawn_to + 1.0:
            continue
        drawn_to = max(x1, x0 + 1.0)
        tip = f"{label}: {when(a)} to {when(b)} ({secs(b - a)})"
        svg.parts.append(
            f'<rect x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 1.0):.1f}" height="{ROUNDS_H - 2}">'
            f"<title>{escape(tip)}</title></rect>"
        )
        if x1 - x0 > 7 * len(label):
            svg.parts.append(f'<text x="{x0 + 3:.1f}" y="{y + 11}">{escape(label)}</text>')
    svg.parts.append("</g>")


def _diamond(cx: float, cy: float, r: float, cls: str, tip: str) -> str:
    d = f"M{cx:.1f} {cy - r:.1f}L{cx + r:.1f} {cy:.1f}L{cx:.1f} {cy + r:.1f}L{cx - r:.1f} {cy:.1f}Z"
    return f'<path class="{cls}" d="{d}"><title>{escape(tip)}</title></path>'


def _lane(svg: _Svg, row: int, lane: Lane) -> None:
    y, h = svg.y(row), svg.lane_h
    data = f'data-{lane.kind}="{lane.ident}"'
    if lane.kind == "rank" and lane.node is not None:
        data += f' data-node="{lane.node}"'
    if lane.hosts:
        data += f' data-hosts="{escape(",".join(lane.hosts))}"'
    cls = "lane spare" if lane.kind == "slot" else "lane"
    svg.parts.append(f'<g class="{cls}" {data}>')
    odd = " odd" if row % 2 else ""
    svg.parts.append(f'<rect class="lane-bg{odd}" x="0" y="{y:.1f}" width="{WIDTH}" height="{h:.1f}"/>')
    size = max(3.0, min(11.0, h - 2))
    svg.parts.append(
        f'<text x="4" y="{y + h / 2 + size / 3:.1f}" style="font-size:{size:.0f}px">{escape(lane.label)}</text>'
    )
    inner = max(h - 2.0, 1.0)
    order = {kind: i for i, kind in enumerate((IDLE, TRAINING, RESTART, SPARE, DEAD, HUNG))}
    for p in sorted(lane.periods, key=lambda p: (order.get(p.kind, 0), p.start)):
        tip = f"{lane.label}: {p.note}, {when(p.start)} to {when(p.end)}"
        svg.rect(p.start, p.end, y + 1, inner, f"p-{p.kind}", tip, p.href, _MIN_W.get(p.kind, 1.0))
    for move in lane.moves:
        x = svg.x(move.wall)
        tip = f"{lane.label}: moved from {move.from_host} to {move.to_host}, {when(move.wall)}"
        svg.parts.append(
            f'<g class="move" data-from="{escape(move.from_host)}" data-to="{escape(move.to_host)}">'
            f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x:.1f}" y2="{y + h:.1f}"/>'
            f"<title>{escape(tip)}</title></g>"
        )
    drawn: dict[str, float] = {}
    for m in sorted(lane.marks, key=lambda m: m.wall):
        x = svg.x(m.wall)
        last = drawn.get(m.fault.signature)
        if last is not None and x - last < MARK_MERGE_PX:
            continue
        drawn[m.fault.signature] = x
        f = m.fault
        rnd = f", round {f.round}" if f.round is not None else ""
        also = f" (then {'; '.join(m.also)})" if m.also else ""
        tip = f"{f.signature}{also}: rank {f.rank}, {f.host or '?'}{rnd}, {when(m.wall)}"
        r = max(3.0, min(7.0, h / 2))
        svg.parts.append(f'<a href="{escape(m.href)}">{_diamond(x, y + h / 2, r, "fault", tip)}</a>')
    svg.parts.append("</g>")


def _requeues(svg: _Svg, bands: list[Period], bottom: float) -> None:
    top = svg.top
    for p in bands:
        svg.rect(p.start, p.end, top, bottom - top, "requeue-band", p.note)


def _outcome(svg: _Svg, bottom: float) -> None:
    """The strip right of the lanes, in the colour of how the job ended."""
    if not svg.lanes.verdict:
        return
    said = OUTCOME_COLOURS.get(svg.lanes.verdict, ("", svg.lanes.verdict))[1]
    x, top = WIDTH - RIGHT_PAD + (RIGHT_PAD - OUTCOME_W) / 2, svg.top
    tip = f"job outcome: {said}: {svg.lanes.outcome}"
    svg.parts.append(
        f'<rect class="outcome outcome-{escape(svg.lanes.verdict)}" '
        f'data-outcome="{escape(svg.lanes.verdict)}" x="{x:.1f}" y="{top:.1f}" '
        f'width="{OUTCOME_W}" height="{max(bottom - top, 1.0):.1f}"><title>{escape(tip)}</title></rect>'
    )


def render_svg(lanes: Lanes) -> str:
    """The timeline of ``lanes`` as one ``<svg>`` element."""
    n = max(1, len(lanes.lanes))
    lane_h = max(float(MIN_LANE_H), min(float(MAX_LANE_H), LANES_H / n))
    svg = _Svg(lanes, lane_h)
    height = svg.y(len(lanes.lanes)) + 4
    _legend(svg)
    _axis(svg, height)
    _rounds(svg)
    for row, lane in enumerate(lanes.lanes):
        _lane(svg, row, lane)
    _requeues(svg, lanes.requeues, svg.y(len(lanes.lanes)))
    _outcome(svg, svg.y(len(lanes.lanes)))
    head = (
        f'<svg class="timeline" width="100%" style="max-width:{WIDTH}px" '
        f'viewBox="0 0 {WIDTH} {height:.0f}" role="img" aria-label="timeline by {lanes.by}">'
    )
    log.debug("timeline svg: %d lane(s), %d element(s)", len(lanes.lanes), len(svg.parts))
    return head + "\n".join(svg.parts) + "</svg>"
