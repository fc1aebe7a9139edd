"""State, FrozenState and Mode: environment reading, freezing, rounds."""

from __future__ import annotations

import dataclasses
import os

import pytest

from nvrx.inprocess.state import FrozenState, Mode, State


def test_from_env_reads_rank_and_world_size_and_keeps_initial_values():
    state = State.from_env({"RANK": "3", "WORLD_SIZE": "8"})
    assert (state.rank, state.world_size) == (3, 8)
    assert (state.initial_rank, state.initial_world_size) == (3, 8)
    assert state.mode == Mode.INITIALIZED and state.iteration == 0
    assert State.from_env({}).rank == 0 and State.from_env({}).world_size == 1


@pytest.mark.parametrize(
    "env, match", [({"RANK": "x"}, "RANK"), ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4")]
)
def test_from_env_names_bad_values(env, match):
    with pytest.raises(ValueError, match=match):
        State.from_env(env)


def test_freeze_is_read_only_and_keeps_the_exception_object():
    err = RuntimeError("boom")
    state = State(rank=1, world_size=2, fn_exception=err)
    frozen = state.freeze()
    assert isinstance(frozen, FrozenState)
    assert frozen.fn_exception is err  # not a deep copy: traceback and identity kept
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.rank = 5
    state.rank = 0
    assert frozen.rank == 1  # a snapshot, not a view
    assert frozen.thaw() == dataclasses.replace(state, rank=1)


def test_advance_moves_to_next_round_and_forgets_the_exception():
    state = State(rank=0, world_size=1, fn_exception=ValueError())
    state.advance()
    assert state.iteration == 1 and state.fn_exception is None


def test_copy_from_selected_fields_and_unknown_field_named():
    a = State(rank=0, world_size=4)
    b = State(rank=2, world_size=3, iteration=5).freeze()
    a.copy_from(b, fields=["iteration"])
    assert (a.rank, a.iteration) == (0, 5)
    with pytest.raises(ValueError, match="nope"):
        a.copy_from(b, fields=["nope"])


def test_set_distributed_vars_active_and_spare(monkeypatch):
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("WORLD_SIZE", "9")
    State(rank=3, world_size=4, active_rank=2, active_world_size=3).set_distributed_vars()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("2", "3")
    State(rank=3, world_size=4, active_rank=None, active_world_size=3).set_distributed_vars()
    assert "RANK" not in os.environ  # never the string 'None'
    assert os.environ["WORLD_SIZE"] == "3"
