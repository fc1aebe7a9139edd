"""Stragglers: the ranks and nodes the job's supervisor named slow, each until it recovered.

The supervisor that hosts the job's store scores each rank's and each node's step
time (its own work) against the job's reference and writes a ``straggler`` event
when it names one slow (``state=slow``) or clears it (``state=recovered``). One
``Straggler`` per naming: from a ``slow`` event to the next ``recovered`` of the
same rank or node in that run, else to the run's end. A ``slow`` event while it is
still slow adds nothing but an exclusion (``action=exclude``), which a later event
may ask for. A node excluded for slowness leaves the job to a spare: the first
``node_takeover`` of its slot after it was named (else a ``node_lost`` that names a
spare) says which spare, and when; its row ends there.

Three things end a row without a recovery. A ``store_failover`` moves the scoring to
another supervisor, which judges afresh and never clears what the old one named: a
row still open then ends at the failover, whether it recovered is not known. Its
slot's ``node_lost`` or ``node_takeover`` (whatever the action): the row ends when its
node left (the takeover, else the loss); the scorer judges its ranks afresh on the
spare, which opens rows of their own. The store host's loss that moved the store is
the failover's, whichever of the two events came first. A rank's ``recovered`` event
from another slot than the one it was named on is its rank going on on a spare, not the
slow host recovering: the row ends the same way (else at that event).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .model import Straggler
from .text_doc import secs

if TYPE_CHECKING:
    from .job_summary import JobSummary

SLOW, RECOVERED = "slow", "recovered"
NODE, RANK = "node", "rank"
#: The action of a node whose supervisor was asked to leave the job for a spare.
EXCLUDE = "exclude"
#: Why a row stopped counting as slow (``Straggler.end_reason``; None: slow to its run's end).
BY_RECOVERY, BY_FAILOVER, BY_LEAVING = "recovered", "store failover", "node left"


def _wall(e: dict[str, Any]) -> float:
    return e.get("wall") or 0.0


def _named(e: dict[str, Any]) -> Straggler:
    """The straggler a ``slow`` event names, slow until a ``recovered`` says otherwise."""
    return Straggler(
        run=e["run"],
        of=e["of"],
        who=e.get("who"),
        node=e.get("node_rank"),
        slot=e.get("slot"),
        host=e.get("straggler_host"),
        ranks=sorted(e.get("ranks") or []),
        start_wall=e.get("wall"),
        step=e.get("step"),
        slower_pct=e.get("slower_pct"),
        median_s=e.get("median_s"),
        reference_s=e.get("reference_s"),
        score=e.get("score"),
        threshold=e.get("threshold"),
        window=e.get("window"),
        source=e.get("source"),
        action=e.get("action") or "unknown",
    )


def _leaving(job: JobSummary, x: Straggler, spare: bool = False) -> dict[str, Any] | None:
    """The event that tells when the node of ``x`` left its run after ``x`` was named: its
    slot's first ``node_takeover`` (the spare's), else its first ``node_lost``; ``spare``:
    only one that names the spare (a takeover's writer, a ``node_lost`` with action spare)."""
    moves = [
        e for e in job.node_events
        if e.get("kind") in ("node_takeover", "node_lost") and e["run"] == x.run
        and x.slot is not None and e.get("lost_slot") == x.slot
        and _wall(e) >= (x.start_wall or 0.0) and (not spare or _spare(e) is not None)
    ]  # fmt: skip
    return min(moves, key=lambda e: (e.get("kind") != "node_takeover", _wall(e)), default=None)


def _spare(e: dict[str, Any]) -> int | None:
    """The spare slot a ``node_takeover`` (its writer) or a spare's ``node_lost`` names."""
    if e.get("kind") == "node_takeover":
        return e.get("node")  # a supervisor event names its writer's slot
    return e.get("replaced_by") if e.get("action") == "spare" else None


def _replace(job: JobSummary, x: Straggler) -> None:
    """Note the spare that took the place of ``x``, a node excluded for slowness, and when."""
    e = _leaving(job, x, spare=True) if x.of == NODE and x.action == EXCLUDE else None
    if e is not None:  # the spare's own takeover first, else the declaration that names the spare
        x.replaced_by, x.replaced_wall = _spare(e), e.get("wall")


def _end(x: Straggler, wall: float | None, reason: str, step: int | None = None) -> None:
    """Close ``x`` at ``wall`` for ``reason``; only a recovery makes it ``recovered``."""
    x.end_wall, x.end_step, x.end_reason = wall, step, reason
    x.recovered = reason == BY_RECOVERY


def _moved(x: Straggler, e: dict[str, Any]) -> bool:
    """Whether ``e``, a ``recovered`` of rank row ``x``, comes from another slot: the rank
    goes on on a spare, so its old host did not recover."""
    return x.of == RANK and None not in (x.slot, e.get("slot")) and e.get("slot") != x.slot


class _Scan:
    """The rows so far and those still open, as the events are read in time order."""

    def __init__(self, job: JobSummary) -> None:
        self.job = job
        self.rows: list[Straggler] = []
        self.open: dict[tuple[int, str, Any], Straggler] = {}
        self.failovers: set[tuple[int, Any]] = set()  # (run, epoch) already seen
        # (run, slot) of the store hosts whose loss moved the store: a failover ends their rows
        self.moved: set[tuple[int, Any]] = {
            (e["run"], e.get("lost_slot")) for e in job.node_events if e.get("kind") == "store_failover"
        }

    def straggler(self, e: dict[str, Any]) -> None:
        """A rank or node named slow, named again, or cleared."""
        key = (e["run"], e["of"], e.get("who"))
        x, state = self.open.get(key), e.get("state")
        if state == SLOW and x is None:
            self.open[key] = _named(e)
            self.rows.append(self.open[key])
        elif state == SLOW and x is not None and e.get("action") == EXCLUDE:
            x.action = EXCLUDE  # named again, now asked to leave
        elif state == RECOVERED and x is not None:
            if _moved(x, e):
                left = (_leaving(self.job, x) or {}).get("wall")
                _end(x, e.get("wall") if left is None else left, BY_LEAVING)
            else:
                _end(x, e.get("wall"), BY_RECOVERY, e.get("step"))
            del self.open[key]

    def left(self, e: dict[str, Any]) -> None:
        """A slot left its run (lost, or taken over by a spare): what is open on it ends when
        its node left (``_leaving``); its ranks, judged afresh on the spare, open new rows."""
        slot = e.get("lost_slot")
        if (e["run"], slot) in self.moved:
            return  # the store host's: its scorer went with it (``failover``), in whatever order
        for key, x in list(self.open.items()):
            if slot is not None and (x.run, x.slot) == (e["run"], slot) and (x.start_wall or 0.0) <= _wall(e):
                _end(x, (_leaving(self.job, x) or e).get("wall"), BY_LEAVING)
                del self.open[key]

    def failover(self, e: dict[str, Any]) -> None:
        """The store moved: the scorer starts afresh, so what is open ends here, unknown.
        Every survivor writes the failover; the first of its epoch is when it happened."""
        epoch = e.get("epoch")
        tag = (e["run"], epoch if epoch is not None else e.get("wall"))
        if tag in self.failovers:
            return
        self.failovers.add(tag)
        for key, x in list(self.open.items()):
            if x.run == e["run"] and (x.start_wall or 0.0) < _wall(e):
                _end(x, e.get("wall"), BY_FAILOVER)
                del self.open[key]


def _left_for_spare(x: Straggler) -> None:
    """A node excluded for slowness ends when its spare took over, unless it ended before."""
    if x.replaced_wall is None or x.end_reason not in (None, BY_FAILOVER):
        return
    if x.end_reason is None or x.replaced_wall <= (x.end_wall or 0.0):
        _end(x, x.replaced_wall, BY_LEAVING)


def build_stragglers(job: JobSummary) -> list[Straggler]:
    """Every rank and node named slow, in the order they were named."""
    events = sorted(
        (
            e
            for e in job.node_events
            if (e.get("kind") == "straggler" and e.get("of") in (NODE, RANK))
            or e.get("kind") in ("store_failover", "node_lost", "node_takeover")
        ),
        key=_wall,
    )
    scan = _Scan(job)
    for e in events:
        if e.get("kind") == "store_failover":
            scan.failover(e)
        elif e.get("kind") == "straggler":
            scan.straggler(e)
        else:
            scan.left(e)
    for x in scan.rows:
        _replace(job, x)
        _left_for_spare(x)
    return scan.rows


def held_against(x: Straggler) -> bool:
    """Whether ``x`` counts against its node in the exclusion advice: a node still slow
    when its run ended or when it left the job, or one excluded for slowness. A node that
    recovered (one listed for exclusion too, that stayed, no spare being free when it read
    the list), one whose scoring moved away with a store failover (not known to be slow
    after), and a rank named alone, do not."""
    stayed_and_recovered = x.end_reason == BY_RECOVERY and x.replaced_wall is None
    excluded = x.action == EXCLUDE and not stayed_and_recovered
    return x.of == NODE and (x.end_reason in (None, BY_LEAVING) or excluded)


def slower(x: Straggler) -> str:
    """'35.0 % slower'."""
    return f"{x.slower_pct:.1f} % slower" if x.slower_pct is not None else "slower (by ? %)"


def step_times(x: Straggler) -> str:
    """'median 1.350 s vs reference 1.000 s over 20 steps'."""
    window = f" over {x.window} steps" if x.window is not None else ""
    return f"median {secs(x.median_s)} vs reference {secs(x.reference_s)}{window}"
