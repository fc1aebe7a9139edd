"""Suspect nodes: node-level incidents per node (host and node rank), and the hosts to exclude.

A host is excluded only with evidence against the node itself, which each row
carries (``evidence``): it was lost, no node that stayed healthy ran on it, and
it did not run the SLURM step its requeue tried on it (a node that did lost only
its supervisor: ``requeue.answered``); a fault of its
own tells of its device or driver (``consequence.HARDWARE``); a rank asked to exclude
it (``ExcludeThisNode``); or it had
repeated faults of its own (two or more) with a signature seen on no other
host of a job on several hosts, unless they were one Python exception of one and the same
rank, whose message names no device (code that rank alone runs raises it on any node); or
it was slow, not failed: named a straggler
and never recovered, or excluded for slowness (``stragglers``). A follow-on
fault (``consequence``) and what a survivor wrote while a lost node was got
over are never evidence. Rows are per
(host, node rank), so that several nodes of one host (local jobs) are told apart.
"""

from __future__ import annotations

from collections.abc import Sequence
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
from nvrx.slurm.node_state import NodeHealth, node_health

from .compact import exclude_list
from .consequence import FOLLOW_ON, HARDWARE, fault_shape, names_a_device
from .job_rounds import BY_RESTART_CLAIM, FROM_JOB_RESTARTS, restart_ended
from .model import BY_NODE_LOSS, Failure, NodeLoss, ProcessRestart, RoundRow, Straggler, SuspectNode
from .node_loss import EXCLUDED_EXIT, NEVER_READY
from .round_windows import RoundWindows
from .stragglers import BY_LEAVING, EXCLUDE, held_against, slower, step_times

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
    # Incidents of its own (no follow-on fault, nothing a loss explains) -> their signature.
    own: dict[tuple[object, ...], str] = field(default_factory=dict)
    # Those of them that were a Python exception its rank raised -> that rank.
    raised: dict[tuple[object, ...], int | None] = field(default_factory=dict)
    hardware: set[str] = field(default_factory=set)  # signatures of device or driver faults
    slow: list[Straggler] = field(default_factory=list)  # namings that count against it
    asked_out: bool = False  # a rank asked to exclude it, and no loss of it was recorded


class _Tallies(dict[tuple[str, "int | None"], _NodeTally]):
    def of(self, host: str, node: int | None) -> _NodeTally:
        """The tally of (``host``, ``node``); an unknown node is the host's one node, if one."""
        if node is None:
            nodes = [n for h, n in self if h == host and n is not None]
            node = nodes[0] if len(nodes) == 1 else None
        return self.setdefault((host, node), _NodeTally())


def _answered(job: JobSummary) -> set[tuple[int, str]]:
    """(run, node) of lost nodes that still ran a SLURM step when asked (a requeue's
    ``answered``, a ``node_probe`` that answered): their supervisor was lost, not the node."""
    out: set[tuple[int, str]] = set()
    for e in job.node_events:
        if e.get("kind") == "requeue":
            out.update((e["run"], node) for node in e.get("answered") or ())
        elif e.get("kind") == "node_probe" and e.get("responding") is True and e.get("lost_host"):
            out.add((e["run"], e["lost_host"]))
    return out


def _excluded_slots(job: JobSummary) -> set[tuple[int, object]]:
    """(run, slot) of supervisors that left because a rank asked to exclude their node."""
    return {
        (e["run"], e.get("node"))
        for e in job.node_events
        if e.get("kind") == "supervisor_end" and e.get("exit_code") == EXCLUDED_EXIT
    }


def _slurm_words(state: str | None) -> str:
    """SLURM's state of a lost node when it was declared, for the evidence. A state that says
    responding proves nothing: SLURM marks a dead node only after its SlurmdTimeout."""
    if not state:
        return "SLURM not asked"
    if node_health(state) is NodeHealth.FAILED:
        return f"SLURM {state}"
    return f"SLURM {state} when declared (SLURM notices a dead node later)"


def _loss_evidence(job: JobSummary, tally: _NodeTally, losses: LossIndex) -> list[tuple[bool, str]]:
    """(against the node?, why) for each loss of the node: a lost node counts against its host
    unless it still ran a SLURM step when the job was requeued for it, or a node that stayed
    healthy ran on that host (by the SLURM node name and by the host name its supervisor
    wrote)."""
    if not tally.lost:  # (the node events are scanned only for the few lost nodes)
        return []
    slot_hosts, lost = job.slot_hosts(), losses.lost_slots()
    healthy: dict[int, set[str]] = {}  # per run, the hosts of supervisors never lost
    for (run, slot), hosts in slot_hosts.items():
        if (run, slot) not in lost:
            healthy.setdefault(run, set()).update(hosts)
    answered, excluded = _answered(job), _excluded_slots(job)
    slow_left = {(x.run, x.slot) for x in tally.slow if x.action == EXCLUDE}
    # (run, declarer's slot) -> a loss it declared after the run ended: it was alive, cut off.
    late_by = {(x.run, x.seen_by): x for x in losses.losses if x.after_run_end}
    out = []
    for loss in tally.lost:
        state = (loss.slurm_state or {}).get("State")
        silent = f"silent {loss.silent_s:.1f} s" if loss.silent_s is not None else "silent"
        how = f"{silent} to the job"
        if loss.cause == NEVER_READY:  # its node beat on: its supervisor stalled
            how = "never ready for a job-wide restart while its node beat"
        late = late_by.get((loss.run, loss.slot))
        if late is not None:
            how += f", cut off, not dead: it declared {late.host or 'a peer'} lost after run {loss.run} ended"
        names = {loss.host} | slot_hosts.get((loss.run, loss.slot), set())
        if (loss.run, loss.slot) in slow_left:
            out.append((True, "left the job when excluded for slowness: not a failure"))
        elif (loss.run, loss.slot) in excluded:
            out.append((True, "a rank asked to exclude this node (ExcludeThisNode)"))
        elif loss.host is not None and (loss.run, loss.host) in answered:
            out.append((False, "supervisor lost, node still ran a SLURM step: not excluded"))
        elif names & healthy.get(loss.run, set()):
            out.append((False, "lost, but nodes that stayed healthy ran on its host: not excluded"))
        else:
            slurm = _slurm_words(state)
            out.append((True, f"lost: {how}, {slurm}"))
    return out


def _add_hardware(
    per: _Tallies, job: JobSummary, process_rows: list[ProcessRestart], losses: LossIndex
) -> None:
    """Faults of a node's own device or driver that no node loss explains."""
    for sig, group in job.signatures.items():
        for _, _, node, host, _, shape, onset, run in group.seen:
            if shape == HARDWARE and host is not None and losses.explains(onset, shape, signature=sig, run=run) is None:
                per.of(host, node).hardware.add(sig)
    for p in process_rows:
        error = p.error
        if p.host is None or p.explained_by is not None or error is None:
            continue
        if fault_shape(error.exc_type, error.message, error.signature) == HARDWARE:
            per.of(p.host, p.node).hardware.add(error.signature or error.exc_type or "error file")


def _add_stragglers(per: _Tallies, stragglers: Sequence[Straggler]) -> None:
    """Nodes named slow that never recovered (slow to the end or until they left the job),
    or were excluded for slowness (``held_against``)."""
    for x in stragglers:
        if held_against(x) and x.host is not None:
            per.of(x.host, x.node).slow.append(x)


def _slow_evidence(x: Straggler) -> str:
    """Why a slow node is excluded: its slowdown, which is no failure."""
    at = f" at step {x.step}" if x.step is not None else ""
    if x.action == EXCLUDE:
        spare = f", spare slot {x.replaced_by} took over" if x.replaced_by is not None else ""
        done = f"excluded for slowness{at}{spare}"
    elif x.end_reason == BY_LEAVING:
        done = f"named slow{at}, still slow when it left the job"
    else:
        done = f"named slow{at}, never recovered"
    return f"slow, not failed: {slower(x)} than the job ({step_times(x)}); {done}"


def _follow_on_signatures(job: JobSummary) -> set[str]:
    """Signatures every occurrence of which is a follow-on fault (``consequence``)."""
    return {
        sig
        for sig, group in job.signatures.items()
        if group.seen and all(o[5] == FOLLOW_ON for o in group.seen)
    }


def _add_losses(per: _Tallies, timeline: list[RoundRow], losses: LossIndex) -> None:
    blamed = {(row.run, row.round) for row in timeline if row.ordering == BY_NODE_LOSS}
    for loss in losses.in_run():  # a loss declared after its run ended tells of its declarer
        if loss.host is None:
            continue
        s = per.of(loss.host, loss.node)
        s.lost.append(loss)
        s.sigs.add(NODE_LOST_SIGNATURE)
        if (loss.run, loss.round) in blamed:  # one incident with the round it explains
            s.incidents.add(("round", loss.run, loss.round))
        else:
            s.incidents.add(("loss", loss.run, loss.slot))


def _add_exclusions(
    per: _Tallies, job: JobSummary, losses: LossIndex, stragglers: Sequence[Straggler]
) -> None:
    """Nodes a rank asked to exclude (``ExcludeThisNode``: its supervisor ended with exit 10,
    not for slowness) whose loss no event records (a job of one node, node liveness off):
    the job's own code said the node is unfit. A recorded loss carries the same evidence
    (``_loss_evidence``); an exclusion for slowness is the straggler's (``_add_stragglers``)."""
    slow = {(x.run, x.slot) for x in stragglers if x.action == EXCLUDE}
    asked_out = _excluded_slots(job) - losses.lost_slots() - slow
    hosts = job.slot_hosts() if asked_out else {}
    for run, slot in asked_out:
        for host in hosts.get((run, slot), ()):
            per.of(host, slot if isinstance(slot, int) else None).asked_out = True


def _incident_kind(row: RoundRow) -> str:
    """What else tells of the round's first failure: a hang report ("hang"), a process's end
    ("process_exit"), whether the round was explained by it or a monitor's fault said it. A
    job-wide restart's failure is one of those two: the supervisor that announced it saw a
    rank's process end or its heartbeats stop."""
    if row.ordering == BY_RESTART_CLAIM:
        return "hang" if row.fault_kind == HANG else "process_exit"
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
    row = next((r for r in rows if _in_row(r, rnd, p.wall)), None)
    if row is not None:
        return ("round", p.run, row.round)
    return ("death", p.run, p.host, p.local_rank, p.wall)


def _in_row(row: RoundRow, rnd: int | None, wall: float | None) -> bool:
    """Whether a hang or death in round ``rnd`` at ``wall`` is in ``row``: a Wrapper round by
    its number; a stretch between job-wide restarts, which no rank numbers, by its time."""
    if row.outcome_from != FROM_JOB_RESTARTS:
        return rnd is not None and row.round == rnd
    until = restart_ended(row)
    return wall is not None and (row.start_wall is None or wall >= row.start_wall) and (
        until is None or wall <= until
    )


def _tally_rounds(
    per: _Tallies, timeline: list[RoundRow], follow_on: set[str]
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
            if row.ordering != BY_NODE_LOSS and row.cause not in follow_on:
                s.own[("round", row.run, row.round)] = row.cause
                if row.fault_kind == "exception":
                    s.raised[("round", row.run, row.round)] = row.first_rank
            how = _incident_kind(row)
            if how in ("hang", "process_exit"):
                explained.setdefault((row.run, row.first_rank, how), []).append(row)
    return explained


def _tally_hangs_and_deaths(
    per: _Tallies,
    job: JobSummary,
    process_rows: list[ProcessRestart],
    explained: dict[tuple[int, int | None, str], list[RoundRow]],
    losses: LossIndex,
) -> None:
    """The hangs no node loss explains, and the process ends nothing else explains."""
    for h in job.hangs:
        if h.host is None or losses.explains_hang(h) is not None:
            continue
        s = per.of(h.host, h.node)
        s.hangs += 1
        s.sigs.add(hang_signature(h.timeout))
        rows = explained.get((h.run, h.rank, "hang"), [])
        row = next((r for r in rows if _in_row(r, h.round, h.wall)), None)
        incident = ("hang", h.run, h.round, h.rank) if row is None else ("round", h.run, row.round)
        s.incidents.add(incident)
        s.own.setdefault(incident, hang_signature(h.timeout))
    windows = RoundWindows(job.rounds)
    for p in process_rows:
        if p.host is None or p.explained_by is not None:
            continue
        s = per.of(p.host, p.node)
        s.deaths += 1
        error = p.error  # its error file names the cause, as the failures table groups it
        told = error is not None and bool(error.signature)
        sig = error.signature if told else process_end_signature(p.exit_code, p.signal)
        s.sigs.add(sig)
        incident = _death_incident(windows, p, explained)
        s.incidents.add(incident)
        if told and fault_shape(error.exc_type, error.message, sig) == FOLLOW_ON:
            continue  # it followed another rank's failure: not one of its node's own
        s.own.setdefault(incident, sig)
        if told and error.exc_type and p.rank is not None:  # an exception its rank raised
            s.raised.setdefault(incident, p.rank)


def _evidence(
    job: JobSummary,
    host: str,
    s: _NodeTally,
    hosts_of: dict[str, set[str]],
    several_hosts: bool,
    losses: LossIndex,
    messages: dict[str, str],
) -> tuple[bool, list[str]]:
    """Whether the node goes into ``--exclude``, and why (or why not); ``messages``: each
    failure signature's message, by which a fault may name the rank's device."""
    against = [(True, _slow_evidence(x)) for x in s.slow]
    against += _loss_evidence(job, s, losses)
    if s.asked_out:
        against.append((True, "a rank asked to exclude this node (ExcludeThisNode)"))
    against += [(True, f"device or driver fault: {sig}") for sig in sorted(s.hardware)]
    own = {i: sig for i, sig in s.own.items() if hosts_of.get(sig, {host}) <= {host}}
    alone = sorted(own.values())
    ranks = {s.raised[i] for i in own if i in s.raised}
    one_rank = len(ranks) == 1 and None not in ranks and own.keys() <= s.raised.keys()
    device = bool(alone) and _of_a_device(job, alone[0], messages)
    code = one_rank and len(set(alone)) == 1 and not device if alone else False
    if several_hosts and len(alone) >= 2 and code:
        shown = ", ".join(dict.fromkeys(alone))
        against.append((False, f"{len(alone)} faults of its own seen on no other host, each an "
                        f"exception rank {ranks.pop()} raised ({shown}): its code may raise it "
                        "on any node; not enough to exclude"))  # fmt: skip
    elif several_hosts and len(alone) >= 2:
        shown = ", ".join(dict.fromkeys(alone))
        against.append((True, f"{len(alone)} faults of its own seen on no other host: {shown}"))
    elif alone and several_hosts:
        against.append((False, f"one fault of its own ({alone[0]}): not enough to exclude"))
    return any(flag for flag, _ in against), [why for _, why in against]


def _of_a_device(job: JobSummary, signature: str, messages: dict[str, str]) -> bool:
    """Whether the exception of ``signature`` may come from the rank's device: its message
    (a fault event's, or an error file's: ``messages``, by signature) or the signature names
    one."""
    group = job.signatures.get(signature)
    message = group.details.get("message", (None, ""))[1] if group is not None else ""
    return names_a_device(f"{signature} {message} {messages.get(signature, '')}")


def _own_hosts(
    job: JobSummary, failures: list[Failure], process_rows: list[ProcessRestart]
) -> dict[str, set[str]]:
    """Each failure signature's hosts, less those where it was only ever a follow-on fault
    (a peer's death broke a collective there at the same line): seen there, it tells
    nothing of code that fails on any node."""
    follow: dict[str, set[str]] = {}
    own: dict[str, set[str]] = {}
    for sig, group in job.signatures.items():
        for seen in group.seen:
            if seen[3] is not None:
                (follow if seen[5] == FOLLOW_ON else own).setdefault(sig, set()).add(seen[3])
    for p in process_rows:
        error = p.error
        if error is not None and error.signature and p.host is not None:
            shape = fault_shape(error.exc_type, error.message, error.signature)
            (follow if shape == FOLLOW_ON else own).setdefault(error.signature, set()).add(p.host)
    empty: set[str] = set()
    return {
        f.signature: set(f.hosts) - (follow.get(f.signature, empty) - own.get(f.signature, empty))
        for f in failures
    }


def build_suspects(
    job: JobSummary,
    timeline: list[RoundRow],
    failures: list[Failure],
    process_rows: list[ProcessRestart],
    losses: LossIndex,
    stragglers: Sequence[Straggler],
) -> tuple[list[SuspectNode], str | None]:
    """Node-level faults per node, and the hosts to exclude: only those with evidence against
    the node itself (a loss SLURM confirms, a device fault, repeated faults of its own, a
    slowness that lasted or got it excluded)."""
    hosts_of = _own_hosts(job, failures, process_rows)
    messages = {f.signature: f.message or "" for f in failures}
    per = _Tallies()
    explained = _tally_rounds(per, timeline, _follow_on_signatures(job))
    _tally_hangs_and_deaths(per, job, process_rows, explained, losses)
    _add_losses(per, timeline, losses)
    _add_exclusions(per, job, losses, stragglers)
    _add_hardware(per, job, process_rows, losses)
    _add_stragglers(per, stragglers)
    # On one host (a local job) "seen only here" compares it with nothing.
    several_hosts = len(job.hosts | {host for host, _ in per}) > 1
    nodes = []
    for (host, node), s in per.items():
        suspect, evidence = _evidence(job, host, s, hosts_of, several_hosts, losses, messages)
        nodes.append(
            SuspectNode(
                host=host,
                node=node,
                faults=len(s.incidents),
                first_failures=s.first,
                hangs=s.hangs,
                deaths=s.deaths,
                signatures=sorted(s.sigs),
                suspect=suspect,
                lost=len(s.lost),
                slow=len(s.slow),
                evidence=evidence,
            )
        )
    nodes.sort(key=lambda n: (-n.faults, n.host, n.node if n.node is not None else -1))
    flagged = sorted({n.host for n in nodes if n.suspect})
    return nodes, (exclude_list(flagged) if flagged else None)
