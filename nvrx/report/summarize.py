"""Per-file summaries: each event file folded into a small record, one event at a time.

One file is one process, so a summary is cheap to build in a worker process
and cheap to send back; the report merges summaries, never raw events, which
keeps memory flat for thousands of ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from nvrx.events.reader import ReadStats

from .loading import read_events
from .signatures import chained_signatures, fault_signature

#: Fault kinds that are consequences of another rank's fault, not causes.
CONSEQUENCE_FAULT_KINDS = frozenset({"peer"})
#: Kinds of per-node (supervisor, store, launcher) events kept whole: they are few.
NODE_EVENT_KINDS = frozenset(
    {
        "supervisor_start",
        "supervisor_end",
        "child_start",
        "child_exit",
        "restart_decision",
        "rejoin",
        "job_stop",
        "signal_received",
        "requeue",
        "preempt_signal",
        "store_start",
        "store_end",
    }
)
#: Components whose events belong to one training rank.
_RANK_COMPONENTS = ("wrapper", "monitor", "app")
#: Kinds whose own fields reuse the name of a common field (schema quirk).
_HOST_SHADOWING_KINDS = frozenset({"store_start"})
_NODE_EVENT_FIELDS = (
    "kind",
    "wall",
    "mono",
    "boot",
    "host",
    "node",
    "rank",
    "round",
    "component",
    "local_rank",
    "child_pid",
    "attempt",
    "exit_code",
    "signal",
    "runtime_s",
    "decision",
    "reason",
    "budget_left",
    "signature",
    "wait_s",
    "action",
    "cause",
    "count",
    "nnodes",
    "nproc_per_node",
)


@dataclass(frozen=True)
class Filters:
    """Which events the report considers (``--job``, ``--rank``, ``--node``, ``--since``)."""

    job: str | None = None
    rank: int | None = None
    node: int | None = None
    since: float | None = None

    def active(self) -> bool:
        return any(v is not None for v in (self.job, self.rank, self.node, self.since))

    def keep(self, event: dict[str, Any]) -> bool:
        if self.job is not None and event.get("job") is not None and str(event["job"]) != self.job:
            return False
        if self.rank is not None and event.get("rank") != self.rank:
            return False
        if self.node is not None and event.get("node") != self.node:
            return False
        if self.since is not None and _num(event.get("wall"), 0.0) < self.since:
            return False
        return True


@dataclass
class LocalFault:
    """A fault that started on this rank (not a ``peer`` notification)."""

    rank: int | None
    node: int | None
    host: str | None
    boot: str | None
    mono: float | None
    wall: float | None
    fault_kind: str
    signature: str
    detection_s: float | None


@dataclass
class RoundPart:
    """What one process saw of one restart round."""

    first_wall: float | None = None
    last_wall: float | None = None
    outcomes: dict[str, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # phase -> longest duration seen
    failed_phases: set[str] = field(default_factory=set)
    restart_latency_s: float | None = None
    local_faults: list[LocalFault] = field(default_factory=list)
    peer_ranks: set[int] = field(default_factory=set)
    origin_votes: dict[int, int] = field(default_factory=dict)
    hang_ranks: set[int] = field(default_factory=set)
    ranks_terminated: set[int] = field(default_factory=set)


@dataclass
class SignaturePart:
    """Occurrences of one failure signature in one file."""

    count: int = 0
    ranks: set[int] = field(default_factory=set)
    nodes: set[int] = field(default_factory=set)
    hosts: set[str] = field(default_factory=set)
    rounds: set[int] = field(default_factory=set)
    first_wall: float | None = None
    exc_type: str | None = None
    message: str | None = None
    traceback: str | None = None


@dataclass
class FileSummary:
    """Everything the report needs from one event file."""

    path: str
    stats: ReadStats
    kept: int = 0
    host: str | None = None
    boot: str | None = None
    component: str | None = None
    first_wall: float | None = None
    last_wall: float | None = None
    jobs: set[str] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    node_hosts: dict[int, str] = field(default_factory=dict)
    world_size: int = 0
    pid: int | None = None
    calls: int = 0  # call_start/call_end events seen
    call_us: int = 0  # time inside the training function, integer microseconds
    # The last fault of a process that never resumed after it ("peer" or "own"): it explains
    # the process's exit, which its supervisor records by pid.
    ending_fault: str | None = None
    interrupted_calls: int = 0
    rounds: dict[int, RoundPart] = field(default_factory=dict)
    signatures: dict[str, SignaturePart] = field(default_factory=dict)
    hangs: list[dict[str, Any]] = field(default_factory=list)
    node_events: list[dict[str, Any]] = field(default_factory=list)
    wrapper_ends: dict[str, int] = field(default_factory=dict)
    # Every signature the fault events tell of, peers' included: output files that show the
    # same tracebacks add nothing new.
    told_signatures: set[str] = field(default_factory=set)
    told_types: set[str] = field(default_factory=set)  # exception types told without a traceback


def _num(value: Any, default: float | None = None) -> float | None:
    if isinstance(value, bool):
        return default
    if isinstance(value, (int, float)):
        return float(value)
    return default


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _max_opt(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


class _Folder:
    """Folds the events of one file into a ``FileSummary``.

    Called once per event for millions of events, so values that rarely
    change within one file (host, node, rank, job) are only re-checked when
    they differ from the previous event's.
    """

    def __init__(self, summary: FileSummary) -> None:
        self.s = summary
        self.open_call: tuple[str | None, float] | None = None  # (boot, mono) of an unfinished call
        self.last_event: dict[str, Any] | None = None
        self.first_wall = float("inf")
        self.last_wall = float("-inf")
        self._raw: tuple[Any, Any, Any, Any] = (
            object(),
            object(),
            object(),
            object(),
        )  # host, node, rank, job
        self._ctx: tuple[str | None, int | None, int | None] = (
            None,
            None,
            None,
        )  # host, node, rank
        self._round: Any = object()
        self._part: RoundPart | None = None

    def round_part(self, event: dict[str, Any], wall: float | None) -> RoundPart | None:
        rnd = event.get("round")
        if rnd == self._round and type(rnd) is type(self._round):
            part = self._part
        else:
            key = _int(rnd)
            if key is None:
                return None
            part = self.s.rounds.get(key)
            if part is None:
                part = self.s.rounds[key] = RoundPart()
            self._round, self._part = rnd, part
        if part is not None and wall is not None:
            if part.first_wall is None or wall < part.first_wall:
                part.first_wall = wall
            if part.last_wall is None or wall > part.last_wall:
                part.last_wall = wall
        return part

    def _context(self, event: dict[str, Any]) -> tuple[str | None, int | None, int | None]:
        s = self.s
        raw = (event.get("host"), event.get("node"), event.get("rank"), event.get("job"))
        if event["kind"] in _HOST_SHADOWING_KINDS:
            # store_start's own "host" field (its bind address) shadows the writer's host name.
            raw = (None, *raw[1:])
        if raw == self._raw:
            return self._ctx
        self._raw = raw
        host, node, rank = _str(raw[0]), _int(raw[1]), _int(raw[2])
        if raw[3] is not None:
            s.jobs.add(str(raw[3]))
        if host is not None and s.host is None:
            s.host, s.boot = host, _str(event.get("boot"))
        if s.component is None:
            s.component = _str(event.get("component"))
        if s.pid is None:
            s.pid = _int(event.get("pid"))
        if rank is not None and event.get("component") in _RANK_COMPONENTS:
            s.ranks.add(rank)
        if node is not None and host is not None:
            s.node_hosts.setdefault(node, host)
        self._ctx = (host, node, rank)
        return self._ctx

    def add(self, event: dict[str, Any]) -> None:
        self.s.kept += 1
        wall = event.get("wall")
        if type(wall) is not float:
            wall = _num(wall)
        if wall is not None:
            if wall < self.first_wall:
                self.first_wall = wall
            if wall > self.last_wall:
                self.last_wall = wall
        host, node, rank = self._context(event)
        self.last_event = event
        handler = _HANDLERS.get(event["kind"])
        if handler is not None:
            handler(self, event, rank, node, host, wall)
        elif event.get("round") is not None:
            # Any event of a round (the app's progress, checkpoints) shows the round ran.
            self.round_part(event, wall)

    # -- wrapper ---------------------------------------------------------------
    def round_start(
        self,
        e: dict[str, Any],
        rank: int | None,
        node: int | None,
        host: str | None,
        wall: float | None,
    ) -> None:
        self.round_part(e, wall)
        self.s.ending_fault = None
        size = _int(e.get("world_size"))
        if size is not None and size > self.s.world_size:
            self.s.world_size = size
        # The restart latency of the previous round is known only when this one starts, so a
        # writer may put it here instead of on the previous round's round_end.
        latency = _num(e.get("restart_latency_s"))
        rnd = _int(e.get("round"))
        if latency is not None and rnd is not None and rnd > 0:
            prev = self.s.rounds.setdefault(rnd - 1, RoundPart())
            prev.restart_latency_s = _max_opt(prev.restart_latency_s, latency)

    def call_start(
        self,
        e: dict[str, Any],
        rank: int | None,
        node: int | None,
        host: str | None,
        wall: float | None,
    ) -> None:
        self.round_part(e, wall)
        self.s.calls += 1
        self.s.ending_fault = None
        mono = _num(e.get("mono"))
        self.open_call = (_str(e.get("boot")), mono) if mono is not None else None

    def call_end(
        self,
        e: dict[str, Any],
        rank: int | None,
        node: int | None,
        host: str | None,
        wall: float | None,
    ) -> None:
        self.round_part(e, wall)
        self.s.calls += 1
        duration = _num(e.get("duration_s"))
        if duration is None and self.open_call is not None:
            mono = _num(e.get("mono"))
            if mono is not None and self.open_call[0] == _str(e.get("boot")):
                duration = max(0.0, mono - self.open_call[1])
        if duration is not None and duration >= 0:
            self.s.call_us += round(duration * 1e6)
        self.open_call = None

    def fault(
        self,
        e: dict[str, Any],
        rank: int | None,
        node: int | None,
        host: str | None,
        wall: float | None,
    ) -> None:
        part = self.round_part(e, wall)
        kind = _str(e.get("fault_kind")) or "unknown"
        origin = _int(e.get("origin_rank"))
        self.s.ending_fault = "peer" if kind in CONSEQUENCE_FAULT_KINDS else "own"
        self.note_told(e)
        if kind in CONSEQUENCE_FAULT_KINDS:
            if part is not None:
                if rank is not None:
                    part.peer_ranks.add(rank)
                if origin is not None:
                    part.origin_votes[origin] = part.origin_votes.get(origin, 0) + 1
            return
        sig = fault_signature(
            _str(e.get("signature")),
            kind,
            _str(e.get("exc_type")),
            _str(e.get("message")),
            _str(e.get("traceback")),
        )
        detected = _num(e.get("detected_mono"))
        if part is not None:
            part.local_faults.append(
                LocalFault(
                    rank=rank,
                    node=node,
                    host=host,
                    boot=_str(e.get("boot")),
                    mono=detected if detected is not None else _num(e.get("mono")),
                    wall=wall,
                    fault_kind=kind,
                    signature=sig,
                    detection_s=_num(e.get("detection_s")),
                )
            )
            if origin is not None and origin != rank:
                part.origin_votes[origin] = part.origin_votes.get(origin, 0) + 1
        self.add_signature(sig, e, rank, node, host, wall)

    def note_told(self, e: dict[str, Any]) -> None:
        tb = _str(e.get("traceback"))
        if tb:
            self.s.told_signatures.update(chained_signatures(tb))
        elif e.get("exc_type") is not None:
            self.s.told_types.add(str(e["exc_type"]))

    def add_signature(
        self,
        sig: str,
        e: dict[str, Any],
        rank: int | None,
        node: int | None,
        host: str | None,
        wall: float | None,
    ) -> None:
        group = self.s.signatures.get(sig)
        if group is None:
            group = self.s.signatures[sig] = SignaturePart()
        group.count += 1
        if rank is not None:
            group.ranks.add(rank)
        if node is not None:
            group.nodes.add(node)
        if host is not None:
            group.hosts.add(host)
        rnd = _int(e.get("round"))
        if rnd is not None:
            group.rounds.add(rnd)
        if wall is not None and (group.first_wall is None or wall < group.first_wall):
            group.first_wall = wall
        if group.exc_type is None:
            group.exc_type = _str(e.get("exc_type"))
        if group.message is None:
            group.message = _str(e.get("message"))
        if group.traceback is None:
            group.traceback = _str(e.get("traceback"))

    def restart_phase(
        self,
        e: dict[str, Any],
        rank: int | None,
        node: int | None,
        host: str | None,
        wall: float | None,
    ) -> None:
        part = self.round_part(e, wall)
        phase = _str(e.get("phase"))
        if part is None or phase is None:
            return
        duration = _num(e.get("duration_s"))
        if duration is not None and duration > part.phases.get(phase, -1.0):
            part.phases[phase] = duration
        if e.get("ok") is False:
            part.failed_phases.add(phase)

    def ranks_terminated(
        self,
        e: dict[str, Any],
        rank: int | None,
        node: int | None,
        host: str | None,
        wall: float | None,
    ) -> None:
        part = self.round_part(e, wall)
        ranks = e.get("ranks")
        if part is not None and isinstance(ranks, list):
            part.ranks_terminated.update(r for r in ranks if isinstance(r, int))

    def hang(
        self,
        e: dict[str, Any],
        rank: int | None,
        node: int | None,
        host: str | None,
        wall: float | None,
    ) -> None:
        part = self.round_part(e, wall)
        if part is not None and rank is not None:
            part.hang_ranks.add(rank)
        self.s.hangs.append(
            {
                "rank": rank,
                "node": node,
                "host": host,
                "round": _int(e.get("round")),
                "wall": _num(e.get("wall")),
                "timeout": _str(e.get("timeout")),
                "stack": _str(e.get("stack")),
                "component": _str(e.get("component")),
            }
        )

    def round_end(
        self,
        e: dict[str, Any],
        rank: int | None,
        node: int | None,
        host: str | None,
        wall: float | None,
    ) -> None:
        part = self.round_part(e, wall)
        if part is None:
            return
        outcome = _str(e.get("outcome")) or "unknown"
        part.outcomes[outcome] = part.outcomes.get(outcome, 0) + 1
        latency = _num(e.get("restart_latency_s"))
        if latency is not None and (
            part.restart_latency_s is None or latency > part.restart_latency_s
        ):
            part.restart_latency_s = latency

    def wrapper_end(
        self,
        e: dict[str, Any],
        rank: int | None,
        node: int | None,
        host: str | None,
        wall: float | None,
    ) -> None:
        outcome = _str(e.get("outcome")) or "unknown"
        self.s.wrapper_ends[outcome] = self.s.wrapper_ends.get(outcome, 0) + 1

    # -- per-node processes ----------------------------------------------------
    def node_event(
        self,
        e: dict[str, Any],
        rank: int | None,
        node: int | None,
        host: str | None,
        wall: float | None,
    ) -> None:
        # Few per job; whether a child's exit was a failure or part of a stop
        # is decided once all of them are known (aggregate).
        kept = {k: e[k] for k in _NODE_EVENT_FIELDS if k in e}
        if host is None:
            kept.pop("host", None)
            if self.s.host is not None:
                kept["host"] = self.s.host
        self.s.node_events.append(kept)

    def finish(self) -> None:
        s = self.s
        if self.first_wall <= self.last_wall:
            s.first_wall, s.last_wall = self.first_wall, self.last_wall
        last = self.last_event
        if self.open_call is not None and last is not None:
            boot, start = self.open_call
            mono = _num(last.get("mono"))
            if mono is not None and boot == _str(last.get("boot")):
                # The process vanished inside the function (killed): count up to its last event.
                s.call_us += round(max(0.0, mono - start) * 1e6)
            s.interrupted_calls += 1


_HANDLERS = {
    "round_start": _Folder.round_start,
    "call_start": _Folder.call_start,
    "call_end": _Folder.call_end,
    "fault": _Folder.fault,
    "restart_phase": _Folder.restart_phase,
    "ranks_terminated": _Folder.ranks_terminated,
    "hang": _Folder.hang,
    "round_end": _Folder.round_end,
    "wrapper_end": _Folder.wrapper_end,
    **{kind: _Folder.node_event for kind in NODE_EVENT_KINDS},
}


def summarize_file(path: str | os.PathLike[str], filters: Filters | None = None) -> FileSummary:
    """Read one event file and fold it into a ``FileSummary`` (never raises on bad content)."""
    stats = ReadStats()
    summary = FileSummary(path=str(path), stats=stats)
    folder = _Folder(summary)
    keep = filters.keep if filters is not None and filters.active() else None
    for event in read_events(path, stats):
        if keep is not None and not keep(event):
            continue
        folder.add(event)
    folder.finish()
    return summary
