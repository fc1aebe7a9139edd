"""Where a rank that died between two rounds belongs: a real TCPStore (the ``base`` fixture).

The whole path (a rank SIGKILLed in its rank assignment, its peers restarting at once) is
``tests/multiproc/test_wrapper.py::test_a_rank_dying_between_two_rounds_...``.
"""

from __future__ import annotations

import json
import threading

from nvrx.inprocess import store as rstore
from nvrx.inprocess.death_between_rounds import (
    heading_into_next,
    place_in_next_round,
    publish_state,
)
from nvrx.store import keys


def _decide(base, round_: int, terminated: list[int]) -> None:
    view = rstore.round_store(base, round_)
    view.set(keys.INTERRUPTED, "fault")
    view.set(keys.DECISION, json.dumps({"terminated": terminated, "world_size": 3}))


def _start(base, round_: int, rank: int, world_size: int, initial: int) -> None:
    """What ``RoundRun.start`` writes: the rank's state, then the count of ranks started."""
    view = rstore.round_store(base, round_)
    view.set(keys.rank_state(rank), json.dumps({"initial_rank": initial, "world_size": world_size}))
    view.add(keys.STARTED, 1)


def test_a_rank_the_decision_kept_heads_into_the_next_round_and_one_it_names_does_not(base):
    _decide(base, 4, terminated=[1])
    assert heading_into_next(rstore, base, 4, 2, wait_s=1.0)
    assert not heading_into_next(rstore, base, 4, 1, wait_s=1.0)


def test_a_completed_round_or_one_whose_barrier_never_releases_has_no_next_round(base):
    rstore.round_store(base, 2).set(keys.INTERRUPTED, "done")
    assert not heading_into_next(rstore, base, 2, 0, wait_s=5.0)  # at once: no wait
    rstore.round_store(base, 3).set(keys.INTERRUPTED, "fault")
    assert not heading_into_next(rstore, base, 3, 0, wait_s=0.3)  # no decision within 0.3 s


def test_the_dead_rank_takes_the_number_nobody_published_once_the_others_started(base):
    """Round 5 (3 ranks, shifted): the others start only after the dead rank's monitor began
    to wait, and rank 1 of round 5 is the number nobody published."""
    found = []
    waiter = threading.Thread(
        target=lambda: found.append(place_in_next_round(rstore, base, 4, 3, 10.0, 0.05))
    )
    waiter.start()
    _start(base, 5, 0, 3, initial=0)
    _start(base, 5, 2, 3, initial=1)
    waiter.join(15)
    assert found == [(1, 3)]


def test_two_ranks_dead_between_the_rounds_take_one_number_each(base):
    _start(base, 5, 1, 3, initial=1)
    found: list = []
    waiters = [
        threading.Thread(target=lambda: found.append(place_in_next_round(rstore, base, 4, 3, 10.0, 0.05)))
        for _ in range(2)
    ]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join(15)
    assert sorted(found) == [(0, 3), (2, 3)]


def test_no_place_when_the_next_round_never_has_all_its_ranks(base):
    _start(base, 5, 0, 3, initial=0)  # rank 1 never starts round 5
    assert place_in_next_round(rstore, base, 4, 3, 0.3, 0.05) is None


def test_the_dead_ranks_state_is_published_under_its_new_number_for_its_replacement(base):
    """Initial rank 4 was rank 3 of round 4 (active); it is rank 1 of round 5: its state there
    is renumbered, with round 5's active world size, and names its initial rank (a
    replacement is admitted by it)."""
    rstore.round_store(base, 4).set(
        keys.rank_state(3),
        json.dumps(
            {"rank": 3, "world_size": 5, "active_rank": 3, "active_world_size": 5,
             "initial_rank": 4, "initial_world_size": 6, "mode": "ACTIVE"}
        ),
    )  # fmt: skip
    view = rstore.round_store(base, 5)
    view.set(keys.rank_state(0), json.dumps({"world_size": 2, "active_world_size": 2}))
    publish_state(rstore, base, 4, 3, 1, 2)
    state = json.loads(view.get(keys.rank_state(1)))
    assert state == {
        "rank": 1, "world_size": 2, "active_rank": 1, "active_world_size": 2,
        "initial_rank": 4, "initial_world_size": 6, "mode": "ACTIVE",
    }  # fmt: skip
