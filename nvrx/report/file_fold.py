"""One event file folded into a ``FileSummary``, one event at a time.

One file is one process, so a summary is cheap to build in a worker process
and cheap to send back. Called once per event for millions of events: values
that rarely change within one file (host, node, rank, job) are only re-checked
when they differ from the previous event's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nvrx.events.failures import (
    DEAD,
    FAULT_KINDS,
    HANG,
    PEER,
    UNRESPONSIVE,
    chained_signatures,
    fault_signature,
    kind_of,
)
from nvrx.events.reader import ReadStats

from .job_rounds import restart_cause
from .parts import LocalFault, RoundState, SignatureGroup
from .values import as_int, as_str, count, int_list, num, seconds, str_dict

#: Kinds of per-node events that mean "the job is being stopped on this host".
STOP_KINDS = ("job_stop", "supervisor_end")
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
        "node_lost",
        "node_takeover",
        "job_restart",
    }
)
#: Components whose events belong to one training rank.
_RANK_COMPONENTS = ("wrapper", "monitor", "app")
#: Kinds whose own fields reuse the name of a common field (schema quirk).
_HOST_SHADOWING_KINDS = frozenset({"store_start"})
#: Common fields of per-node events kept as read (the reader checked them).
_NODE_COMMON_FIELDS = ("kind", "wall", "mono", "boot", "host", "node", "rank", "round", "component")
#: Their own fields kept, each made the type the report expects (None when unusable).
_NODE_OWN_FIELDS: dict[str, Callable[[Any], Any]] = {
    **dict.fromkeys(("local_rank", "child_pid", "attempt", "exit_code", "budget_left"), count),
    **dict.fromkeys(("count", "nnodes", "nproc_per_node", "global_rank", "spare_nodes"), count),
    **dict.fromkeys(("lost_node", "lost_slot", "seen_by", "replaced_by", "node_rank"), count),
    **dict.fromkeys(("runtime_s", "wait_s", "silent_s"), seconds),
    **dict.fromkeys(("signal", "decision", "reason", "signature", "action", "cause"), as_str),
    **dict.fromkeys(("lost_host", "files", "error_file", "phase", "scope"), as_str),
    "epoch": count,
    "last_seen_wall": num,
    "slurm_state": str_dict,
    "ranks": int_list,
}

Ev = dict[str, Any]
OInt = int | None
OStr = str | None
OFloat = float | None


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
    # The last fault of a process that never resumed after it (PEER or "own"): it explains
    # the process's exit, which its supervisor records by pid.
    ending_fault: str | None = None
    interrupted_calls: int = 0
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


class FileFolder:
    """Folds the events of one file into a ``FileSummary``: ``add`` each, then ``finish``."""

    def __init__(self, summary: FileSummary) -> None:
        self.s = summary
        self.open_call: tuple[str | None, float] | None = None  # (boot, mono) of an unfinished call
        self.last_event: Ev | None = None
        self.first_wall = float("inf")
        self.last_wall = float("-inf")
        self._raw: tuple[Any, ...] = (object(),) * 4  # host, node, rank, job of the last event
        self._ctx: tuple[OStr, OInt, OInt] = (None, None, None)  # host, node, rank
        self._round: Any = object()
        self._part: RoundState | None = None

    def round_part(self, event: Ev, wall: OFloat) -> RoundState | None:
        rnd = event.get("round")
        if rnd == self._round and type(rnd) is type(self._round):
            part = self._part
        else:
            key = as_int(rnd)
            if key is None:
                return None
            part = self.s.rounds.get(key)
            if part is None:
                part = self.s.rounds[key] = RoundState()
            self._round, self._part = rnd, part
        if part is not None and wall is not None:  # inline: once per event
            if part.first_wall is None or wall < part.first_wall:
                part.first_wall = wall
            if part.last_wall is None or wall > part.last_wall:
                part.last_wall = wall
        return part

    def _context(self, event: Ev) -> tuple[OStr, OInt, OInt]:
        s = self.s
        raw = (event.get("host"), event.get("node"), event.get("rank"), event.get("job"))
        if event["kind"] in _HOST_SHADOWING_KINDS:
            # store_start's own "host" field (its bind address) shadows the writer's host name.
            raw = (None, *raw[1:])
        if raw == self._raw:
            return self._ctx
        self._raw = raw
        host, node, rank = as_str(raw[0]), as_int(raw[1]), as_int(raw[2])
        if raw[3] is not None:
            s.jobs.add(str(raw[3]))
        if host is not None and s.host is None:
            s.host, s.boot = host, as_str(event.get("boot"))
        if s.component is None:
            s.component = as_str(event.get("component"))
        if s.pid is None:
            s.pid = as_int(event.get("pid"))
        if rank is not None and event.get("component") in _RANK_COMPONENTS:
            s.ranks.add(rank)
        if node is not None and host is not None:
            s.node_hosts.setdefault(node, host)
        self._ctx = (host, node, rank)
        return self._ctx

    def add(self, event: Ev) -> None:
        self.s.kept += 1
        wall = event.get("wall")
        if type(wall) is not float:
            wall = num(wall)
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
    def round_start(self, e: Ev, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        part = self.round_part(e, wall)
        self.s.ending_fault = None
        size = count(e.get("world_size"))
        if size is not None and size > self.s.world_size:
            self.s.world_size = size
        if part is not None:  # when, and at what size, the round began (node-loss recovery)
            if wall is not None and (part.started_wall is None or wall < part.started_wall):
                part.started_wall = wall
            if size is not None and (part.world_size is None or size > part.world_size):
                part.world_size = size
        # The restart latency of the previous round is known only when this one starts, so a
        # writer may put it here instead of on the previous round's round_end.
        latency = seconds(e.get("restart_latency_s"))
        rnd = as_int(e.get("round"))
        if latency is not None and rnd is not None and rnd > 0:
            previous = RoundState(restart_latency_s=latency)
            self.s.rounds.setdefault(rnd - 1, RoundState()).merge(previous)

    def call_start(self, e: Ev, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        self.round_part(e, wall)
        self.s.calls += 1
        self.s.ending_fault = None
        mono = num(e.get("mono"))
        self.open_call = (as_str(e.get("boot")), mono) if mono is not None else None

    def call_end(self, e: Ev, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        self.round_part(e, wall)
        self.s.calls += 1
        duration = seconds(e.get("duration_s"))
        if duration is None and self.open_call is not None:
            mono = num(e.get("mono"))
            if mono is not None and self.open_call[0] == as_str(e.get("boot")):
                duration = max(0.0, mono - self.open_call[1])
        if duration is not None and duration >= 0:
            self.s.call_us += round(duration * 1e6)
        self.open_call = None

    def fault(self, e: Ev, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        part = self.round_part(e, wall)
        told_kind = as_str(e.get("fault_kind"))
        kind = told_kind or "unknown"
        origin = as_int(e.get("origin_rank"))
        peer = FAULT_KINDS.get(kind) == PEER  # a consequence of another rank's fault
        self.s.ending_fault = PEER if peer else "own"
        self.note_told(e)
        if peer:
            if part is not None:
                if rank is not None:
                    part.peer_ranks.add(rank)
                if origin is not None:
                    part.vote(origin)
            return
        exc_type, message, tb = (as_str(e.get(k)) for k in ("exc_type", "message", "traceback"))
        sig = fault_signature(as_str(e.get("signature")), told_kind, exc_type, message, tb)
        detected = num(e.get("detected_mono"))
        mono = detected if detected is not None else num(e.get("mono"))
        rnd, pid = as_int(e.get("round")), as_int(e.get("pid"))
        fault = LocalFault(
            rank, node, host, as_str(e.get("boot")), mono, wall, kind, sig,
            seconds(e.get("detection_s")), rnd, pid,
        )  # fmt: skip
        sig_kind = kind_of(sig)
        if sig_kind in (DEAD, UNRESPONSIVE):
            self.s.monitor_deaths.append(fault)
        if part is not None:
            part.add_fault(fault)
            if sig_kind == HANG:
                part.hang_faults.add(rank)
            if origin is not None and origin != rank:
                part.vote(origin)
        group = self.s.signatures.get(sig)
        if group is None:
            group = self.s.signatures[sig] = SignatureGroup()
        group.add(
            rank, node, host, rnd, wall, pid, exc_type=exc_type, message=message, traceback=tb
        )

    def note_told(self, e: Ev) -> None:
        tb, exc_type = as_str(e.get("traceback")), as_str(e.get("exc_type"))
        if tb:
            self.s.told_signatures.update(chained_signatures(tb))
        elif exc_type is not None:
            self.s.told_types.add(exc_type)

    def restart_phase(self, e: Ev, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        part = self.round_part(e, wall)
        phase = as_str(e.get("phase"))
        if part is None or phase is None:
            return
        duration = seconds(e.get("duration_s"))
        if duration is not None and duration > part.phases.get(phase, -1.0):
            part.phases[phase] = duration
        if e.get("ok") is False:
            part.failed_phases.add(phase)

    def ranks_terminated(self, e: Ev, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        part = self.round_part(e, wall)
        ranks = e.get("ranks")
        if part is not None and isinstance(ranks, list):
            part.terminated.update(r for r in map(as_int, ranks) if r is not None)

    def hang(self, e: Ev, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        child = as_int(e.get("child_pid"))
        if child is not None and wall is not None:  # a supervisor's (nvrx.fault_tolerance)
            self.s.hung_children.append((child, wall))
        part = self.round_part(e, wall)
        if part is not None and rank is not None:
            part.hang_ranks.add(rank)
        self.s.hangs.append(
            {
                "rank": rank,
                "node": node,
                "host": host,
                "round": as_int(e.get("round")),
                "wall": wall,
                "timeout": as_str(e.get("timeout")),
                "stack": as_str(e.get("stack")),
            }
        )

    def round_end(self, e: Ev, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        part = self.round_part(e, wall)
        if part is None:
            return
        outcome = as_str(e.get("outcome")) or "unknown"
        part.merge(
            RoundState(
                outcomes={outcome: 1},
                restart_latency_s=seconds(e.get("restart_latency_s")),
                restarted_ranks={rank} if outcome == "restart" and rank is not None else set(),
            )
        )

    def wrapper_end(self, e: Ev, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        outcome = as_str(e.get("outcome")) or "unknown"
        self.s.wrapper_ends[outcome] = self.s.wrapper_ends.get(outcome, 0) + 1

    # -- per-node processes ----------------------------------------------------
    def node_event(self, e: Ev, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        # Few per job; whether a child's exit was a failure or part of a stop
        # is decided once all of them are known (aggregate).
        kept = {k: e[k] for k in _NODE_COMMON_FIELDS if k in e}
        kept.update((k, make(e[k])) for k, make in _NODE_OWN_FIELDS.items() if k in e)
        if host is None:
            kept.pop("host", None)
            if self.s.host is not None:
                kept["host"] = self.s.host
        if e.get("kind") == "job_restart":  # its cause is the announced failure, not a word
            kept["cause"] = restart_cause(e.get("cause"))
        self.s.node_events.append(kept)

    def finish(self) -> None:
        s = self.s
        if self.first_wall <= self.last_wall:
            s.first_wall, s.last_wall = self.first_wall, self.last_wall
        last = self.last_event
        if self.open_call is not None and last is not None:
            boot, start = self.open_call
            mono = num(last.get("mono"))
            if mono is not None and boot == as_str(last.get("boot")):
                # The process vanished inside the function (killed): count up to its last event.
                s.call_us += round(max(0.0, mono - start) * 1e6)
            s.interrupted_calls += 1
            s.vanished = s.ending_fault is None


_HANDLERS = {
    "round_start": FileFolder.round_start,
    "call_start": FileFolder.call_start,
    "call_end": FileFolder.call_end,
    "fault": FileFolder.fault,
    "restart_phase": FileFolder.restart_phase,
    "ranks_terminated": FileFolder.ranks_terminated,
    "hang": FileFolder.hang,
    "round_end": FileFolder.round_end,
    "wrapper_end": FileFolder.wrapper_end,
    **{kind: FileFolder.node_event for kind in NODE_EVENT_KINDS},
}
