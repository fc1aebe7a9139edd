"""Stragglers: the ranks and nodes the job's supervisor named slow, each until it recovered.

The supervisor that hosts the job's store scores each rank's and each node's step
time (its own work) against the job's reference and writes a ``straggler`` event
when it names one slow (``state=slow``) or clears it (``state=recovered``). One
``Straggler`` per naming: from a ``slow`` event to the next ``recovered`` of the
same rank or node in that run, else to the run's end. A ``slow`` event while it is
still slow adds nothing but an exclusion (``action=exclude``), which a later event
may ask for. A node excluded for slowness leaves the job to a spare: the first
``node_takeover`` of its slot after it was named (else a ``node_lost`` that names a
spare) says which spare, and when.
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
        end_wall=None,
        end_step=None,
        recovered=False,
        slower_pct=e.get("slower_pct"),
        median_s=e.get("median_s"),
        reference_s=e.get("reference_s"),
        score=e.get("score"),
        threshold=e.get("threshold"),
        window=e.get("window"),
        source=e.get("source"),
        action=e.get("action") or "unknown",
        replaced_by=None,
        replaced_wall=None,
    )


def _spare_of(e: dict[str, Any], x: Straggler) -> int | None:
    """The spare slot that ``e`` says took over ``x``'s slot, if it says one."""
    if e["run"] != x.run or e.get("lost_slot") != x.slot or _wall(e) < (x.start_wall or 0.0):
        return None
    if e.get("kind") == "node_takeover":
        return e.get("node")  # a supervisor event names its writer's slot
    if e.get("kind") == "node_lost" and e.get("action") == "spare":
        return e.get("replaced_by")
    return None


def _replace(job: JobSummary, x: Straggler) -> None:
    """Note the spare that took the place of ``x``, a node excluded for slowness, and when."""
    if x.of != NODE or x.action != EXCLUDE or x.slot is None:
        return
    told = [(s, e) for e in job.node_events if (s := _spare_of(e, x)) is not None]
    if told:  # the spare's own takeover first, else the declaration that names the spare
        slot, e = min(told, key=lambda t: (t[1].get("kind") != "node_takeover", _wall(t[1])))
        x.replaced_by, x.replaced_wall = slot, e.get("wall")


def build_stragglers(job: JobSummary) -> list[Straggler]:
    """Every rank and node named slow, in the order they were named."""
    events = sorted(
        (
            e
            for e in job.node_events
            if e.get("kind") == "straggler" and e.get("of") in (NODE, RANK)
        ),
        key=_wall,
    )
    slow: dict[tuple[int, str, Any], Straggler] = {}
    rows: list[Straggler] = []
    for e in events:
        key = (e["run"], e["of"], e.get("who"))
        x, state = slow.get(key), e.get("state")
        if state == SLOW and x is None:
            slow[key] = _named(e)
            rows.append(slow[key])
        elif state == SLOW and x is not None and e.get("action") == EXCLUDE:
            x.action = EXCLUDE  # named again, now asked to leave
        elif state == RECOVERED and x is not None:
            x.end_wall, x.end_step, x.recovered = e.get("wall"), e.get("step"), True
            del slow[key]
    for x in rows:
        _replace(job, x)
    return rows


def held_against(x: Straggler) -> bool:
    """Whether ``x`` counts against its node in the exclusion advice: a node still slow
    when its run ended, or one excluded for slowness. A node that recovered, and a rank
    named alone, do not."""
    return x.of == NODE and (not x.recovered or x.action == EXCLUDE)


def slower(x: Straggler) -> str:
    """'35.0 % slower'."""
    return f"{x.slower_pct:.1f} % slower" if x.slower_pct is not None else "slower (by ? %)"


def step_times(x: Straggler) -> str:
    """'median 1.350 s vs reference 1.000 s over 20 steps'."""
    window = f" over {x.window} steps" if x.window is not None else ""
    return f"median {secs(x.median_s)} vs reference {secs(x.reference_s)}{window}"
