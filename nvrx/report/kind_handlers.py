"""What each kind of event changes in a file's summary: the handlers ``file_fold`` calls.

Each handler gets the event, the state of the round it is filed under (None:
no round), and its writer's rank, node, host and wall time, which the fold
keeps for every event. A kind's own fields are read defensively (``values``):
the reader checked only the common ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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

from .consequence import fault_shape
from .file_summary import Ev, FileSummary
from .merging import max_opt, min_opt
from .node_events import NODE_EVENT_KINDS, kept_node_event
from .parts import LocalFault, RoundState, SignatureGroup
from .values import MAX_COUNT, MAX_SECONDS, as_int, as_str, count, num, seconds

OInt = int | None
OStr = str | None
OFloat = float | None
Part = RoundState | None
_UNSEEN = object()


def _seconds(value: Any) -> float | None:
    """``values.seconds``, with the common case (a float in range) decided inline."""
    if type(value) is float and 0.0 <= value <= MAX_SECONDS:
        return value
    return seconds(value)


def phase_ended(part: RoundState, phase: Any, duration: Any, ok: Any) -> None:
    """A ``restart_phase`` event's fields noted in its round's state (half the events of a big
    job: ``FileFolder.fold_records`` calls this straight)."""
    if type(phase) is not str:
        phase = as_str(phase)
        if phase is None:
            return
    duration = _seconds(duration)
    if duration is not None and duration > part.phases.get(phase, -1.0):
        part.phases[phase] = duration
    if ok is False:
        part.failed_phases.add(phase)


class KindHandlers:
    """The per-kind part of folding one file's events into summary ``s``; ``FileFolder``,
    which reads the events and calls these, explains the arguments."""

    def __init__(
        self,
        summary: FileSummary,
        run_starts: bool = False,
        job_rounds: dict[Any, RoundState] | None = None,
    ) -> None:
        self.s = summary
        self.run_starts = run_starts
        # Where round states are filed: the summary's own (by round), or a job's rounds of run 0
        # (by (0, round)) when every file belongs to that run, which spares merging them.
        self.rounds: dict[Any, RoundState] = summary.rounds if job_rounds is None else job_rounds
        self.run = None if job_rounds is None else 0
        # Per round state, this file's first fault of each rank (added when the file is done,
        # as the file's own round state would be merged).
        self.first_faults: dict[int, tuple[RoundState, RoundState]] = {}
        self.open_call: tuple[str | None, float] | None = None  # (boot, mono) of an unfinished call
        self.open_wall: float | None = None  # wall of an unfinished call's call_start
        # The fold's state between two calls (``FileFolder.fold``): the file's walls, its last
        # event, the (host, node, rank, job) of the last event and its context, the round of
        # the last event filed under one and its state.
        self.first_wall, self.last_wall = math.inf, -math.inf
        self.last_event: Ev | None = None
        self._raw: tuple[Any, ...] = (_UNSEEN,) * 4
        self._ctx: tuple[OStr, OInt, OInt] = (None, None, None)
        self._round: Any = _UNSEEN
        self._part: RoundState | None = None

    def round_of(self, rnd: Any) -> RoundState | None:
        """The state of round ``rnd``, made at its first event; None for an event of no round."""
        key: Any = as_int(rnd)
        if key is None:
            return None
        if self.run is not None:
            key = (self.run, key)
        part = self.rounds.get(key)
        if part is None:
            part = self.rounds[key] = RoundState()
        return part

    # -- wrapper ---------------------------------------------------------------
    def round_start(self, e: Ev, part: Part, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        s = self.s
        s.ending_fault = None
        size = e.get("world_size")
        if type(size) is not int or not -MAX_COUNT <= size <= MAX_COUNT:  # (count, inline)
            size = count(size)
        if size is not None and size > s.world_size:
            s.world_size = size
        if part is not None:  # when, and at what size, the round began (node-loss recovery)
            part.started_wall = min_opt(part.started_wall, wall)
            part.world_size = max_opt(part.world_size, size)
        # The restart latency of the previous round is known only when this one starts, so a
        # writer may put it here instead of on the previous round's round_end.
        latency = _seconds(e.get("restart_latency_s"))
        rnd = e.get("round")
        if latency is not None and type(rnd) is int and rnd > 0:  # (the reader checked it)
            previous = self.round_of(rnd - 1)
            assert previous is not None
            previous.restart_latency_s = max_opt(previous.restart_latency_s, latency)

    def call_start(self, e: Ev, part: Part, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        self.s.calls += 1
        self.s.ending_fault = None
        mono = num(e.get("mono"))
        self.open_call = (as_str(e.get("boot")), mono) if mono is not None else None
        self.open_wall = wall

    def call_end(self, e: Ev, part: Part, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        self.s.calls += 1
        duration = _seconds(e.get("duration_s"))
        if duration is None and self.open_call is not None:
            mono = num(e.get("mono"))
            if mono is not None and self.open_call[0] == as_str(e.get("boot")):
                duration = max(0.0, mono - self.open_call[1])
        if duration is not None and duration >= 0:
            self.s.call_us += round(duration * 1e6)
        self.open_call = self.open_wall = None

    def fault(self, e: Ev, part: Part, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        told_kind = e.get("fault_kind")
        if type(told_kind) is not str:
            told_kind = as_str(told_kind)
        kind = told_kind or "unknown"
        origin = e.get("origin_rank")
        if type(origin) is not int:
            origin = as_int(origin)
        peer = FAULT_KINDS.get(kind) == PEER  # a consequence of another rank's fault
        self.s.ending_fault = PEER if peer else "own"
        self.note_told(e)
        if peer:
            if part is not None:
                if rank is not None:
                    part.peer_ranks.add(rank)
                if origin is not None:
                    votes = part.origin_votes  # (vote, inline: once per peer of a fault)
                    votes[origin] = votes.get(origin, 0) + 1
            return
        rank_host, rank_node = as_str(e.get("rank_host")), e.get("rank_node")
        if rank_host is not None:  # another host's agent wrote it: the fault is of that host
            host, node = rank_host, as_int(rank_node)
        elif rank_node is not None:  # a spare's supervisor: the node rank it holds, not its slot
            node = as_int(rank_node)
        exc_type, message, tb = (as_str(e.get(k)) for k in ("exc_type", "message", "traceback"))
        sig = fault_signature(as_str(e.get("signature")), told_kind, exc_type, message, tb)
        detected = num(e.get("detected_mono"))
        mono = detected if detected is not None else num(e.get("mono"))
        rnd, pid = as_int(e.get("round")), as_int(e.get("pid"))
        shape = fault_shape(exc_type, message, sig)
        fault = LocalFault(
            rank, node, host, as_str(e.get("boot")), mono, wall, kind, sig,
            seconds(e.get("detection_s")), rnd, pid, shape,
        )  # fmt: skip
        sig_kind = kind_of(sig)
        if sig_kind in (DEAD, UNRESPONSIVE):
            self.s.monitor_deaths.append(fault)
        child = as_int(e.get("child_pid"))
        if child is not None and wall is not None and sig_kind == UNRESPONSIVE:
            self.s.hung_children.append((child, wall))  # a supervisor's: it kills the child
        if part is not None:
            firsts = self.first_faults.get(id(part))
            if firsts is None:
                firsts = self.first_faults[id(part)] = (part, RoundState())
            firsts[1].add_fault(fault)
            if sig_kind == HANG:
                part.hang_faults.add(rank)
            if origin is not None and origin != rank:
                part.vote(origin)
        group = self.s.signatures.get(sig)
        if group is None:
            group = self.s.signatures[sig] = SignatureGroup()
        group.add(
            rank, node, host, rnd, wall, pid,
            exc_type=exc_type, message=message, traceback=tb, shape=shape,
            detection_s=fault.detection_s,
        )  # fmt: skip

    def checkpoint(self, e: Ev, part: Part, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        action = e.get("action")
        if wall is not None and action == "save":
            self.s.state_saves.append(wall)
        if action == "load" and part is not None:  # a restore, past the first round (``restores``)
            part.loaded_ranks.add(rank)
            part.loaded_step = min_opt(part.loaded_step, count(e.get("step")))
            part.restored_wall = min_opt(part.restored_wall, wall)

    def state_restored(self, e: Ev, part: Part, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        if part is None:
            return
        source = as_str(e.get("source")) or "unknown"
        part.restored_by.setdefault(source, set()).add(rank)
        if source != "none":
            part.restored_step = min_opt(part.restored_step, count(e.get("step")))
        part.kept_newest = max_opt(part.kept_newest, count(e.get("newest_step")))
        committed = num(e.get("committed_wall"))
        if committed is not None:  # the state of that moment survived the fault: a save
            self.s.state_saves.append(committed)
        part.restored_wall = min_opt(part.restored_wall, wall)

    def progress(self, e: Ev, part: Part, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        step = e.get("step")
        if type(step) is not int or not -MAX_COUNT <= step <= MAX_COUNT:  # (count, inline)
            step = count(step)
        if part is not None and step is not None and (
            part.progress_step is None or step > part.progress_step
        ):
            part.progress_step = step

    def note_told(self, e: Ev) -> None:
        tb, exc_type = e.get("traceback"), e.get("exc_type")
        if tb is not None and type(tb) is not str:
            tb = as_str(tb)
        if exc_type is not None and type(exc_type) is not str:
            exc_type = as_str(exc_type)
        if tb:
            self.s.told_signatures.update(chained_signatures(tb))
        elif exc_type is not None:
            self.s.told_types.add(exc_type)

    def restart_phase(self, e: Ev, part: Part, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        if part is not None:
            phase_ended(part, e.get("phase"), e.get("duration_s"), e.get("ok"))

    def ranks_terminated(self, e: Ev, part: Part, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        ranks = e.get("ranks")
        if part is not None and isinstance(ranks, list):
            part.terminated.update(r for r in map(as_int, ranks) if r is not None)

    def hang(self, e: Ev, part: Part, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        child = as_int(e.get("child_pid"))
        if child is not None and wall is not None:  # a supervisor's (nvrx.fault_tolerance)
            self.s.hung_children.append((child, wall))
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
                "stale_s": seconds(e.get("stale_s")),
            }
        )

    def round_end(self, e: Ev, part: Part, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        if part is None:
            return
        outcome = e.get("outcome")
        if type(outcome) is not str:
            outcome = as_str(outcome)
        outcome = outcome or "unknown"
        part.outcomes[outcome] = part.outcomes.get(outcome, 0) + 1
        part.restart_latency_s = max_opt(part.restart_latency_s, _seconds(e.get("restart_latency_s")))
        if outcome == "restart" and rank is not None:
            part.restarted_ranks.add(rank)

    def wrapper_end(self, e: Ev, part: Part, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        outcome = as_str(e.get("outcome")) or "unknown"
        self.s.wrapper_ends[outcome] = self.s.wrapper_ends.get(outcome, 0) + 1

    # -- per-node processes ----------------------------------------------------
    def node_event(self, e: Ev, part: Part, rank: OInt, node: OInt, host: OStr, wall: OFloat) -> None:
        self.s.node_events.append(kept_node_event(e, host, self.s.host))

    def supervisor_start(
        self, e: Ev, part: Part, rank: OInt, node: OInt, host: OStr, wall: OFloat
    ) -> None:
        if self.run_starts:
            self.s.note_start(e)
        self.node_event(e, part, rank, node, host, wall)

    def add_first_faults(self) -> None:
        """File this file's first fault of each rank under its rounds (once, when done)."""
        for part, firsts in self.first_faults.values():
            for fault in firsts.first_by_rank.values():
                part.add_fault(fault)


Handler = Callable[[KindHandlers, Ev, Part, OInt, OInt, OStr, OFloat], None]
#: Per kind: its handler, and whether its events are filed under their round first.
DISPATCH: dict[str, tuple[Handler, bool]] = {
    "round_start": (KindHandlers.round_start, True),
    "call_start": (KindHandlers.call_start, True),
    "call_end": (KindHandlers.call_end, True),
    "fault": (KindHandlers.fault, True),
    "restart_phase": (KindHandlers.restart_phase, True),
    "ranks_terminated": (KindHandlers.ranks_terminated, True),
    "hang": (KindHandlers.hang, True),
    "round_end": (KindHandlers.round_end, True),
    "wrapper_end": (KindHandlers.wrapper_end, False),
    **{kind: (KindHandlers.node_event, False) for kind in NODE_EVENT_KINDS},
    "supervisor_start": (KindHandlers.supervisor_start, False),
    "checkpoint": (KindHandlers.checkpoint, True),
    "state_restored": (KindHandlers.state_restored, True),
    "progress": (KindHandlers.progress, True),
}
UNHANDLED: tuple[Handler | None, bool] = (None, True)
#: Declared kinds the report does not summarize, each with the reason. Their events still
#: count as activity of the round they are filed under. Every kind of ``schema.KINDS`` is
#: in ``DISPATCH`` or here, never both.
NOT_SUMMARIZED: dict[str, str] = {
    "process_start": "a process's start is its file's first event; child_start tells more",
    "process_end": "a process's end is its file's last event; child_exit tells how a child ended",
    "rank_change": "round_start carries each rank's active rank and the round's world size",
    "restarter_state": "the nested-restarter protocol for an outer restarter; rounds and "
    "faults tell the same story",
    "standby_start": "warm standby bookkeeping; child_start's warm tells whether one became a child",
    "standby_ready": "warm standby bookkeeping; child_start's warm tells whether one became a child",
    "timeouts_set": "the timeouts in force; a hang names the timeout that passed and its limit",
    "workload_control": "what a request changes is a job stop, whose reason names the rank and "
    "its request (job_stop); Continue changes nothing",
    "non_retryable": "the job stop it causes names the rank, the line and the pattern (job_stop)",
}
