"""A rank that dies between two rounds: the round it was heading into learns of it.

Round R's iteration barrier releases every rank into round R+1 with one decision:
who is terminated. A rank writes R+1 on its board only when it starts that round,
after the rejoin of replacement processes and its rank assignment. Dying in
between, it is still in round R for its monitor, and R's decision, taken before
its death, counts it in R+1: its peers would start R+1 and wait for it until a
heartbeat or progress timeout ended them.

So the monitor of a dead rank first leaves round R on its behalf (as for any
death), then asks ``heading_into_next``: did R's decision keep the rank? If so it
publishes the rank's state in R+1 (``publish_state``: a replacement process is
admitted with it) and leaves R+1 too, under the number R+1 gives the rank
(``place_in_next_round``):
the number whose state (``keys.rank_state``) nobody published once every other
rank of R+1 started it (``keys.STARTED`` counts those, ``keys.LATE_DEATHS`` the
ranks that died so). Where several died so, each monitor claims one of the
unpublished numbers (``keys.late_death_claim``): R+1's decision depends on which
numbers left, not on who had which.

The store has no wait for a counter's value: ``place_in_next_round`` reads the
counters once per ``every_s``, as the monitor's own watch loop does. No torch
here: ``rounds`` is the monitor link's ``nvrx.inprocess.store``.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any

from nvrx.store import keys

if TYPE_CHECKING:
    from .monitor_process import MonitorConfig
    from .monitor_store import StoreLink

log = logging.getLogger(__name__)


def place_after_death(
    link: StoreLink, round_: int, rank: int, cfg: MonitorConfig
) -> tuple[int, int] | None:
    """(rank, world size) in the next round of ``rank`` of round ``round_``, dead and left
    from that round, where that round's decision kept it for the next (``heading_into_next``,
    ``place_in_next_round``); None where it was not kept, or its place is not found.

    Each wait lasts at most as long as the ranks wait at a barrier (``barrier_timeout``).
    """
    rounds, base, wait_s = link.rounds, link.get(), cfg.barrier_timeout
    if not heading_into_next(rounds, base, round_, rank, wait_s):
        return None
    place = place_in_next_round(
        rounds, base, round_, cfg.initial_world_size, wait_s, cfg.monitor_process_interval
    )
    if place is not None:
        publish_state(rounds, base, round_, rank, *place)
    return place


def heading_into_next(rounds: ModuleType, base: Any, round_: int, rank: int, wait_s: float) -> bool:
    """Whether the decision of round ``round_``'s iteration barrier keeps ``rank`` (its
    number in that round) for the next round; waits up to ``wait_s`` for that decision.

    Called after the rank was registered terminated in ``round_``: a decision taken
    since names it, one taken before does not, and a round that completed or whose
    barrier never releases has no next round to tell.
    """
    store = rounds.round_store(base, round_)
    if store.check([keys.INTERRUPTED]) and store.get(keys.INTERRUPTED) == rounds.DONE.encode():
        return False  # the round completed: no iteration barrier, no next round
    try:
        store.wait([keys.DECISION], datetime.timedelta(seconds=wait_s))
    except Exception as exc:  # torch raises a plain RuntimeError (or DistStoreError) on timeout
        log.info("round %d's iteration barrier did not release within %g s: %r", round_, wait_s, exc)
        return False
    decision = json.loads(store.get(keys.DECISION))
    return rank not in decision["terminated"]


def place_in_next_round(
    rounds: ModuleType, base: Any, round_: int, ranks_bound: int, wait_s: float, every_s: float
) -> tuple[int, int] | None:
    """(rank, world size) in round ``round_`` + 1 of a rank that died before starting it,
    once every other rank of that round started it; None after ``wait_s`` without that.

    ``ranks_bound``: no world size exceeds it (the job's initial world size).
    """
    store = rounds.round_store(base, round_ + 1)
    store.add(keys.LATE_DEATHS, 1)
    deadline = time.monotonic() + wait_s
    size: int | None = None
    while True:
        started = int(store.add(keys.STARTED, 0))
        if started and size is None:
            size = _world_size(store, ranks_bound)
        if size is not None and started + int(store.add(keys.LATE_DEATHS, 0)) >= size:
            break
        if time.monotonic() >= deadline:
            log.warning(
                "round %d: its ranks did not all start within %g s; a dead rank counted "
                "there is left to the timeouts", round_ + 1, wait_s,
            )  # fmt: skip
            return None
        time.sleep(every_s)
    for rank in range(size):
        if store.check([keys.rank_state(rank)]):
            continue
        if int(store.add(keys.late_death_claim(rank), 1)) == 1:
            return rank, size
    log.warning("round %d: no number left unpublished for a rank that died before it", round_ + 1)
    return None


def publish_state(
    rounds: ModuleType, base: Any, round_: int, rank: int, new_rank: int, world_size: int
) -> None:
    """Publish the state the dead ``rank`` of round ``round_`` has as ``new_rank`` in the
    next round, as a rank does when it starts a round: a replacement process is admitted
    with it (``rejoin``). Its state of ``round_`` renumbered; active as there, under its
    new number, with the next round's active world size (the usual rank assignments
    compute them so; a replacement's own assignment computes them again anyway)."""
    store = rounds.round_store(base, round_ + 1)
    state = json.loads(rounds.round_store(base, round_).get(keys.rank_state(rank)))
    peer = _peer_state(store, world_size) or {}
    active = state.get("active_rank") is not None
    state.update(
        rank=new_rank,
        world_size=world_size,
        active_rank=new_rank if active else None,
        active_world_size=peer.get("active_world_size", state.get("active_world_size")),
    )
    store.set(keys.rank_state(new_rank), json.dumps(state))


def _world_size(store: Any, ranks_bound: int) -> int | None:
    """The round's world size, from the first rank state published there."""
    state = _peer_state(store, ranks_bound)
    return None if state is None else int(state["world_size"])


def _peer_state(store: Any, ranks_bound: int) -> dict[str, Any] | None:
    """The first rank state published in the round (numbers below ``ranks_bound``)."""
    for rank in range(ranks_bound):
        if store.check([keys.rank_state(rank)]):
            return dict(json.loads(store.get(keys.rank_state(rank))))
    return None
