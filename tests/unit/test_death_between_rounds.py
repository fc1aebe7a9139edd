"""Where a rank that died between two rounds belongs: a real TCPStore (the ``base`` fixture).

The whole path (a rank SIGKILLed in its rank assignment, its peers restarting at once) is
``tests/multiproc/test_wrapper.py::test_a_rank_dying_between_two_rounds_...``.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from nvrx.inprocess import store as rstore
from nvrx.inprocess.progress_watchdog import FLAG_RELEASED, FLAG_SHUTDOWN, FLAG_USER
from nvrx.inprocess.progress_watchdog import released_into_next as released
from nvrx.store import rounds
from tests.support.waiting import wait_until


def _decide(base, round_: int, world_size: int, terminated: list[int], back=None) -> None:
    """Round ``round_``'s iteration barrier decided (``back``: ranks its rejoin took back)."""
    view = rstore.round_store(base, round_)
    for rank in terminated:  # as the ranks, their monitors or supervisors did before it
        rstore.register_terminated(view, rank)
    view.set(rounds.DECISION, json.dumps({"terminated": terminated, "world_size": world_size}))
    if back is not None:
        view.set(rounds.REJOIN, json.dumps(back))


def _start(base, round_: int, rank: int, world_size: int, initial: int) -> None:
    """What ``RoundRun.start`` writes: the rank's state, then the count of ranks started."""
    view = rstore.round_store(base, round_)
    view.set(rounds.rank_state(rank), json.dumps({"initial_rank": initial, "world_size": world_size}))
    view.add(rounds.STARTED, 1)


def _place(base, wait_s: float = 10.0):
    return rounds.place_in_next_round(base, 4, 4, wait_s, 0.05)


def _placing(base, wait_s: float, found: list, looks: list[int]) -> threading.Thread:
    """``_place`` in a started thread; ``looks`` gets one more entry, counted up at each of its
    looks that did not end the wait (where the wait is seen from outside)."""
    looks.append(0)
    who = len(looks) - 1

    def looked() -> None:
        looks[who] += 1

    def run() -> None:
        found.append(rounds.place_in_next_round(base, 4, 4, wait_s, 0.05, looked))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _late_deaths(base, round_: int) -> int:
    return int(rstore.round_store(base, round_).add(rounds.LATE_DEATHS, 0))


def test_only_the_flag_a_released_rank_sets_says_it_heads_into_the_next_round():
    assert released(FLAG_RELEASED | FLAG_USER) and not released(FLAG_USER | FLAG_SHUTDOWN)


def test_the_dead_rank_takes_the_number_nobody_published_once_the_others_started(base):
    """Round 4 kept its 3 ranks; in round 5 (shifted) the others start only after the dead
    rank's monitor began to wait, and rank 1 of round 5 is the number nobody published."""
    _decide(base, 4, 3, [])
    found = []
    waiter = threading.Thread(target=lambda: found.append(_place(base)))
    waiter.start()
    _start(base, 5, 0, 3, initial=0)
    _start(base, 5, 2, 3, initial=1)
    waiter.join(15)
    assert found == [(1, 3)]


def test_two_ranks_dead_between_the_rounds_take_one_number_each(base):
    _decide(base, 4, 3, [])
    _start(base, 5, 1, 3, initial=1)
    found: list = []
    waiters = [threading.Thread(target=lambda: found.append(_place(base))) for _ in range(2)]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join(15)
    assert sorted(found) == [(0, 3), (2, 3)]


def test_a_replacement_taken_back_counts_among_the_ranks_kept(base):
    """Round 4 (4 ranks) terminated ranks 1 and 3, and rank 1's replacement came back: round 5
    keeps 3 ranks, two of them started."""
    _decide(base, 4, 4, [1, 3], back=[1])
    _start(base, 5, 0, 3, initial=0)
    _start(base, 5, 1, 3, initial=1)
    assert _place(base) == (2, 3)


def test_no_place_where_the_rank_assignment_left_out_ranks_the_round_kept(base):
    """Round 4 kept 3 of its 4 ranks, but round 5 has 2 (``Tree`` dropped a healthy rank with
    the terminated one): which number the dead rank would have had is unknown, so none of a
    live rank's is taken."""
    _decide(base, 4, 4, [3])
    _start(base, 5, 0, 2, initial=0)
    assert _place(base) is None
    view = rstore.round_store(base, 5)
    assert not view.check([rounds.late_death_claim(1)])
    assert int(view.add(rounds.LATE_DEATHS, 0)) == 0  # not counted for another such death


def test_no_place_when_the_next_round_never_has_all_its_ranks(base):
    _decide(base, 4, 3, [])
    _start(base, 5, 0, 3, initial=0)  # rank 1 never starts round 5
    assert _place(base, wait_s=0.3) is None
    assert _late_deaths(base, 5) == 0


def test_no_wait_where_every_rank_the_round_kept_left_before_starting_the_next(base):
    """Round 4 kept its 3 ranks, and all of them died or left before starting round 5 (a rank
    assignment that raises everywhere): nobody is in round 5 to wait for, so no one waits
    there for the others (here 60 s), and each leaves round 4 as for any death."""
    _decide(base, 4, 3, [])
    found: list = []
    waiters = [threading.Thread(target=lambda: found.append(_place(base, 60))) for _ in range(3)]
    for w in waiters:
        w.start()
    deadline = time.monotonic() + 30
    for w in waiters:
        w.join(max(0.0, deadline - time.monotonic()))
    assert found == [None, None, None] and not any(w.is_alive() for w in waiters)
    for w in waiters:
        w.join()


def test_two_ranks_dead_before_the_others_start_wait_for_them_where_one_was_terminated(base):
    """Round 4 (4 ranks) terminated rank 3 and kept 3; two of them died before round 5, whose
    one other rank starts late: they wait for it (two dead and one terminated are not the
    three kept), then take one number each."""
    _decide(base, 4, 4, [3])
    found: list = []
    looks: list[int] = []
    waiters = [_placing(base, 20, found, looks) for _ in range(2)]
    wait_until("both dead ranks counted in round 5", lambda: _late_deaths(base, 5) == 2, 10)
    counted = list(looks)

    def looked_again() -> bool:  # a whole look by each waiter since: it saw both deaths
        return all(n - c >= 2 for n, c in zip(looks, counted, strict=True))

    wait_until("a whole look by each waiter since", looked_again, 10, state=lambda: looks)
    assert found == []  # they wait: two dead and one terminated are not the three kept
    _start(base, 5, 0, 3, initial=0)
    for w in waiters:
        w.join(30)
    assert sorted(found) == [(1, 3), (2, 3)]


def test_replacements_taken_back_during_the_wait_count_among_the_ranks_kept(base):
    """Round 4 (4 ranks) terminated rank 1; rank 2 dies while the rejoin leader still waits for
    rank 1's replacement. Once admitted, the replacement starts round 5 with ranks 0 and 3: the
    round has 4 ranks, as round 4 kept once the rejoin wrote who came back."""
    _decide(base, 4, 4, [1])
    found: list = []
    looks: list[int] = []
    waiter = _placing(base, 20, found, looks)
    # the dead rank's monitor looks while the rejoin is not done yet
    wait_until("a look of the dead rank's monitor", lambda: looks[0] >= 1, 10)
    assert found == []
    rstore.round_store(base, 4).set(rounds.REJOIN, json.dumps([1]))
    for rank, initial in ((0, 0), (1, 1), (3, 3)):
        _start(base, 5, rank, 4, initial=initial)
    waiter.join(30)
    assert found == [(2, 4)]


def test_a_wait_given_up_meanwhile_is_not_counted_for_another_such_death(base):
    """The monitor beats to its supervisor between two looks; a supervisor gone ends the wait
    (``SupervisorGone`` from the beat), and the count of deaths there is taken back."""
    _decide(base, 4, 3, [])
    _start(base, 5, 0, 3, initial=0)  # rank 1 never starts round 5
    looks = []

    def beat() -> None:
        looks.append(time.monotonic())
        if len(looks) == 3:
            raise RuntimeError("supervisor gone")

    with pytest.raises(RuntimeError, match="supervisor gone"):
        rounds.place_in_next_round(base, 4, 4, 60.0, 0.05, beat)
    assert len(looks) == 3
    assert _late_deaths(base, 5) == 0


def test_the_dead_ranks_state_is_published_under_its_new_number_for_its_replacement(base):
    """Initial rank 4 was rank 3 of round 4 (active, 5 ranks, 3 of them terminated); it is
    rank 1 of round 5 once rank 0 started there: its state there is renumbered, with round
    5's active world size, and names its initial rank (a replacement is admitted by it)."""
    _decide(base, 4, 5, [0, 2, 4])
    rstore.round_store(base, 4).set(
        rounds.rank_state(3),
        json.dumps(
            {"rank": 3, "world_size": 5, "active_rank": 3, "active_world_size": 5,
             "initial_rank": 4, "initial_world_size": 6, "mode": "ACTIVE"}
        ),
    )  # fmt: skip
    view = rstore.round_store(base, 5)
    view.set(rounds.rank_state(0), json.dumps({"world_size": 2, "active_world_size": 2}))
    view.add(rounds.STARTED, 1)
    assert rounds.carry_over_death(base, 4, 3, 6, 10.0, 0.05) == (1, 2)
    state = json.loads(view.get(rounds.rank_state(1)))
    assert state == {
        "rank": 1, "world_size": 2, "active_rank": 1, "active_world_size": 2,
        "initial_rank": 4, "initial_world_size": 6, "mode": "ACTIVE",
    }  # fmt: skip


def test_a_dead_rank_without_a_state_claims_no_number(base):
    """Rank 2 of round 4 published no state there: it is not placed in round 5, and no
    number of round 5 is claimed or counted for it."""
    _decide(base, 4, 3, [])
    assert rounds.carry_over_death(base, 4, 2, 4, 10.0, 0.05) is None
    assert not rstore.round_store(base, 5).check([rounds.LATE_DEATHS])  # it never waited there
