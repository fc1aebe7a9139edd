"""Deprecated rank_filter names warn and behave like their rank_assignment counterparts."""

from __future__ import annotations

import pytest

from nvrx.inprocess import rank_filter
from nvrx.inprocess.state import Mode, State


def test_max_active_world_size_warns_and_filters_states():
    with pytest.warns(DeprecationWarning, match="rank_assignment.MaxActiveWorldSize"):
        flt = rank_filter.MaxActiveWorldSize(2)
    assert isinstance(flt, rank_filter.RankFilter)
    states = [flt(State(rank=r, world_size=4)) for r in range(4)]
    assert [s.mode for s in states] == [Mode.ACTIVE, Mode.ACTIVE, Mode.INACTIVE, Mode.INACTIVE]
    assert [s.active_rank for s in states] == [0, 1, None, None]
    assert {s.active_world_size for s in states} == {2}


@pytest.mark.parametrize(
    "cls", [rank_filter.ActiveWorldSizeDivisibleBy, rank_filter.WorldSizeDivisibleBy]
)
def test_divisible_by_warns_and_rounds_down(cls):
    with pytest.warns(DeprecationWarning, match="ActiveWorldSizeDivisibleBy"):
        flt = cls(divisor=3)
    states = [flt(State(rank=r, world_size=7)) for r in range(7)]
    assert {s.active_world_size for s in states} == {6}
    assert states[6].mode == Mode.INACTIVE and states[5].active_rank == 5


def test_bad_divisor_is_named():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="divisor"):
        rank_filter.ActiveWorldSizeDivisibleBy(0)
