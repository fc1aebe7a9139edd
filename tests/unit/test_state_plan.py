"""The hand-over plan of ``KeptState.restore_agreed``: what every rank derives from what
every rank holds (``nvrx.inprocess.state_plan``), without processes."""

from __future__ import annotations

import numpy as np
import pytest

from nvrx.inprocess.state_plan import (
    Held,
    check_alike,
    new_course,
    newest_step,
    plan,
    replica_groups,
)

GROUPS = [[0, 2], [1, 3]]  # 2 replicas of 2 shards


def _held(steps=(), course=0.0, shard=None, names=("model",), groups=(), now=0.0) -> Held:
    return Held(tuple(steps), course, shard, tuple(names), tuple(groups), now)


def _of(*steps_and_shards) -> list[Held]:
    return [_held(steps, shard=shard) for steps, shard in steps_and_shards]


def test_each_shard_comes_from_a_holder_of_its_own_replica_group():
    got = plan(_of(((3, 2), 0), ((3, 2), 1), ((), None), ((), None)), GROUPS)
    assert (got.step, got.sources) == (3, {2: 0, 3: 1})
    assert got.receivers_of(0) == [2] and got.receivers_of(1) == [3]


def test_the_step_is_the_newest_some_holder_of_every_group_holds():
    # rank 2 is a commit behind: rank 0 holds step 3 of shard 0, so rank 2 receives it
    got = plan(_of(((3, 2), 0), ((3, 2), 1), ((2, 1), 0), ((3, 2), 1)), GROUPS)
    assert (got.step, got.sources) == (3, {2: 0})
    # no holder of shard 1 has step 3: step 2, which every group has
    got = plan(_of(((3, 2), 0), ((2, 1), 1), ((3, 2), 0), ((2, 1), 1)), GROUPS)
    assert (got.step, got.sources) == (2, {})


def test_restoring_a_step_older_than_one_held_begins_a_new_course():
    # shard 0 committed step 3, shard 1 not: step 3 is abandoned and trained again, so a
    # replica that sat this agreement out holding step 3 must not count as a holder of it
    forked = plan([_held((3, 2), 1.0, 0, now=5.0), _held((2, 1), 1.0, 1, now=5.0)], [[0], [1]])
    assert (forked.step, forked.sources, forked.course) == (2, {}, 5.0)
    later = [_held((3, 2), 5.0, 0), _held((3, 2), 5.0, 1), _held((3, 2), 1.0, 0), _held((2,), 1.0, 1)]
    assert plan(later, GROUPS).sources == {2: 0, 3: 1}
    kept_up = plan([_held((3, 2), 1.0, 0), _held((2, 1), 1.0, 0)], [[0, 1]])
    assert (kept_up.step, kept_up.course) == (3, 1.0)  # the newest step: no course begins


def test_a_replica_that_sat_out_a_course_begun_at_an_older_step_counts_for_nothing():
    # round 2: ranks 0 (shard 0) and 1 (shard 1) alone; shard 0 had committed step 3, shard 1
    # not: step 2 is restored and a course begins. Replicas 2 and 3 sat it out (inactive).
    round_2 = plan([_held((3, 2), 1.0, 0, now=5.0), _held((2, 1), 1.0, 1, now=5.0)], [[0], [1]])
    assert (round_2.step, round_2.course) == (2, 5.0)
    # rank 0 trained step 3 again and committed it; round 3: rank 1 was lost (its replacement
    # holds nothing), 2 and 3 come back. Rank 3's step 2 is the very step round 2 restored,
    # but it is a commit of the course before: shard 1 has no holder, and the ranks fall
    # back to the checkpoint rather than restore step 2 from rank 3.
    round_3 = [_held((3, 2), 5.0, 0), _held(), _held((3, 2), 1.0, 0), _held((2, 1), 1.0, 1)]
    assert plan(round_3, GROUPS) is None
    assert newest_step(round_3) == 3  # state_restored reports the step 3 kept as newest


def test_no_plan_when_a_shard_has_no_holder_or_nothing_is_kept():
    assert plan(_of(((3, 2), 0), ((), None), ((3, 2), 0), ((), None)), GROUPS) is None
    assert plan(_of(((), None), ((), None), ((), None), ((), None)), GROUPS) is None
    assert plan(_of(((5,), 0), ((3,), 1), ((5,), 0), ((3,), 1)), GROUPS) is None  # no common step


def test_a_survivor_renumbered_into_another_group_receives_its_new_shard():
    # rank 3 left; the survivors were shifted down: the new rank 2 committed shard 1 (as
    # old rank 3), and a new rank 3 holds nothing. Rank 2 must not serve its shard-1 state
    # as shard 0's: it receives shard 0 from rank 0, and rank 3 shard 1 from rank 1.
    got = plan(_of(((4,), 0), ((4,), 1), ((4,), 1), ((), None)), GROUPS)
    assert (got.step, got.sources) == (4, {2: 0, 3: 1})


def test_a_rank_shifted_into_the_other_group_serves_the_shard_it_holds():
    # interleaved groups, rank 1 lost, the ranks above shifted down and a spare last: the new
    # rank 1 committed shard 0 (as old rank 2), the new rank 2 shard 1 (as old rank 3). Each
    # serves the shard it holds to the rank of the other group that needs it, and receives.
    got = plan(_of(((6, 5), 0), ((6, 5), 0), ((6, 5), 1), ((), None)), GROUPS)
    assert (got.step, got.sources) == (6, {1: 2, 2: 0, 3: 2})
    assert got.transfers() == [(0, 2), (2, 1), (2, 3)]


def test_a_receiver_is_served_by_a_holder_that_can_send_and_without_one_there_is_no_plan():
    """Pickle refuses rank 0's commit of step 3 (``Held.unsendable``): rank 2, which lacks
    it, gets it from rank 1 where rank 1 holds it; where no holder can send it, the ranks
    fall back to the checkpoint rather than start a hand-over that fails."""
    groups = [[0, 1, 2]]
    can_send = Held((3,), 0.0, 0, ("model",), (), 0.0, unsendable=())
    cannot = Held((3,), 0.0, 0, ("model",), (), 0.0, unsendable=(3,))
    got = plan([cannot, can_send, _held()], groups)
    assert (got.step, got.sources) == (3, {2: 1})
    assert plan([cannot, cannot, _held()], groups) is None
    assert plan([cannot, cannot], [[0, 1]]).sources == {}  # nobody to serve: its own memory


def test_transfers_never_wait_on_each_other():
    # a rank that sends and receives: every rank walks plan.transfers() in order, doing its
    # own part; simulated, each step completes the first transfer whose two ranks are at it
    for everyone in (
        _of(((6,), 0), ((6,), 0), ((6,), 1), ((), None)),
        _of(((6,), 1), ((6,), 0), ((6,), 1), ((6,), 0)),
        _of(((6,), 1), ((6,), 1), ((6,), 0), ((6,), 0)),
    ):
        transfers = plan(everyone, GROUPS).transfers()
        todo = {r: [t for t in transfers if r in t] for r in range(4)}
        while any(todo.values()):
            ready = [t for t in transfers if all(todo[r] and todo[r][0] == t for r in t)]
            assert ready, f"the ranks wait on each other: {todo}"
            for r in ready[0]:
                todo[r].pop(0)


def test_commits_made_before_any_agreement_are_of_the_ranks_group_now():
    # shard None: committed before the first restore_agreed told the rank its shard
    got = plan(_of(((3,), None), ((3,), None), ((), None), ((), None)), GROUPS)
    assert (got.step, got.sources) == (3, {2: 0, 3: 1})  # not rank 0 serving both groups
    assert plan(_of(((3,), None), ((), None), ((3,), None), ((), None)), GROUPS) is None


def test_a_fallback_begins_a_course_later_than_every_course_known():
    everyone = [_held((5,), course=100.0, now=90.0), _held(now=95.0)]
    assert new_course(everyone) > 100.0  # a clock that went back still moves the course on
    assert new_course([_held(course=100.0, now=250.0), _held(now=260.0)]) == 260.0


def test_the_newest_step_reported_is_of_the_current_course():
    everyone = [_held((7,), course=2.0), _held((9, 8), course=1.0)]
    assert newest_step(everyone) == 7


def test_commits_of_an_abandoned_course_do_not_count():
    everyone = [_held((7,), course=1), _held((7,), course=1), _held((9, 8), course=0)]
    got = plan(everyone, [[0, 1, 2]])
    assert (got.step, got.course, got.sources) == (7, 1, {2: 0})


def test_receivers_are_spread_over_the_holders_of_their_group():
    everyone = [_held((5,), shard=0)] * 2 + [_held()] * 4
    got = plan(everyone, [list(range(6))])
    assert got.sources == {2: 0, 3: 1, 4: 0, 5: 1}


def test_ranks_that_registered_or_grouped_differently_are_told_alike():
    with pytest.raises(ValueError, match="registered different objects"):
        check_alike([_held(names=("model",)), _held(names=("model", "optimizer"))])
    with pytest.raises(ValueError, match="passed different replica_groups"):
        check_alike([_held(groups=((0, 1),)), _held(groups=((0,), (1,)))])
    check_alike([_held(), _held()])
    check_alike([_held(), _held(groups=((0, 1),))])  # None is one group of every rank


@pytest.mark.parametrize(
    ("groups", "says"),
    [
        ([[0, 1], [1, 2]], "(more than once: [1])"),
        ([[0, 1], [2, 3]], "(not ranks: 3)"),
        ([[0], [1]], "(missing: [2])"),
        ([[0, 1, 2], []], "in non-empty groups"),
        ([[np.int64(0), 1], [2]], "of type int64, not int)"),  # its repr differs by NumPy version
    ],
)
def test_replica_groups_must_cover_every_rank_once(groups, says):
    with pytest.raises(ValueError, match="replica_groups must cover the group's ranks 0..2") as err:
        replica_groups(groups, 3)
    assert says in str(err.value)
    assert replica_groups(None, 3) == [[0, 1, 2]]


def test_an_abandoned_course_does_not_come_back_before_the_new_course_commits():
    # a fallback began course 2 and nobody has committed since; a rank that missed it comes
    # back with course 1's commits: they are not handed over, the ranks fall back again
    everyone = [_held(course=2.0), _held(course=2.0), _held((9, 8), course=1.0)]
    assert plan(everyone, [[0, 1, 2]]) is None
    assert newest_step(everyone) is None
    assert new_course(everyone) > 2.0
