"""Suspect nodes: node-level incidents per node (host and node rank), and the hosts to exclude.

A host is suspect when one of its failure signatures was seen on that host and
no other (and the job ran on several hosts): a signature seen on several hosts
points at the code, not at a node. A lost node's host is suspect unless a node
that stayed healthy ran on it too. Rows are per (host, node rank), so that
several nodes of one host (local jobs) are told apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nvrx.events.failures import (
    DEAD,
    FAULT_KINDS,
    HANG,
    NODE_LOST_SIGNATURE,
    UNRESPONSIVE,
    hang_signature,
    process_end_signature,
)

from .compact import exclude_list
from .model import Failure, NodeLoss, ProcessRestart, RoundRow, SuspectNode
from .round_windows import RoundWindows
from .timeline import BY_NODE_LOSS

if TYPE_CHECKING:
    from .job_summary import JobSummary
    from .node_loss import LossIndex


@dataclass
class _NodeTally:
    first: int = 0
    hangs: int = 0
    deaths: int = 0
    lost: list[NodeLoss] = field(default_factory=list)
    sigs: set[str] = field(default_factory=set)
    incidents: set[tuple[object, ...]] = field(default_factory=set)


class _Tallies(dict[tuple[str, "int | None"], _NodeTally]):
    def of(self, host: str, node: int | None) -> _NodeTally:
        """The tally of (``host``, ``node``); an unknown node is the host's one node, if one."""
        if node is None:
            nodes = [n for h, n in self if h == host and n is not None]
            node = nodes[0] if len(nodes) == 1 else None
        return self.setdefault((host, node), _NodeTally())


def _healthy_hosts(job: JobSummary, losses: LossIndex) -> dict[int, set[str]]:
    """Per run, the hosts of supervisors (slots) that were never lost."""
    lost = losses.lost_slots()
    healthy: dict[int, set[str]] = {}
    for e in job.node_events:
        run, slot, host = e["run"], e.get("node"), e.get("host")
        if e.get("component") == "supervisor" and host is not None and (run, slot) not in lost:
            healthy.setdefault(run, set()).add(host)
    return healthy


def _slot_hosts(job: JobSummary) -> dict[tuple[int, object], set[str]]:
    hosts: dict[tuple[int, object], set[str]] = {}
    for e in job.node_events:
        if e.get("component") == "supervisor" and e.get("host") is not None:
            hosts.setdefault((e["run"], e.get("node")), set()).add(e["host"])
    return hosts


def _lost_suspect(job: JobSummary, tally: _NodeTally, losses: LossIndex) -> bool:
    """Whether a lost node's host can be excluded: no node that stayed healthy ran on it
    (by the SLURM node name and by the host name its supervisor wrote)."""
    if not tally.lost:  # (the node events are scanned only for the few lost nodes)
        return False
    healthy, slot_hosts = _healthy_hosts(job, losses), _slot_hosts(job)
    for loss in tally.lost:
        names = {loss.host} | slot_hosts.get((loss.run, loss.slot), set())
        if not names & healthy.get(loss.run, set()):
            return True
    return False


def _add_losses(per: _Tallies, timeline: list[RoundRow], losses: LossIndex) -> None:
    blamed = {(row.run, row.round) for row in timeline if row.ordering == BY_NODE_LOSS}
    for loss in losses.losses:
        if loss.host is None:
            continue
        s = per.of(loss.host, loss.node)
        s.lost.append(loss)
        s.sigs.add(NODE_LOST_SIGNATURE)
        if (loss.run, loss.round) in blamed:  # one incident with the round it explains
            s.incidents.add(("round", loss.run, loss.round))
        else:
            s.incidents.add(("loss", loss.run, loss.slot))


def _incident_kind(row: RoundRow) -> str:
    """What else tells of the round's first failure: a hang report ("hang"), a process's end
    ("process_exit"), whether the round was explained by it or a monitor's fault said it."""
    kind = FAULT_KINDS.get(row.fault_kind or "")
    if row.ordering == "process_exit" or kind in (DEAD, UNRESPONSIVE):
        return "process_exit"
    return "hang" if row.ordering == "hang" or kind == HANG else row.ordering


def _death_incident(
    windows: RoundWindows,
    p: ProcessRestart,
    explained: dict[tuple[int, int | None, str], list[RoundRow]],
) -> tuple[object, ...]:
    """A death that explains a round (one in the round's window) is that round's incident;
    otherwise one of its own."""
    rnd = windows.round_at(p.run, p.wall)
    rows = explained.get((p.run, p.rank, "process_exit"), [])
    if rnd is not None and any(r.round == rnd for r in rows):
        return ("round", p.run, rnd)
    return ("death", p.run, p.host, p.local_rank, p.wall)


def _tally_rounds(
    per: _Tallies, timeline: list[RoundRow]
) -> dict[tuple[int, int | None, str], list[RoundRow]]:
    """Each round's first failure on its node; the rounds a hang or a death explains, by
    (run, rank, how), so that such a hang or death is one incident with its round, not two."""
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
    return explained


def _tally_hangs_and_deaths(
    per: _Tallies,
    job: JobSummary,
    process_rows: list[ProcessRestart],
    explained: dict[tuple[int, int | None, str], list[RoundRow]],
    losses: LossIndex | None,
) -> None:
    """The hangs no node loss explains, and the process ends nothing else explains."""
    for h in job.hangs:
        if h.host is None or (losses is not None and losses.explains(h.wall) is not None):
            continue
        s = per.of(h.host, h.node)
        s.hangs += 1
        s.sigs.add(hang_signature(h.timeout))
        rows = [r for r in explained.get((h.run, h.rank, "hang"), []) if r.round == h.round]
        s.incidents.add(("round", h.run, h.round) if rows else ("hang", h.run, h.round, h.rank))
    windows = RoundWindows(job.rounds)
    for p in process_rows:
        if p.host is None or p.explained_by is not None:
            continue
        s = per.of(p.host, p.node)
        s.deaths += 1
        s.sigs.add(process_end_signature(p.exit_code, p.signal))
        s.incidents.add(_death_incident(windows, p, explained))


def build_suspects(
    job: JobSummary,
    timeline: list[RoundRow],
    failures: list[Failure],
    process_rows: list[ProcessRestart],
    losses: LossIndex | None = None,
) -> tuple[list[SuspectNode], str | None]:
    """Node-level faults per node; a host is suspect when one of its signatures is seen
    nowhere else, or it was lost and no healthy node shared it."""
    hosts_of = {f.signature: set(f.hosts) for f in failures}
    per = _Tallies()
    explained = _tally_rounds(per, timeline)
    _tally_hangs_and_deaths(per, job, process_rows, explained, losses)
    if losses is not None:
        _add_losses(per, timeline, losses)
    # On one host (a local job) "seen only here" compares it with nothing.
    several_hosts = len(job.hosts | {host for host, _ in per}) > 1
    nodes = [
        SuspectNode(
            host=host,
            node=node,
            faults=len(s.incidents),
            first_failures=s.first,
            hangs=s.hangs,
            deaths=s.deaths,
            signatures=sorted(s.sigs),
            suspect=(
                several_hosts
                and any(
                    hosts_of.get(sig, {host}) <= {host}
                    for sig in s.sigs
                    if not (s.lost and sig == NODE_LOST_SIGNATURE)
                )
            )
            or (losses is not None and _lost_suspect(job, s, losses)),
            lost=len(s.lost),
        )
        for (host, node), s in per.items()
    ]
    nodes.sort(key=lambda n: (-n.faults, n.host, n.node if n.node is not None else -1))
    flagged = sorted({n.host for n in nodes if n.suspect})
    return nodes, (exclude_list(flagged) if flagged else None)
