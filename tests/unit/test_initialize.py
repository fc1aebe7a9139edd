"""RetryController limits, and the nested-restarter initialize step's events."""

from __future__ import annotations

import pytest

from nvrx import events
from nvrx.inprocess.exception import RestartAbort
from nvrx.inprocess.initialize import Initialize, RetryController
from nvrx.inprocess.nested_restarter import (
    NestedRestarterAborted,
    NestedRestarterHandlingCompleted,
    NestedRestarterHandlingStarting,
)
from nvrx.inprocess.state import State


def _state(**kw):
    base = dict(rank=0, world_size=4, active_world_size=4)
    base.update(kw)
    return State(**base).freeze()


def test_max_iterations_allows_exactly_that_many_rounds():
    ctl = RetryController(max_iterations=3)
    for iteration in range(3):
        assert ctl(_state(iteration=iteration)).iteration == iteration
    with pytest.raises(RestartAbort, match="max_iterations 3") as info:
        ctl(_state(iteration=3))
    assert info.value.exit_code == 130
    # the reference's fields come first, for callers that match them
    assert str(info.value).startswith(
        "state.iteration=3 self.max_iterations=3 state.world_size=4 self.min_world_size=1 "
        "state.active_world_size=4 self.min_active_world_size=1 "
    )


def test_min_world_sizes():
    ctl = RetryController(min_world_size=3, min_active_world_size=2)
    ctl(_state(world_size=3, active_world_size=2))
    with pytest.raises(RestartAbort, match="world_size 2 < min_world_size 3"):
        ctl(_state(world_size=2, active_world_size=2))
    with pytest.raises(RestartAbort, match="active_world_size 1 < min_active_world_size 2"):
        ctl(_state(world_size=3, active_world_size=1))


def test_no_limits_by_default_and_restart_abort_is_not_an_exception():
    RetryController()(_state(iteration=10_000, world_size=1, active_world_size=1))
    assert not issubclass(RestartAbort, Exception)
    assert isinstance(RetryController(), Initialize)


@pytest.mark.parametrize(
    "kwargs, name",
    [({"max_iterations": -1}, "max_iterations"), ({"min_world_size": 0}, "min_world_size"),
     ({"min_active_world_size": "2"}, "min_active_world_size")],
)  # fmt: skip
def test_bad_limits_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RetryController(**kwargs)


def test_nested_restarter_steps_emit_events_on_the_special_rank_only(tmp_path):
    events.configure("app", directory=tmp_path, job="t", rank=0)
    init = NestedRestarterHandlingCompleted()
    init(_state(rank=0))
    init(_state(rank=0, iteration=1))
    init(_state(rank=1))  # not the special rank: silent
    NestedRestarterHandlingStarting()(_state(rank=0))
    NestedRestarterAborted(special_rank=None)(_state(rank=2))
    got, stats = events.read_dir(tmp_path)
    assert not stats.skipped
    assert [(e["state"], e["stage"]) for e in got if e["kind"] == "restarter_state"] == [
        ("initialize", None),
        ("handling", "completed"),
        ("handling", "starting"),
        ("aborted", None),
    ]
