"""nested_restarter: the lines for an outer restarter, the callback's parameters, and the events."""

from __future__ import annotations

import pytest

from nvrx import events
from nvrx.inprocess.abort import Abort
from nvrx.inprocess.completion import Completion
from nvrx.inprocess.initialize import Initialize
from nvrx.inprocess.nested_restarter import (
    NestedRestarterAborted,
    NestedRestarterCallback,
    NestedRestarterFinalized,
    NestedRestarterHandlingCompleted,
    NestedRestarterHandlingStarting,
    NestedRestarterLogger,
    shared_logger,
)
from nvrx.inprocess.state import State
from nvrx.inprocess.terminate import Terminate

LINE = "[NestedRestarter] name=[InProcess] state="


def _state(rank=0, initial_rank=None, active_rank=0):
    return State(
        rank=rank, world_size=4, initial_rank=initial_rank, active_rank=active_rank
    ).freeze()


def _lines(capsys):
    return [ln for ln in capsys.readouterr().out.splitlines() if "[NestedRestarter]" in ln]


def test_callback_prints_state_and_stage_on_the_special_initial_rank(capsys, tmp_path):
    events.configure("app", directory=tmp_path, job="t", rank=0)
    NestedRestarterCallback("handling", "processing")(_state(rank=2, initial_rank=0))
    NestedRestarterCallback("handling")(_state(rank=0, initial_rank=1))  # not the special rank
    NestedRestarterCallback("finalized", special_rank=None)(_state(rank=3))
    lines = _lines(capsys)
    assert len(lines) == 2
    assert lines[0].endswith(LINE + "handling stage=processing") and "[ALWAYS]" in lines[0]
    assert lines[1].endswith(LINE + "finalized") and "[InprocessRestarter.Restarter]" in lines[1]
    got, _ = events.read_dir(tmp_path)
    assert [(e["state"], e["stage"]) for e in got if e["kind"] == "restarter_state"] == [
        ("handling", "processing"),
        ("finalized", None),
    ]


def test_the_four_steps_are_the_plugins_they_are_wired_as(capsys, tmp_path):
    events.configure("app", directory=tmp_path, job="t", rank=0)
    init = NestedRestarterHandlingCompleted()
    steps = [
        (init, Initialize),
        (NestedRestarterHandlingStarting(), Abort),
        (NestedRestarterFinalized(), Completion),
        (NestedRestarterAborted(), Terminate),
    ]
    for step, base in steps:
        assert isinstance(step, base) and isinstance(step, NestedRestarterCallback)
    state = _state()
    for step, _ in steps:
        assert step(state) is state
    init(state)
    assert [ln.split(LINE, 1)[1] for ln in _lines(capsys)] == [
        "initialize",
        "handling stage=starting",
        "finalized",
        "aborted",
        "handling stage=completed",
    ]


def test_reference_parameters_and_an_own_logger(capsys, tmp_path):
    events.configure("app", directory=tmp_path, job="t", rank=0)
    own = NestedRestarterLogger()
    step = NestedRestarterHandlingStarting(logger=own, special_rank=1)
    assert (step.restarter_state, step.restarter_stage) == ("handling", "starting")
    step(_state(initial_rank=1))
    assert _lines(capsys)[0].endswith(LINE + "handling stage=starting")
    assert NestedRestarterFinalized().restarter_state == "finalized"
    assert NestedRestarterAborted(special_rank=3).special_rank == 3
    assert shared_logger() is shared_logger()
    assert isinstance(shared_logger(), NestedRestarterLogger)


def test_the_logger_does_not_propagate_and_prints_the_references_prefix(capsys):
    logger = NestedRestarterLogger()
    assert logger.propagate is False and logger.name == "InprocessRestarter"
    logger.set_connected_rank(5)
    assert logger.rank == 5
    logger.log_for_restarter("hello %s", "there")
    out = capsys.readouterr().out
    assert out.rstrip().endswith("] [ALWAYS] [InprocessRestarter.Restarter] hello there"), out


@pytest.mark.parametrize("cls", [NestedRestarterHandlingStarting, NestedRestarterFinalized])
def test_dataclass_fields_keep_their_reference_order(cls):
    step = cls("s", "t", None, 2)
    assert (step.restarter_state, step.restarter_stage, step.logger, step.special_rank) == (
        "s", "t", None, 2,
    )  # fmt: skip
