"""Suspect nodes: node-level incidents per host, and the hosts to exclude next time.

A host is suspect when one of its failure signatures was seen on that host and
no other (and the job ran on several hosts): a signature seen on several hosts
points at the code, not at a node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nvrx.events.failures import (
    DEAD,
    FAULT_KINDS,
    HANG,
    UNRESPONSIVE,
    hang_signature,
    process_end_signature,
)

from .compact import exclude_list
from .model import Failure, ProcessRestart, RoundRow, SuspectNode
from .timeline import death_window

if TYPE_CHECKING:
    from .aggregate import JobSummary


@dataclass
class _HostTally:
    node: int | None
    first: int = 0
    hangs: int = 0
    deaths: int = 0
    sigs: set[str] = field(default_factory=set)
    incidents: set[tuple[object, ...]] = field(default_factory=set)


class _Tallies(dict[str, _HostTally]):
    def of(self, host: str, node: int | None) -> _HostTally:
        tally = self.setdefault(host, _HostTally(node))
        if tally.node is None:
            tally.node = node
        return tally


def _incident_kind(row: RoundRow) -> str:
    """What else tells of the round's first failure: a hang report ("hang"), a process's end
    ("process_exit"), whether the round was explained by it or a monitor's fault said it."""
    kind = FAULT_KINDS.get(row.fault_kind or "")
    if row.ordering == "process_exit" or kind in (DEAD, UNRESPONSIVE):
        return "process_exit"
    return "hang" if row.ordering == "hang" or kind == HANG else row.ordering


def _death_incident(
    job: JobSummary, p: ProcessRestart, explained: dict[tuple[int, int | None, str], list[RoundRow]]
) -> tuple[object, ...]:
    """A death that explains a round is that round's incident; otherwise one of its own."""
    for r in explained.get((p.run, p.rank, "process_exit"), []):
        window = death_window(job, r.run, r.round)
        if p.wall is not None and window is not None and window[0] <= p.wall < window[1]:
            return ("round", r.run, r.round)
    return ("death", p.run, p.host, p.local_rank, p.wall)


def build_suspects(
    job: JobSummary,
    timeline: list[RoundRow],
    failures: list[Failure],
    process_rows: list[ProcessRestart],
) -> tuple[list[SuspectNode], str | None]:
    """Node-level faults per host; a host is suspect when one of its signatures is seen nowhere else."""
    hosts_of = {f.signature: set(f.hosts) for f in failures}
    per = _Tallies()
    # A hang or death that explains a round is one incident with that round, not two.
    explained: dict[tuple[int, int | None, str], list[RoundRow]] = {}
    for row in timeline:
        if row.first_host is not None and row.cause is not None:
            s = per.of(row.first_host, row.first_node)
            s.first += 1
            s.sigs.add(row.cause)
            s.incidents.add(("round", row.run, row.round))
            how = _incident_kind(row)
            if how in ("hang", "process_exit"):
                explained.setdefault((row.run, row.first_rank, how), []).append(row)
    for h in job.hangs:
        if h.host is None:
            continue
        s = per.of(h.host, h.node)
        s.hangs += 1
        s.sigs.add(hang_signature(h.timeout))
        rows = [r for r in explained.get((h.run, h.rank, "hang"), []) if r.round == h.round]
        s.incidents.add(("round", h.run, h.round) if rows else ("hang", h.run, h.round, h.rank))
    for p in process_rows:
        if p.host is None or p.explained_by is not None:
            continue
        s = per.of(p.host, p.node)
        s.deaths += 1
        s.sigs.add(process_end_signature(p.exit_code, p.signal))
        s.incidents.add(_death_incident(job, p, explained))
    # On one host (a local job) "seen only here" compares it with nothing.
    several_hosts = len(job.hosts | set(per)) > 1
    nodes = [
        SuspectNode(
            host=host,
            node=s.node,
            faults=len(s.incidents),
            first_failures=s.first,
            hangs=s.hangs,
            deaths=s.deaths,
            signatures=sorted(s.sigs),
            suspect=several_hosts and any(hosts_of.get(sig, {host}) <= {host} for sig in s.sigs),
        )
        for host, s in per.items()
    ]
    nodes.sort(key=lambda n: (-n.faults, n.host))
    flagged = [n.host for n in nodes if n.suspect]
    return nodes, (exclude_list(flagged) if flagged else None)
