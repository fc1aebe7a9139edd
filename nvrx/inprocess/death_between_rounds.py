"""A rank that dies between two rounds: the round it was heading into learns of it.

Round R's iteration barrier releases every rank into round R+1 with one decision:
who is terminated. A rank writes R+1 on its board only when it starts that round,
after the rejoin of replacement processes and its rank assignment. Dying in
between, it would still be in round R for its monitor, while R's decision, taken
before its death, counts it in R+1: its peers would start R+1 and wait for it
until a heartbeat or progress timeout.

So a rank that R's decision keeps says so on its board (``FLAG_RELEASED``, until
it starts R+1), and the monitor of such a rank, dead, leaves R+1 instead of R
(``place_after_death``); a live rank that leaves the job then (its rejoin or rank
assignment failed) does the same itself (``between_rounds.leave``). Its number
there is the one whose state (``keys.rank_state``) nobody published once every
other rank of R+1 started it: ``keys.STARTED`` counts those, ``keys.LATE_DEATHS``
the ranks that died (or left) so; where several did, each claims one of the unpublished numbers
(``keys.late_death_claim``): R+1's decision depends on which numbers left, not on
who had which. The rank's state is published under that number (``publish_state``),
so that a replacement process can be admitted with it (``rejoin``).

The number is only found where R+1 has as many ranks as R kept (its world size
less the terminated ranks that no replacement took back): a rank assignment that
leaves out ranks R kept (``Tree`` with ``min_ranks``) makes the dead rank's place
unknown, and the monitor then leaves round R as for any death. So it does, at its
next look, where no rank started R+1 and every rank R kept is counted so: none of
them is left to start R+1. (A rank R kept that went otherwise, its assignment
discarding it or dead before its board said it was kept, is not counted: the others
then wait their ``wait_s`` before leaving R.)

The store has no wait for a counter's value: the counters are read once per
``monitor_process_interval``, as the monitor's own watch loop does. No torch here:
the store modules come with the monitor's link.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nvrx.store import keys, rounds

from .progress_watchdog import FLAG_RELEASED

if TYPE_CHECKING:
    from .monitor_process import MonitorConfig
    from .monitor_store import StoreLink

log = logging.getLogger(__name__)


def released(flags: int) -> bool:
    """Whether a rank's board ``flags`` say its round's iteration barrier released it into the
    next round, which it has not started yet."""
    return bool(flags & FLAG_RELEASED)


def place_after_death(
    link: StoreLink, round_: int, rank: int, cfg: MonitorConfig, meanwhile: Callable[[], None]
) -> tuple[int, int] | None:
    """(rank, world size) in round ``round_`` + 1 of ``rank`` of ``round_``, dead after that
    round's iteration barrier released it into the next, its state published there; None
    where its place is not found (logged), within ``barrier_timeout``."""
    try:
        base = link.get()
        place = place_in_next_round(
            base, round_, cfg.initial_world_size, cfg.barrier_timeout,
            cfg.monitor_process_interval, meanwhile,
        )  # fmt: skip
        if place is not None:
            publish_state(base, round_, rank, *place)
        return place
    except Exception as exc:  # the store failed, or the supervisor is gone: leave ``round_``
        log.warning("round %d: no place found for a rank dead before it: %r", round_ + 1, exc)
        return None


def place_in_next_round(
    base: Any,
    round_: int,
    ranks_bound: int,
    wait_s: float,
    every_s: float,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[int, int] | None:
    """(rank, world size) in round ``round_`` + 1 of a rank that round ``round_``'s decision
    kept and that died (or left) before starting it, once every other rank of it started it;
    None after ``wait_s`` without that, where that round's size is not what round ``round_``
    kept, or where every rank it kept died or left so before any started it.
    ``ranks_bound``: no world size exceeds it (the job's initial one); ``meanwhile`` runs
    between two looks (a monitor beats to its supervisor)."""
    store, previous = rounds.round_store(base, round_ + 1), rounds.round_store(base, round_)
    store.add(keys.LATE_DEATHS, 1)
    try:
        size = _wait_for_the_others(store, previous, ranks_bound, wait_s, every_s, meanwhile)
    except BaseException:  # the wait given up: not counted there (as below)
        with contextlib.suppress(Exception):
            store.add(keys.LATE_DEATHS, -1)
        raise
    if size == 0:  # counted still: the others that died so see it too
        log.warning("round %d: every rank left or died before starting it", round_ + 1)
        return None
    kept = _kept(previous)  # after the wait: a rejoin may have taken replacements back since
    if size is None or kept != size:
        store.add(keys.LATE_DEATHS, -1)  # not counted there: another such death must not be
        if size is None:
            log.warning("round %d: its ranks did not all start within %g s", round_ + 1, wait_s)
        else:
            log.warning(
                "round %d has %d ranks where round %d kept %s: its rank assignment left "
                "ranks out, so the dead rank's number there is unknown",
                round_ + 1, size, round_, kept,
            )  # fmt: skip
        return None
    for rank in range(size):
        if store.check([keys.rank_state(rank)]):
            continue
        if int(store.add(keys.late_death_claim(rank), 1)) == 1:
            return rank, size
    log.warning("round %d: no number left unpublished for a rank that died before it", round_ + 1)
    return None


def _wait_for_the_others(
    store: Any,
    previous: Any,
    ranks_bound: int,
    wait_s: float,
    every_s: float,
    meanwhile: Callable[[], None] | None,
) -> int | None:
    """The world size of round ``store`` once its ranks that started and those that died
    before starting it add up to it; 0 where none started and those that died so are as
    many as round ``previous`` kept (read again each time: a rejoin may take replacements
    back meanwhile); None after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    size: int | None = None
    while True:
        started = int(store.add(keys.STARTED, 0))
        if started and size is None:
            size = _world_size(store, ranks_bound)
        late = int(store.add(keys.LATE_DEATHS, 0))
        if size is not None and started + late >= size:
            return size
        kept = None if started else _kept(previous)
        if kept is not None and late >= kept:
            return 0
        if time.monotonic() >= deadline:
            return None
        time.sleep(every_s)
        if meanwhile is not None:
            meanwhile()


def publish_state(base: Any, round_: int, rank: int, new_rank: int, world_size: int) -> None:
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


def _kept(store: Any) -> int | None:
    """How many ranks a round's decision keeps for the next round (None: it does not say)."""
    decision = json.loads(store.get(keys.DECISION))
    if decision.get("world_size") is None:  # a decision of an older version
        return None
    terminated = {int(r) for r in decision["terminated"]}
    if store.check([keys.REJOIN]):  # replacements taken back into the next round
        terminated -= {int(r) for r in json.loads(store.get(keys.REJOIN))}
    return int(decision["world_size"]) - len(terminated)


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
