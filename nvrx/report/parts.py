"""The mergeable parts of a summary: one restart round, one failure signature.

A file's fold builds them event by event; the job's summary merges the parts
of all files with the same ``merge``, so a round seen by one rank and a round
seen by all of them are one type with one way of combining.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .merging import (
    COUNTS,
    KEEP,
    MAX,
    MAX_EACH,
    MIN,
    SUM,
    UNION,
    merge_fields,
    merged,
)

log = logging.getLogger(__name__)


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


def earlier(a: LocalFault, b: LocalFault) -> bool:
    """Whether ``a`` happened before ``b``; monotonic within one boot, else wall clock."""
    if a.boot is not None and a.boot == b.boot and a.mono is not None and b.mono is not None:
        return a.mono < b.mono
    if a.wall is not None and b.wall is not None:
        return a.wall < b.wall
    return a.wall is not None


@dataclass
class RoundState:
    """What is known of one restart round: from one process, or merged over many."""

    first_wall: float | None = merged(MIN)
    last_wall: float | None = merged(MAX)
    outcomes: dict[str, int] = merged(COUNTS)
    phases: dict[str, float] = merged(MAX_EACH)  # phase -> longest duration seen
    failed_phases: set[str] = merged(UNION)
    restart_latency_s: float | None = merged(MAX)
    # Each rank's earliest fault; merged by ``add_fault``.
    first_by_rank: dict[int | None, LocalFault] = field(default_factory=dict)
    origin_votes: dict[int, int] = merged(COUNTS)
    peer_ranks: set[int] = merged(UNION)
    # Ranks whose round ended in a restart: a peer told of the restart between two
    # steps of its function writes no fault of its own, yet stopped for a peer.
    restarted_ranks: set[int] = merged(UNION)
    hang_ranks: set[int] = merged(UNION)
    terminated: set[int] = merged(UNION)

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
    """Occurrences of one failure signature, and the details of the earliest one."""

    count: int = merged(SUM)
    ranks: set[int] = merged(UNION)
    nodes: set[int] = merged(UNION)
    hosts: set[str] = merged(UNION)
    rounds: set[int] = merged(UNION)
    first_wall: float | None = merged(KEEP)
    exc_type: str | None = merged(KEEP)
    message: str | None = merged(KEEP)
    traceback: str | None = merged(KEEP)

    def add(
        self,
        rank: int | None,
        node: int | None,
        host: str | None,
        rnd: int | None,
        wall: float | None,
    ) -> None:
        """One more occurrence."""
        self.count += 1
        for target, value in ((self.ranks, rank), (self.nodes, node), (self.rounds, rnd)):
            if value is not None:
                target.add(value)
        if host is not None:
            self.hosts.add(host)
        if wall is not None and (self.first_wall is None or wall < self.first_wall):
            self.first_wall = wall

    def describe(self, exc_type: str | None, message: str | None, traceback: str | None) -> None:
        """Details of an occurrence, kept where none are known yet."""
        self.exc_type = self.exc_type or exc_type
        self.message = self.message or message
        self.traceback = self.traceback or traceback

    def merge(self, other: SignatureGroup) -> None:
        merge_fields(self, other)
        if other.first_wall is not None and (
            self.first_wall is None or other.first_wall < self.first_wall
        ):
            # The earliest occurrence's details win.
            self.first_wall = other.first_wall
            self.exc_type = other.exc_type or self.exc_type
            self.message = other.message or self.message
            self.traceback = other.traceback or self.traceback
        else:
            self.describe(other.exc_type, other.message, other.traceback)
