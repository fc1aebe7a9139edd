"""The HTML timeline's lanes: what each rank (or node) was doing when, as coloured periods.

One lane per global rank (those ``--rank``/``--node`` kept, when they restricted the
events), or one per node rank when there are more than ``MAX_RANK_LANES`` ranks, plus
one per spare slot. A rank's lane is labelled with its node rank and the hosts it ran
on, in order (``node-b→node-c`` when a spare took its node over), and each move to
another host is marked where the new process started. A lane's periods, from the
report's data (``Report.activity``, rounds, hangs):

- alive: the lives of its processes (``child_start`` to its end), cut by the run's
  rounds into ``training`` (inside a round), ``restart`` (from a round's end to the
  next round's start, or from ``restart_latency_s`` before that start when the
  round reports it: the latency counts from the fault's detection, replacements'
  rejoin wait included; where skewed host clocks put a round's end after the next
  start, the overlap) and ``idle`` (alive outside any round: start-up, shut-down).
  A job with no rounds trains all the time its processes live; a job with no
  supervisor events lives from the start of the run to its end. Rounds narrower than
  a pixel of the drawing are joined, in the colour they spend most time in;
- ``dead``: from a process's end until its replacement trained: the first round
  that started after the replacement did (or its start, without such a round;
  after a failure with no replacement, until the run's end);
- ``hung``: from the rank's last progress (the hang report's ``stale_s`` before it)
  until the process ended or its round did;
- ``spare``: a spare slot standing by until it took over a node rank;
- ``requeue``: the gap between two runs of the job (drawn across every lane).
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise

from nvrx.events.failures import NODE_LOST_SIGNATURE

from .activity import LOST
from .model import FaultMark, Hang, ProcessSpan, ReportData, RunSpan, SpareSpan
from .render_answer import verdict
from .text_doc import secs

log = logging.getLogger(__name__)

#: Above this many ranks, one lane per node rank instead of one per rank.
MAX_RANK_LANES = 256
#: Largest world size believed when drawing ranks that wrote no event (a bigger one is an odd log).
MAX_RANKS = 1 << 17
TRAINING, RESTART, IDLE, DEAD, HUNG, SPARE, REQUEUE = (
    "training",
    "restart",
    "idle",
    "dead",
    "hung",
    "spare",
    "requeue",
)

Piece = tuple[float, float, str]
#: Tooltip words of the periods of a living process.
_ALIVE_NOTES = {TRAINING: "training", RESTART: "restart", IDLE: "alive, outside a round"}


@dataclass
class Period:
    """A stretch of one kind on a lane; ``note`` is its tooltip, ``href`` its block's link."""

    start: float
    end: float
    kind: str
    note: str
    href: str | None = None


@dataclass
class Mark:
    """A fault mark on a lane, linking to its failure's block; ``also``: the signatures of the
    same fault's other reports (a process's end after its exception), drawn as this one."""

    wall: float
    fault: FaultMark
    href: str
    also: list[str] = field(default_factory=list)


@dataclass
class Move:
    """A rank's process started on another host than its previous one (a spare took over)."""

    wall: float
    from_host: str
    to_host: str


@dataclass
class Lane:
    """One row of the timeline: a rank, a node rank or a spare slot."""

    kind: str  # "rank", "node" or "slot" (a spare)
    ident: int
    label: str
    periods: list[Period] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    node: int | None = None  # node rank of a rank's lane (its last)
    hosts: list[str] = field(default_factory=list)  # hosts it ran on, in order (``_place``)
    moves: list[Move] = field(default_factory=list)


@dataclass
class Lanes:
    """Everything the timeline draws, between wall times ``start`` and ``end``."""

    start: float
    end: float
    by: str  # "rank" or "node"
    lanes: list[Lane]
    rounds: list[tuple[float, float, str]]  # (start, end, label) of each round
    requeues: list[Period]
    outcome: str = ""  # how the job ended (the summary's outcome)
    verdict: str = ""  # render_answer.verdict of it: ok, failed or unfinished


def _merge(pieces: Iterable[Piece]) -> list[Piece]:
    """Adjacent or overlapping pieces of one kind joined, in time order."""
    out: list[Piece] = []
    for a, b, kind in sorted(pieces):
        if out and out[-1][2] == kind and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b), kind)
        else:
            out.append((a, b, kind))
    return out


def _phases(report: ReportData, run: RunSpan, end: float) -> list[Piece]:
    """The run's time as training / restart / idle pieces; restart wins over training.

    A sweep over the rounds' windows: linear in the rounds (after sorting), whatever their count."""
    rows = sorted((r for r in report.timeline if r.run == run.run), key=lambda r: r.round)
    start = run.start_wall if run.start_wall is not None else report.summary.start_wall or 0.0
    stop = run.end_wall if run.end_wall is not None else end
    if not rows:
        return [(start, stop, TRAINING)]
    windows: list[Piece] = []
    for i, row in enumerate(rows):
        later = i + 1 < len(rows)
        nxt = rows[i + 1].start_wall if later else None
        if row.start_wall is not None:  # a round no event started covers no time
            b = row.end_wall if row.end_wall is not None else stop
            if not later and row.outcome_from == "inferred":
                b = max(b, stop)  # no rank told its end: the run's last round lasted as its processes did
            windows.append((row.start_wall, b, TRAINING))
        if later and nxt is None and row.end_wall is not None:
            windows.append((row.end_wall, stop, RESTART))  # a restart that never started its round
            continue
        if nxt is None:
            continue
        # from the fault's detection (restart latency before the next start), else the round's end
        begin = row.end_wall if row.end_wall is not None else nxt
        if row.restart_latency_s is not None:
            begin = min(begin, nxt - row.restart_latency_s)
        if begin != nxt:
            windows.append((min(begin, nxt), max(begin, nxt), RESTART))
    change: dict[float, list[int]] = {}  # wall -> [training, restart] windows opening (+) or closing (-)
    for a, b, kind in windows:
        if a < b:  # an empty or reversed window covers nothing
            change.setdefault(a, [0, 0])[int(kind == RESTART)] += 1
            change.setdefault(b, [0, 0])[int(kind == RESTART)] -= 1
    cuts = sorted({start, stop, *(w for w in change if start <= w <= stop)})
    walls, j, covering = sorted(change), 0, [0, 0]
    pieces = []
    for a, b in pairwise(cuts):
        while j < len(walls) and walls[j] <= a:
            covering = [covering[0] + change[walls[j]][0], covering[1] + change[walls[j]][1]]
            j += 1
        pieces.append((a, b, RESTART if covering[1] else TRAINING if covering[0] else IDLE))
    return _merge(pieces)


def _coarse(pieces: list[Piece], width: float) -> list[Piece]:
    """``pieces`` (contiguous, in order) with each run of ones narrower than ``width`` seconds
    joined into pieces about ``width`` wide, of the kind they spend most time in: the drawing
    has no room for them, and lanes stay as long as the drawing is wide, however many rounds."""
    out: list[Piece] = []
    group: dict[str, float] = {}  # kind -> seconds, of the pieces joined so far
    g0 = g1 = 0.0
    for a, b, kind in pieces:
        if group and (b - a >= width or g1 - g0 >= width):
            out.append((g0, g1, max(group, key=lambda k: group[k])))
            group = {}
        if b - a >= width:
            out.append((a, b, kind))
            continue
        if not group:
            g0 = a
        group[kind] = group.get(kind, 0.0) + (b - a)
        g1 = b
    if group:
        out.append((g0, g1, max(group, key=lambda k: group[k])))
    return _merge(out)


def _cut(a: float, b: float, phases: list[Piece]) -> list[Piece]:
    """``[a, b]`` as the phase pieces it overlaps (idle outside them); ``phases`` are in time
    order and disjoint, so the first one is found by bisection."""
    out: list[Piece] = []
    t = a
    for i in range(bisect_right(phases, a, key=lambda p: p[1]), len(phases)):
        x, y, kind = phases[i]
        if x >= b:
            break
        if x > t:
            out.append((t, x, IDLE))
        out.append((max(a, x), min(b, y), kind))
        t = max(t, min(b, y))
    if t < b:
        out.append((t, b, IDLE))
    return _merge(out)


@dataclass
class _Life:
    run: int
    start: float
    end: float
    ended: str | None
    node: int | None
    place: str | None = None  # its host; with its slot when a host ran several (a local job)


def _shared_hosts(processes: list[ProcessSpan]) -> set[str]:
    """Hosts on which several supervisor slots ran processes (a local job's nodes)."""
    slots: dict[str, set[int | None]] = {}
    for p in processes:
        if p.host is not None:
            slots.setdefault(p.host, set()).add(p.slot)
    return {host for host, seen in slots.items() if len(seen) > 1}


def _place(p: ProcessSpan, shared: set[str]) -> str | None:
    """Where ``p`` ran: its host, and its slot when that host ran several."""
    if p.host is None:
        return None
    return f"{p.host} slot {p.slot}" if p.host in shared and p.slot is not None else p.host


def _lives(report: ReportData, runs: list[RunSpan], end: float) -> dict[int, list[_Life]]:
    """Each rank's process lives, in order, with unknown starts and ends filled from the run's
    (an unknown end: the start of the rank's next process of the run, else the run's end)."""
    by_run = {r.run: r for r in runs}
    shared = _shared_hosts(report.activity.processes)
    spans: dict[int, list[ProcessSpan]] = {}
    for p in report.activity.processes:
        if p.rank is not None and p.rank >= 0:
            spans.setdefault(p.rank, []).append(p)
    lives: dict[int, list[_Life]] = {}
    for rank, items in spans.items():
        items.sort(key=lambda p: (p.run, p.start_wall if p.start_wall is not None else -math.inf))
        out: list[_Life] = []
        later: float | None = None  # start of the next process of the same run (walking back)
        for i in range(len(items) - 1, -1, -1):
            p = items[i]
            if i + 1 < len(items) and items[i + 1].run != p.run:
                later = None
            run = by_run.get(p.run)
            r0 = run.start_wall if run is not None and run.start_wall is not None else report.summary.start_wall
            r1 = run.end_wall if run is not None and run.end_wall is not None else end
            a = p.start_wall if p.start_wall is not None else (r0 or 0.0)
            b = p.end_wall if p.end_wall is not None else later if later is not None else r1
            out.append(_Life(p.run, a, max(a, b), p.ended, p.node, _place(p, shared)))
            if p.start_wall is not None:
                later = p.start_wall
        lives[rank] = out[::-1]
    return lives


def _failed_ends(report: ReportData) -> set[tuple[int, int | None, float]]:
    """(run, rank, wall) of each process end the report counts as a failure (or collateral)."""
    return {(p.run, p.rank, round(p.wall, 3)) for p in report.process_restarts if p.wall is not None}


def _alive(lives: Iterable[_Life], phases: dict[int, list[Piece]]) -> list[Period]:
    """What each run was doing (training, restart, idle) while any of ``lives`` lasted."""
    spans: dict[int, list[Piece]] = {}
    for life in lives:
        spans.setdefault(life.run, []).append((life.start, life.end, ""))
    out: list[Period] = []
    for run, items in spans.items():
        for a, b, _ in _merge(items):
            for x, y, kind in _cut(a, b, phases.get(run, [])):
                out.append(Period(x, y, kind, f"{_ALIVE_NOTES[kind]} for {secs(y - x)}"))
    return out


def _trains(life: _Life, starts: list[float]) -> float:
    """When the process of ``life`` first trained: the first round start (of its run's
    sorted ``starts``) inside its life, else its own start."""
    i = bisect_right(starts, life.start)
    return starts[i] if i < len(starts) and starts[i] < life.end else life.start


def _dead(
    lives: list[_Life],
    run_ends: dict[int, float],
    end: float,
    failed: set[tuple[int, int | None, float]],
    rank: int,
    starts: dict[int, list[float]],
) -> list[Period]:
    """One rank's dead gaps: until its next life of the run trained (``_trains``), or, after
    a failed end (or a lost node) with no next life, until the run's end."""
    out: list[Period] = []
    for i, life in enumerate(lives):
        nxt = lives[i + 1] if i + 1 < len(lives) and lives[i + 1].run == life.run else None
        until = _trains(nxt, starts.get(life.run, [])) if nxt is not None else run_ends.get(life.run, end)
        ended_badly = life.ended == LOST or (life.run, rank, round(life.end, 3)) in failed
        if nxt is None and not ended_badly:
            continue
        if until > life.end:
            what = f"process ended ({life.ended or 'unknown'})"
            then = "never replaced"
            if nxt is not None:
                then = f"until its replacement trained (started {secs(nxt.start - life.end)} after)"
            out.append(Period(life.end, until, DEAD, f"{what}, {then}: {secs(until - life.end)}"))
    return out


def _placement(lives: list[_Life]) -> tuple[int | None, list[str], list[Move]]:
    """A rank's last node rank, the hosts it ran on in order, and its moves between them."""
    hosts: list[str] = []
    moves: list[Move] = []
    node = None
    for life in lives:
        node = life.node if life.node is not None else node
        if life.place is None:
            continue
        if hosts and hosts[-1] != life.place:
            moves.append(Move(life.start, hosts[-1], life.place))
        if not hosts or hosts[-1] != life.place:
            hosts.append(life.place)
    return node, hosts, moves


def _label(by: str, key: int, node: int | None, hosts: list[str]) -> str:
    """``rank 2 · node 1 · node-b→node-c`` (a node lane: ``node 1 · node-b``)."""
    parts = [f"{by} {key}"]
    if by == "rank" and node is not None:
        parts.append(f"node {node}")
    if hosts:
        parts.append("→".join(hosts))
    return " · ".join(parts)


def _hung(
    hangs: list[tuple[int, Hang]],
    lives: list[_Life],
    round_ends: dict[tuple[int, int | None], float | None],
    run_ends: dict[int, float],
    end: float,
) -> list[Period]:
    """Each hang (with its index in ``report.hangs``), from the rank's last progress until its
    process, its round or its run ended."""
    out = []
    for i, h in hangs:
        if h.wall is None:
            continue
        living = [life for life in lives if life.start <= h.wall < life.end]
        ends = [life.end for life in living]
        round_end = round_ends.get((h.run, h.round))
        if round_end is not None and round_end > h.wall:
            ends.append(round_end)
        until = max(min(ends, default=run_ends.get(h.run, end)), h.wall)
        # from its last progress: stale_s before the report, not before its process started
        since = h.wall - (h.stale_s or 0.0)
        since = max([since, *(life.start for life in living)])
        note = (
            f"hung ({h.timeout or '?'} timeout) for {secs(until - since)}: no progress from "
            f"{secs(h.wall - since)} before its detection"
        )
        out.append(Period(since, until, HUNG, note, f"#hang-{i}"))
    return out


def _minus(periods: list[Period], cover: list[Period]) -> list[Period]:
    """``periods`` without the stretches that ``cover`` holds: a replacement that has not
    trained yet is not training, a hung rank is not either."""
    cuts = _merge((c.start, c.end, "") for c in cover)
    if not cuts:
        return periods
    pieces: list[tuple[float, float, Period]] = []
    for p in periods:
        t = p.start
        for a, b, _ in cuts[bisect_right(cuts, p.start, key=lambda c: c[1]) :]:
            if a >= p.end:
                break
            if a > t:
                pieces.append((t, a, p))
            t = max(t, b)
        if t < p.end:
            pieces.append((t, p.end, p))
    return [Period(a, b, p.kind, _alive_note(p, a, b), p.href) for a, b, p in pieces]


def _alive_note(p: Period, a: float, b: float) -> str:
    """The tooltip of the part ``[a, b]`` of ``p``."""
    if (a, b) == (p.start, p.end) or p.kind not in _ALIVE_NOTES:
        return p.note
    return f"{_ALIVE_NOTES[p.kind]} for {secs(b - a)}"


def _union(periods: Iterable[Period], kind: str, note: str) -> list[Period]:
    merged = _merge((p.start, p.end, kind) for p in periods)
    return [Period(a, b, k, f"{note} for {secs(b - a)}") for a, b, k in merged]


def _thin(periods: list[Period], width: float, limit: int) -> list[Period]:
    """A lane's ``periods`` when it has more than ``limit`` (processes that ended thousands of
    times): each run of periods narrower than ``width`` seconds (a pixel) joined into periods
    about that wide, drawn in the kind they spend most time in, their tooltip telling how
    many were joined and each kind's time. Periods as wide as a pixel stay as they are."""
    if len(periods) <= limit:
        return periods
    out: list[Period] = []
    group: list[Period] = []
    g1 = -math.inf  # end of the group so far
    for p in sorted(periods, key=lambda p: (p.start, p.end)):
        narrow = p.end - p.start < width
        if group and (not narrow or p.start - g1 >= width or g1 - group[0].start >= width):
            out.append(_joined(group))
            group = []
        if not narrow:
            out.append(p)
            continue
        g1 = max(g1, p.end) if group else p.end
        group.append(p)
    if group:
        out.append(_joined(group))
    return out


def _joined(group: list[Period]) -> Period:
    """One period for ``group`` (``_thin``): the kind it spent most time in."""
    if len(group) == 1:
        return group[0]
    share: dict[str, float] = {}
    for p in group:
        share[p.kind] = share.get(p.kind, 0.0) + (p.end - p.start)
    kind = max(share, key=lambda k: share[k])
    told = ", ".join(f"{k} {secs(v)}" for k, v in sorted(share.items(), key=lambda kv: -kv[1]))
    start, end = group[0].start, max(p.end for p in group)
    return Period(start, end, kind, f"{len(group)} periods too short to draw one by one ({told})")


def _mark_lane(m: FaultMark, by: str, node_of: dict[int, int | None]) -> int | None:
    """The lane of fault mark ``m``: its rank's (a node's first rank when it names none), or
    its node's."""
    if by == "rank":
        if m.rank is not None:
            return m.rank
        return min((r for r, n in node_of.items() if n is not None and n == m.node), default=None)
    if m.node is not None:
        return m.node
    return node_of.get(m.rank) if m.rank is not None else None


def _spare_lanes(spares: list[SpareSpan], start: float, end: float) -> list[Lane]:
    """One lane per spare slot (its waits of every run on it)."""
    lanes: dict[int, Lane] = {}
    for sp in spares:
        slot = sp.slot if sp.slot is not None else -1
        lane = lanes.setdefault(slot, Lane("slot", slot, f"spare slot {'?' if sp.slot is None else slot}"))
        a = sp.start_wall if sp.start_wall is not None else start
        b = max(a, sp.end_wall if sp.end_wall is not None else end)
        took = f", then took over node rank {sp.took_over}" if sp.took_over is not None else ""
        lane.periods.append(Period(a, b, SPARE, f"spare on {sp.host or '?'} for {secs(b - a)}{took}"))
    return [lanes[k] for k in sorted(lanes)]


def build_lanes(report: ReportData, fault_ids: dict[str, str], pixels: int = 1200) -> Lanes | None:
    """The lanes of ``report``; None when it has no wall times to draw on.

    ``fault_ids``: failure signature -> id of its block on the page (marks link to it);
    ``pixels``: the drawing's width (rounds narrower than a pixel are joined). Linear in ranks,
    processes, rounds and marks: a node lane cuts the run's phases once for the union of
    its ranks' lives."""
    act, s = report.activity, report.summary
    walls = [w for w in (s.start_wall, s.end_wall) if w is not None]
    walls += [w for p in act.processes for w in (p.start_wall, p.end_wall) if w is not None]
    if not walls:
        return None
    start, end = min(walls), max(walls)
    if end <= start:
        end = start + 1.0
    runs = act.runs or [RunSpan(0, start, end)]
    phases = {r.run: _coarse(_phases(report, r, end), (end - start) / max(1, pixels)) for r in runs}
    run_ends = {r.run: r.end_wall if r.end_wall is not None else end for r in runs}
    round_ends = {(r.run, r.round): r.end_wall for r in report.timeline}
    # the job's ranks (a world size past MAX_RANKS is not believed), or those the filters kept
    known = range(min(s.ranks, MAX_RANKS)) if act.ranks is None else act.ranks
    lives = _lives(report, runs, end)
    failed = _failed_ends(report)
    if not act.processes:  # no supervisor: every rank lives from the start of each run to its end
        every = [_Life(r.run, r.start_wall or start, r.end_wall or end, None, None) for r in runs]
        lives = {rank: list(every) for rank in known}
    seen = (*known, *lives, *(m.rank for m in act.faults), *(h.rank for h in report.hangs))
    ranks = {r for r in seen if r is not None and r >= 0}
    node_of = {rank: life.node for rank, items in lives.items() for life in items if life.node is not None}
    by = "rank" if len(ranks) <= MAX_RANK_LANES else "node"
    if by == "node":  # ranks no supervisor placed: their node by the usual layout
        per_node = -(-(min(s.ranks, MAX_RANKS) or max(ranks) + 1) // max(1, s.nodes))
        node_of = {rank: node_of.get(rank, rank // per_node) for rank in ranks}
    hangs = _hangs_by_rank(report.hangs)
    starts = _round_starts(report)
    lanes: dict[int, Lane] = {}
    for key, of_lane in _members(ranks, by, node_of):
        dead = [p for r in of_lane for p in _dead(lives.get(r, []), run_ends, end, failed, r, starts)]
        hung = [
            p for r in of_lane for p in _hung(hangs.get(r, []), lives.get(r, []), round_ends, run_ends, end)
        ]
        mine = sorted((life for r in of_lane for life in lives.get(r, [])), key=lambda x: x.start)
        if by == "node":
            dead = _union(dead, DEAD, "some process of this node dead")
        alive = _minus(_alive(mine, phases), [*dead, *hung])
        node, hosts, moves = _placement(mine)
        periods = _thin([*alive, *dead, *hung], (end - start) / max(1, pixels), max(1, pixels))
        lanes[key] = Lane(by, key, _label(by, key, node, hosts), periods, [], node, hosts, moves)
    _add_marks(lanes, report, [(_mark_lane(m, by, node_of), m) for m in act.faults], fault_ids)
    out = [*lanes.values(), *_spare_lanes(act.spares, start, end)]
    rounds = [
        (r.start_wall, r.end_wall if r.end_wall is not None else end, f"round {r.round}")
        for r in report.timeline
        if r.start_wall is not None
    ]
    log.debug("timeline: %d lane(s) by %s", len(out), by)
    return Lanes(start, end, by, out, rounds, _requeues(runs), s.outcome, verdict(s))


def _hangs_by_rank(hangs: list[Hang]) -> dict[int, list[tuple[int, Hang]]]:
    """Each rank's hangs, with their index in the report's list (their block's id)."""
    out: dict[int, list[tuple[int, Hang]]] = {}
    for i, h in enumerate(hangs):
        if h.rank is not None:
            out.setdefault(h.rank, []).append((i, h))
    return out


def _add_marks(
    lanes: dict[int, Lane],
    report: ReportData,
    marks: list[tuple[int | None, FaultMark]],
    fault_ids: dict[str, str],
) -> None:
    """One mark per fault (``one_mark_per_fault``) on its lane, linked to its failure's block."""
    for key, mark in one_mark_per_fault(report, marks):
        if key is not None and key in lanes and mark.fault.signature in fault_ids:
            mark.href = f"#{fault_ids[mark.fault.signature]}"
            lanes[key].marks.append(mark)


def _round_starts(report: ReportData) -> dict[int, list[float]]:
    """Each run's round starts, sorted."""
    starts: dict[int, list[float]] = {}
    for r in report.timeline:
        if r.start_wall is not None:
            starts.setdefault(r.run, []).append(r.start_wall)
    return {run: sorted(walls) for run, walls in starts.items()}


def _run_at(runs: list[RunSpan], wall: float) -> int | None:
    """The run that ``wall`` falls in: the last one started at or before it (else the first),
    for a mark that does not say its run (``FaultMark.run``). Round numbers start again in
    each run, so a round is told apart by its run too."""
    started = [r for r in runs if r.start_wall is not None and r.start_wall <= wall]
    if started:
        return max(started, key=lambda r: (r.start_wall, r.run)).run
    return runs[0].run if runs else None


def _round_at(report: ReportData, m: FaultMark, run: int | None) -> int | None:
    """The round of mark ``m``: its own, else the last round of its run started at or before it."""
    if m.round is not None or m.wall is None:
        return m.round
    started = [
        r for r in report.timeline if r.run == run and r.start_wall is not None and r.start_wall <= m.wall
    ]
    return max(started, key=lambda r: (r.start_wall, r.round)).round if started else None


def _consequence(report: ReportData, m: FaultMark, run: int | None, rnd: int | None) -> bool:
    """Whether ``m`` follows from its round's cause: the round has a cause, and ``m`` is
    neither it nor a fault of a rank the round counts as failing on its own."""
    row = next((r for r in report.timeline if (r.run, r.round) == (run, rnd) and r.cause is not None), None)
    if row is None or m.signature == row.cause or m.signature == NODE_LOST_SIGNATURE:
        return False
    return m.rank is not None and m.rank != row.first_rank and m.rank not in row.also_failed


def one_mark_per_fault(
    report: ReportData, marks: list[tuple[int | None, FaultMark]]
) -> list[tuple[int | None, Mark]]:
    """One mark per fault: the reports of one rank in one round (its exception, then its
    process's end; a hang, then the kill) are one fault, drawn at the first of them, under
    the round's cause when it is among them; outside any round, the reports of one of its
    processes are; a lost node is one fault, on its first rank's lane; what other ranks
    wrote because of the round's fault (a peer's ``PeerLost``) is its consequence, not a
    mark of its own. Marks without a wall are left out."""
    causes = {(r.run, r.round): r.cause for r in report.timeline}
    lives = _process_starts(report)
    groups: dict[tuple, list[tuple[int | None, FaultMark]]] = {}
    for key, m in sorted(marks, key=lambda km: (km[1].wall or 0.0, km[0] if km[0] is not None else -1)):
        if m.wall is None:
            continue
        run = m.run if m.run is not None else _run_at(report.activity.runs, m.wall)
        rnd = _round_at(report, m, run)
        if _consequence(report, m, run, rnd):
            continue
        lost = m.signature == NODE_LOST_SIGNATURE
        who = ("node", m.node) if lost else ("lane", key)
        # outside a round: which process of the rank told it (a lost node's ranks: when lost)
        life = None if rnd is not None else m.wall if lost else _life_at(lives, run, m.rank, m.wall)
        groups.setdefault((*who, run, rnd, life), []).append((key, m))
    out: list[tuple[int | None, Mark]] = []
    for (_, _, run, rnd, _), items in groups.items():
        told = {c for (n, r), c in causes.items() if n == run and (rnd is None or r == rnd)}
        key, first = next(((k, m) for k, m in items if m.signature in told), items[0])
        wall = min(m.wall for _, m in items if m.wall is not None)
        also = sorted({m.signature for _, m in items} - {first.signature})
        out.append((key, Mark(wall, first, "", also)))
    return out


def _process_starts(report: ReportData) -> dict[tuple[int, int | None], list[float]]:
    """(run, rank) -> the start walls of its supervised processes, sorted."""
    starts: dict[tuple[int, int | None], list[float]] = {}
    for p in report.activity.processes:
        if p.start_wall is not None:
            starts.setdefault((p.run, p.rank), []).append(p.start_wall)
    return {key: sorted(walls) for key, walls in starts.items()}


def _life_at(
    starts: dict[tuple[int, int | None], list[float]], run: int | None, rank: int | None, wall: float
) -> float:
    """Which process of ``rank`` was alive at ``wall``: how many of its processes had started
    by then; without supervised processes to tell, ``wall`` itself (each report its own)."""
    walls = starts.get((run, rank)) if run is not None else None
    return float(bisect_right(walls, wall)) if walls else wall


def _members(ranks: set[int], by: str, node_of: dict[int, int]) -> list[tuple[int, list[int]]]:
    """Each lane's key (a rank, or a node when ``by`` is "node") and its ranks, by key."""
    members: dict[int, list[int]] = {}
    for rank in sorted(ranks):
        key = rank if by == "rank" else node_of.get(rank)
        if key is not None:
            members.setdefault(key, []).append(rank)
    return sorted(members.items())


def _requeues(runs: list[RunSpan]) -> list[Period]:
    """The gaps between one job run's end and the next one's start."""
    return [
        Period(x.end_wall, y.start_wall, REQUEUE, f"requeued: run {y.run} started {secs(y.start_wall - x.end_wall)} later")
        for x, y in pairwise(runs)
        if x.end_wall is not None and y.start_wall is not None and y.start_wall > x.end_wall
    ]
