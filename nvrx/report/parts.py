"""The mergeable parts of a summary: one restart round, one failure signature.

A file's fold builds them event by event; the job's summary merges the parts
of all files with the same ``merge``, so a round seen by one rank and a round
seen by all of them are one type with one way of combining.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .merging import (
    COUNTS,
    EXTEND,
    MAX,
    MAX_EACH,
    MIN,
    SUM,
    UNION,
    UNION_EACH,
    merge_fields,
    merged,
)


@dataclass
class LocalFault:
    """A fault that started on its own rank (not a ``peer`` notification)."""

    rank: int | None
    node: int | None
    host: str | None
    boot: str | None
    mono: float | None
    wall: float | None
    fault_kind: str
    signature: str
    detection_s: float | None
    round: int | None = None
    pid: int | None = None
    shape: str | None = None  # ``consequence.fault_shape``: follow-on, hardware or none

    @property
    def onset(self) -> float | None:
        """When it began: its time less the time it took to detect it (a hang's timeout)."""
        return None if self.wall is None else self.wall - (self.detection_s or 0.0)


#: One occurrence of a signature: wall (detected), rank, node, host, round, shape (of
#: ``consequence``), its onset (the wall minus its detection time: a hang began a timeout
#: before it was seen), and the job run the report files it under (None until a job
#: summary files its file's events: ``JobSummary.part_of``).
Seen = tuple[
    float | None, int | None, int | None, str | None, int | None, str | None, float | None, int | None
]

#: Who an occurrence was: (wall, host, pid), unknowns last. Ties of time are broken by it, so
#: that the order in which files are merged never changes which occurrence counts as first.
Who = tuple[float, str, int]


def who(wall: float | None, host: str | None, pid: int | None) -> Who:
    return (wall if wall is not None else math.inf, host or "", pid if pid is not None else -1)


def order_key(f: LocalFault) -> tuple[Who, int, float, str, str]:
    """A total order of faults: by (wall, host, pid), then what else tells them apart."""
    rank = f.rank if f.rank is not None else -1
    mono = f.mono if f.mono is not None else math.inf
    return who(f.wall, f.host, f.pid), rank, mono, f.signature, f.fault_kind


def earlier(a: LocalFault, b: LocalFault) -> bool:
    """Whether ``a`` happened before ``b``: monotonic within one boot, else by wall clock;
    a tie goes to the lower (wall, host, pid)."""
    if a.boot is not None and a.boot == b.boot and a.mono is not None and b.mono is not None:
        if a.mono != b.mono:
            return a.mono < b.mono
    return order_key(a) < order_key(b)


@dataclass
class RoundState:
    """What is known of one restart round: from one process, or merged over many."""

    first_wall: float | None = merged(MIN)
    last_wall: float | None = merged(MAX)
    outcomes: dict[str, int] = merged(COUNTS)
    phases: dict[str, float] = merged(MAX_EACH)  # phase -> longest duration seen
    failed_phases: set[str] = merged(UNION)
    restart_latency_s: float | None = merged(MAX)
    started_wall: float | None = merged(MIN)  # the round's first round_start
    world_size: int | None = merged(MAX)  # as its round_start events say
    # Each rank's earliest fault; merged by ``add_fault``.
    first_by_rank: dict[int | None, LocalFault] = field(default_factory=dict)
    origin_votes: dict[int, int] = merged(COUNTS)
    peer_ranks: set[int] = merged(UNION)
    # Ranks whose round ended in a restart: a peer told of the restart between two
    # steps of its function writes no fault of its own, yet stopped for a peer.
    restarted_ranks: set[int] = merged(UNION)
    hang_ranks: set[int] = merged(UNION)
    # Ranks with a hang fault of this round (any, not only their first): their hang events
    # tell the same hang.
    hang_faults: set[int | None] = merged(UNION)
    terminated: set[int] = merged(UNION)
    # What the round restored and how far training had come (``restores``): the ranks of its
    # ``state_restored`` events by source, the step they restored (memory, peer, checkpoint)
    # and the newest step any rank had kept; the ranks and step of its checkpoint loads; its
    # first restore event; the newest step of its ``progress`` events.
    restored_by: dict[str, set[int | None]] = merged(UNION_EACH)
    restored_step: int | None = merged(MIN)
    kept_newest: int | None = merged(MAX)
    loaded_ranks: set[int | None] = merged(UNION)
    loaded_step: int | None = merged(MIN)
    restored_wall: float | None = merged(MIN)
    progress_step: int | None = merged(MAX)

    def add_fault(self, fault: LocalFault) -> None:
        seen = self.first_by_rank.get(fault.rank)
        if seen is None or earlier(fault, seen):
            self.first_by_rank[fault.rank] = fault

    def vote(self, origin: int) -> None:
        self.origin_votes[origin] = self.origin_votes.get(origin, 0) + 1

    def voted_origin(self) -> int | None:
        """The rank most ``peer`` faults name as the origin (lowest rank on a tie)."""
        if not self.origin_votes:
            return None
        return max(self.origin_votes.items(), key=lambda kv: (kv[1], -kv[0]))[0]

    def merge(self, other: RoundState) -> None:
        merge_fields(self, other)
        for fault in other.first_by_rank.values():
            self.add_fault(fault)


@dataclass
class SignatureGroup:
    """Occurrences of one failure signature; each detail (exception type, message,
    traceback) from the earliest occurrence (by ``who``) that has it."""

    count: int = merged(SUM)
    ranks: set[int] = merged(UNION)
    nodes: set[int] = merged(UNION)
    hosts: set[str] = merged(UNION)
    rounds: set[int] = merged(UNION)
    first_wall: float | None = merged(MIN)
    # Each occurrence, so that those a lost node explains can be taken out (``node_loss``).
    seen: list[Seen] = merged(EXTEND)
    # detail -> (who, value); merged by ``merge``.
    details: dict[str, tuple[Who, str]] = field(default_factory=dict)

    def add(
        self,
        rank: int | None,
        node: int | None,
        host: str | None,
        rnd: int | None,
        wall: float | None,
        pid: int | None = None,
        *,
        exc_type: str | None = None,
        message: str | None = None,
        traceback: str | None = None,
        shape: str | None = None,
        detection_s: float | None = None,
    ) -> None:
        """One more occurrence, and its details."""
        self.count += 1
        onset = wall - detection_s if wall is not None and detection_s else wall
        self.seen.append((wall, rank, node, host, rnd, shape, onset, None))
        for target, value in ((self.ranks, rank), (self.nodes, node), (self.rounds, rnd)):
            if value is not None:
                target.add(value)
        if host is not None:
            self.hosts.add(host)
        if wall is not None and (self.first_wall is None or wall < self.first_wall):
            self.first_wall = wall
        at = who(wall, host, pid)
        for name, value in (("exc_type", exc_type), ("message", message), ("traceback", traceback)):
            if value:
                self._keep(name, (at, value))

    def _keep(self, name: str, candidate: tuple[Who, str]) -> None:
        seen = self.details.get(name)
        if seen is None or candidate < seen:
            self.details[name] = candidate

    @property
    def exc_type(self) -> str | None:
        return self.details["exc_type"][1] if "exc_type" in self.details else None

    @property
    def message(self) -> str | None:
        return self.details["message"][1] if "message" in self.details else None

    @property
    def traceback(self) -> str | None:
        return self.details["traceback"][1] if "traceback" in self.details else None

    def merge(self, other: SignatureGroup) -> None:
        merge_fields(self, other)
        for name, candidate in other.details.items():
            self._keep(name, candidate)
