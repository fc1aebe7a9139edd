"""The supervisor's course: only the moves of the transition table are made, and every state can be reached and left."""

from __future__ import annotations

import pytest

from nvrx.supervisor.course import TRANSITIONS, Course, CourseTracker, IllegalMove


def _reachable(start: Course) -> set[Course]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_table_names_every_state() -> None:
    assert set(TRANSITIONS) == set(Course)


def test_every_state_is_reachable_from_the_start() -> None:
    assert _reachable(Course.STARTING) == set(Course)


@pytest.mark.parametrize("state", list(Course))
def test_every_state_can_end(state: Course) -> None:
    assert Course.ENDED in _reachable(state)


def test_an_illegal_move_raises_and_keeps_the_state() -> None:
    course = CourseTracker()
    course.to(Course.TRAINING)
    course.to(Course.STOPPING)
    with pytest.raises(IllegalMove, match="from STOPPING to TRAINING"):
        course.to(Course.TRAINING)
    assert course.state is Course.STOPPING and course.stopping


@pytest.mark.parametrize("state", list(Course))
def test_each_move_follows_the_table(state: Course) -> None:
    for new in Course:
        course = CourseTracker()
        course.state = state
        if new in TRANSITIONS[state]:
            course.to(new)
            assert course.state is new
        else:
            with pytest.raises(IllegalMove):
                course.to(new)
            assert course.state is state


def test_a_failover_returns_to_the_state_it_interrupted() -> None:
    for state in (Course.TRAINING, Course.SPARE, Course.RESTARTING, Course.FINISHING):
        assert Course.FAILING_OVER in TRANSITIONS[state]
        assert state in TRANSITIONS[Course.FAILING_OVER]


def test_nothing_leaves_the_end() -> None:
    assert TRANSITIONS[Course.ENDED] == frozenset()
