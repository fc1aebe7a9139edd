"""Which items of the output files are failures: only what the events cannot tell.

A traceback or stack dump in ``slurm-<job>.out`` is often printed by a process
that lives on: a hang's stack dump, a logged exception the rank recovered
from, a peer's diagnostic. Such an item is a failure only when the process
that printed it ended and its events do not say why (``Death``). srun's and
SLURM's own fatal lines are kept unless the events already explain them.
Each kept item names the rank and node that printed it, or says that it
cannot.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from nvrx.events.failures import HANG, kind_of, short_type, signal_signature, slurm_signature

from .model import LogFinding
from .output_scan import FATAL, OUT_OF_MEMORY, STACK_DUMP, TRACEBACK, OutputItem

#: SLURM's job-wide lines, by the cause a ``requeue``/``preempt_signal`` event gives for them.
_SLURM_CAUSES = {
    slurm_signature("time limit"): "time_limit",
    slurm_signature("preemption"): "preemption",
    slurm_signature("node failure"): "node_failure",
}
UNATTRIBUTED = "unknown process (no srun --label or [rankN] prefix)"
OOM_KILLER = "SLURM's or the kernel's OOM killer"
_SIGKILL = signal_signature("SIGKILL")


@dataclass(frozen=True)
class Death:
    """A process whose end the events record but do not explain (no fault event of its own)."""

    rank: int | None
    node: int | None
    host: str | None
    how: str  # exit signature, or "vanished" (its events stop inside the training function)


@dataclass
class EventFacts:
    """What the events tell, as far as judging output files needs it."""

    signatures: set[str] = field(default_factory=set)  # failure signatures the events know
    bare_types: set[str] = field(default_factory=set)  # exception types known without a frame
    deaths: list[Death] = field(default_factory=list)  # unexplained ends by an exit code
    killed: list[Death] = field(default_factory=list)  # unexplained ends by a signal
    supervised: bool = False  # one srun task per node runs a supervisor: a task is a node
    node_hosts: dict[int, str] = field(default_factory=dict)
    # slot -> run -> exit codes of its supervisor's ``supervisor_end`` in that run
    supervisor_exits: dict[int, dict[int, set[int]]] = field(default_factory=dict)
    fault_ended_ranks: set[int] = field(default_factory=set)  # ranks whose last event is a fault
    slurm_causes: set[str] = field(default_factory=set)  # causes of requeue/preempt_signal events
    lost_slots: dict[int, set[int]] = field(default_factory=dict)  # slot -> runs it was lost in
    # (run, slot) -> the hosts its supervisor's events name: which run srun's line may be of
    slot_hosts: dict[tuple[int, int], set[str]] = field(default_factory=dict)


@dataclass
class _Kept:
    ranks: set[int]
    nodes: set[int]
    hosts: set[str]
    printed_by: str
    explains: Death | None = None  # the one unexplained end this item tells the cause of


@dataclass
class Triage:
    """Kept findings (one per signature) and what was left out, for the report's notes."""

    findings: list[LogFinding] = field(default_factory=list)
    in_events: int = 0  # items the events already tell
    live: int = 0  # tracebacks/stack dumps of processes that did not die unexplained
    # Unexplained ends that a kept item explains (printed by that process, nobody else).
    explained: list[Death] = field(default_factory=list)


def _who(rank: int | None, node: int | None, facts: EventFacts) -> str:
    where = f" on {facts.node_hosts[node]}" if node in facts.node_hosts else ""
    if rank is not None and node is not None:
        return f"rank {rank} (node {node}{where})"
    if rank is not None:
        return f"rank {rank}"
    return f"node {node}{where}"


def _task_target(task: int | None, facts: EventFacts) -> tuple[int | None, int | None]:
    """(rank, node) an srun task stands for: a node under supervisors, else a rank."""
    if task is None:
        return None, None
    return (None, task) if facts.supervised else (task, None)


def _short(host: str) -> str:
    """A host's name without its domain (an address as it is): srun names the SLURM node,
    events of older writers the name the machine gives itself, which may be in full."""
    return host if host.replace(".", "").isdigit() else host.split(".", 1)[0]


def _may_be_of(run: int, slot: int, item: OutputItem, facts: EventFacts) -> bool:
    """Whether srun's line about task ``slot`` may be of job run ``run``: a requeued job's runs
    append to one output file, and srun's line names no run, only the task's host. It is not
    of a run whose events name another host for that slot; where they name none, it may be."""
    hosts = facts.slot_hosts.get((run, slot))
    if item.srun_host is None or not hosts:
        return True
    return _short(item.srun_host) in {_short(h) for h in hosts}


def _told_end(slot: int, item: OutputItem, facts: EventFacts) -> bool:
    """Whether the events tell the end srun's line gives task ``slot`` (a node, under
    supervisors) in a run the line may be of: its supervisor's ``supervisor_end`` with
    that exit code, or its ``node_lost``."""
    code = item.exit_code
    ended = {run for run, codes in facts.supervisor_exits.get(slot, {}).items() if code in codes}
    lost = facts.lost_slots.get(slot, set())
    return any(_may_be_of(run, slot, item, facts) for run in ended | lost)


def _srun_line(item: OutputItem, facts: EventFacts) -> _Kept | None:
    """srun's ``task N: Killed``: kept unless the events say how that task ended."""
    kept = _Kept(set(), set(), {item.srun_host} if item.srun_host else set(), "")
    names = []
    for task in item.srun_tasks:
        rank, node = _task_target(task, facts)
        if node is not None and _told_end(node, item, facts):
            continue  # the supervisor's own end event or its node_lost event says it
        if rank is not None and rank in facts.fault_ended_ranks:
            continue  # the rank's last event is the fault that ended it
        kept.ranks.update([rank] if rank is not None else [])
        kept.nodes.update([node] if node is not None else [])
        names.append(f"{_who(rank, node, facts)} (srun task {task})")
    if not names:
        return None
    kept.printed_by = "srun: " + ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return kept


def _by_prefix(item: OutputItem, facts: EventFacts) -> tuple[int | None, int | None]:
    rank, node = _task_target(item.task, facts)
    return (item.rank if item.rank is not None else rank), node


def _kept_for(rank: int | None, node: int | None, facts: EventFacts) -> _Kept:
    if rank is None and node is None:
        return _Kept(set(), set(), set(), UNATTRIBUTED)
    hosts = {facts.node_hosts[node]} if node in facts.node_hosts else set()
    ranks = {rank} if rank is not None else set()
    nodes = {node} if node is not None else set()
    return _Kept(ranks, nodes, hosts, _who(rank, node, facts))


def _only(values: set[int | None]) -> int | None:
    values.discard(None)
    return next(iter(values)) if len(values) == 1 else None


def _dead_printer(item: OutputItem, facts: EventFacts) -> _Kept | None:
    """The unexplained death that a traceback or hang dump explains, or None (a live process)."""
    rank, node = _by_prefix(item, facts)
    deaths = [
        d
        for d in facts.deaths
        if (rank is None or d.rank == rank) and (node is None or d.node == node)
    ]
    if not deaths:
        return None
    if rank is None and node is None:
        ends = "; ".join(f"{_who(d.rank, d.node, facts)}: {d.how}" for d in deaths[:8])
        return _Kept(set(), set(), set(), f"{UNATTRIBUTED}; unexplained ends in the events: {ends}")
    rank = rank if rank is not None else _only({d.rank for d in deaths})
    node = node if node is not None else _only({d.node for d in deaths})
    kept = _kept_for(rank, node, facts)
    kept.hosts.update(d.host for d in deaths if d.host is not None)
    hows = ", ".join(sorted({d.how for d in deaths}))
    kept.printed_by += f", which ended ({hows}) with no event saying why"
    if len(deaths) == 1:
        kept.explains = deaths[0]
    return kept


def _oom_kill(item: OutputItem, facts: EventFacts) -> _Kept | None:
    """An OOM killer's line: the cause of the ends the events record but do not explain (a
    SIGKILL, a rank whose events stop mid-call), or None when they explain every end."""
    ends = [d for d in facts.killed if d.how == _SIGKILL]
    ends += [d for d in facts.deaths if d.how == "vanished"]
    if not ends:
        return None
    victims = "; ".join(f"{_who(d.rank, d.node, facts)}: {d.how}" for d in ends[:8])
    kept = _Kept(
        {d.rank for d in ends if d.rank is not None},
        {d.node for d in ends if d.node is not None},
        {d.host for d in ends if d.host is not None},
        f"{OOM_KILLER}; unexplained ends in the events: {victims}",
    )
    if len(ends) == 1:
        kept.explains = ends[0]
    return kept


def _known(item: OutputItem, facts: EventFacts) -> bool:
    if item.signature in facts.signatures:
        return True
    return item.exc_type is not None and short_type(item.exc_type) in facts.bare_types


def judge(item: OutputItem, facts: EventFacts) -> _Kept | str:
    """A kept item's attribution, or why it is left out: "events" or "live"."""
    if item.srun_tasks:
        return _srun_line(item, facts) or "events"
    if item.signature == OUT_OF_MEMORY:
        return _oom_kill(item, facts) or "events"
    if item.signature in _SLURM_CAUSES:
        if _SLURM_CAUSES[item.signature] in facts.slurm_causes:
            return "events"
        return _Kept(set(), set(), set(), "SLURM (the whole job)")
    if item.what == FATAL:
        return "events" if _known(item, facts) else _kept_for(*_by_prefix(item, facts), facts)
    if item.what == TRACEBACK and _known(item, facts):
        return "events"
    if item.what == STACK_DUMP and kind_of(item.signature) != HANG:
        return "live"  # a stack dump on request, or the dump after a fatal line already kept
    return _dead_printer(item, facts) or "live"


def triage(items: Iterable[OutputItem], facts: EventFacts) -> Triage:
    """Judge every item; kept ones grouped by signature, first occurrence's text and place."""
    result = Triage()
    groups: dict[str, tuple[LogFinding, list[str]]] = {}
    for item in items:
        verdict = judge(item, facts)
        if verdict == "events":
            result.in_events += 1
            continue
        if isinstance(verdict, str):
            result.live += 1
            continue
        if verdict.explains is not None and verdict.explains not in result.explained:
            result.explained.append(verdict.explains)
        seen = groups.get(item.signature)
        if seen is None:
            finding = LogFinding(item.path, item.line, item.signature, item.text, 0)
            seen = groups[item.signature] = (finding, [])
        finding, printers = seen
        finding.count += 1
        finding.ranks = sorted(set(finding.ranks) | verdict.ranks)
        finding.nodes = sorted(set(finding.nodes) | verdict.nodes)
        finding.hosts = sorted(set(finding.hosts) | verdict.hosts)
        if verdict.printed_by not in printers:
            printers.append(verdict.printed_by)
            finding.printed_by = " | ".join(printers)
    result.findings = [finding for finding, _ in groups.values()]
    return result
