"""submitit's checkpoint protocol in a submitted callable's process (``CheckpointGuard``).

Each test runs the callable in this process's main thread, as ``run_callable`` does;
the callable raises the job's flag itself (what the supervisor does on SLURM's
warning) and then trains on without looking at it, until the guard stops it.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from submitit.core.utils import DelayedSubmission
from submitit.helpers import Checkpointable

from nvrx.checkpoint_flag import write_flag
from nvrx.submission import checkpointing, run_callable
from nvrx.submission.call_spec import dump_spec, load_spec
from nvrx.submission.checkpointing import CheckpointGuard, CheckpointStop, checkpoint_method
from nvrx.submission.run_callable import read_outcome
from nvrx.supervisor.preemption import PreemptionHandler

BOUND_S = 30.0  # a callable the guard failed to stop returns after this


def resumed(step: int, note: str = "") -> dict:
    return {"resumed_from": step, "note": note}


class Trainer(Checkpointable):
    """Counts steps in its state; raises the flag at step 3; never polls the flag."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag
        self.step = 0

    def __call__(self, total: int) -> dict:
        deadline = time.monotonic() + BOUND_S
        while self.step < total and time.monotonic() < deadline:
            self.step += 1
            if self.step == 3:
                write_flag(self.flag, {"cause": "time_limit"})
            time.sleep(0.01)
        return {"finished_at": self.step}


class Moves(Trainer):
    """``__submitit_checkpoint__`` wins over ``checkpoint``, as in submitit."""

    def checkpoint(self, total: int) -> DelayedSubmission:
        raise AssertionError("submitit calls __submitit_checkpoint__ first")

    def __submitit_checkpoint__(self, total: int) -> DelayedSubmission:
        assert threading.current_thread() is threading.main_thread()
        return DelayedSubmission(resumed, self.step, note=f"of {total}")


class Refuses(Trainer):
    def checkpoint(self, total: int) -> None:
        return None


class Polls(Trainer):
    """Returns by itself once the flag is there (what nvrx.preemption_requested() tells)."""

    def __call__(self, total: int) -> dict:
        while not self.flag.exists():
            self.step += 1
            if self.step == 3:
                write_flag(self.flag, {"cause": "preemption"})
        return {"stopped_at": self.step}


class Raises(Trainer):
    def checkpoint(self, total: int) -> None:
        raise OSError("disk full")


HELD = threading.Lock()  # stands for the event writer's lock


class HoldsLock(Trainer):
    """Trains holding ``HELD``, as code inside ``emit`` holds the writer's lock."""

    def __call__(self, total: int) -> dict:
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            with HELD:
                self.step += 1
                if self.step == 3:
                    write_flag(self.flag, {"cause": "time_limit"})
                time.sleep(0.01)
        return {"finished_at": self.step}


class ReturnsUnpicklable(Trainer):
    def checkpoint(self, total: int) -> DelayedSubmission:
        return DelayedSubmission(resumed, threading.Lock())


@pytest.fixture
def saves(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The checkpoint events the guard writes (here: kept in a list)."""
    seen: list[Any] = []
    monkeypatch.setattr(checkpointing, "record_checkpoint", lambda path, step: seen.append(path))
    return seen


def _run(fn: Any, args: tuple, tmp_path: Path, rank: int = 0) -> tuple[Any, CheckpointGuard]:
    spec = dump_spec(tmp_path / "spec.pkl", fn, args, {})
    guard = CheckpointGuard(fn, args, {}, spec, rank, flag=tmp_path / "preempt" / "r0.flag")
    started = time.monotonic()
    try:
        with guard:
            return fn(*args), guard
    except CheckpointStop:
        assert time.monotonic() - started < BOUND_S / 2  # stopped, not run to its bound
        return CheckpointStop, guard


def _record(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "preempt" / "r0.checkpoint").read_text())


def test_checkpointable_is_stopped_and_its_state_is_what_the_next_run_loads(
    tmp_path: Path, saves: list
) -> None:
    outcome, _ = _run(Trainer(tmp_path / "preempt" / "r0.flag"), (10**9,), tmp_path)
    assert outcome is CheckpointStop
    fn, args, kwargs = load_spec(tmp_path / "spec.pkl")
    assert isinstance(fn, Trainer) and fn.step >= 3 and args == (10**9,) and kwargs == {}
    assert _record(tmp_path)["requeue"] is True
    assert saves == [tmp_path / "spec.pkl"]


def test_submitit_checkpoint_replaces_the_call(tmp_path: Path, saves: list) -> None:
    outcome, _ = _run(Moves(tmp_path / "preempt" / "r0.flag"), (10**9,), tmp_path)
    assert outcome is CheckpointStop
    fn, args, kwargs = load_spec(tmp_path / "spec.pkl")
    value = fn(*args, **kwargs)
    assert value["resumed_from"] >= 3 and value["note"] == f"of {10**9}"
    assert "the next run calls resumed" in _record(tmp_path)["reason"]


def test_none_refuses_the_requeue_and_the_decider_says_so(tmp_path: Path, saves: list) -> None:
    flag = tmp_path / "preempt" / "r0.flag"
    handler = PreemptionHandler(
        tmp_path, 0, 1, slurm=False, local_requeue=True, preempt_window_s=5, export_env=False
    )
    handler.start()
    outcome, _ = _run(Refuses(flag), (10**9,), tmp_path)
    assert outcome is CheckpointStop
    fn, _, _ = load_spec(tmp_path / "spec.pkl")
    assert isinstance(fn, Refuses) and fn.step == 0  # the spec is the one submitted
    assert _record(tmp_path)["requeue"] is False and saves == []
    handler.on_signal(signal.SIGUSR2)
    decision = handler.act(lambda exit_by: None)
    assert not decision.requeued and decision.exit_code == 128 + signal.SIGUSR2
    assert decision.reason == (
        "not requeued: the submitted callable's checkpoint returned None (no requeue)"
    )
    assert handler.ledger.count() == 0


def test_a_callable_that_returns_on_the_flag_is_checkpointed_after(
    tmp_path: Path, saves: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(CheckpointGuard, "_watch", lambda self: None)  # it looked before the flag
    outcome, _ = _run(Polls(tmp_path / "preempt" / "r0.flag"), (10**9,), tmp_path)
    assert outcome == {"stopped_at": 3}
    fn, _, _ = load_spec(tmp_path / "spec.pkl")
    assert isinstance(fn, Polls) and fn.step == 3
    assert _record(tmp_path)["requeue"] is True


def test_a_failing_checkpoint_refuses_and_keeps_its_error(tmp_path: Path, saves: list) -> None:
    outcome, guard = _run(Raises(tmp_path / "preempt" / "r0.flag"), (10**9,), tmp_path)
    assert outcome is CheckpointStop
    assert isinstance(guard.error, OSError)
    assert "raised OSError('disk full')" in _record(tmp_path)["reason"]


def test_other_ranks_stop_once_rank_0_recorded_its_checkpoint(tmp_path: Path, saves: list) -> None:
    flag = tmp_path / "preempt" / "r0.flag"
    write_flag(flag, {"cause": "preemption"})  # raised, but rank 0 has not checkpointed yet
    record = tmp_path / "preempt" / "r0.checkpoint"

    class Rank1(Trainer):
        def __call__(self, total: int) -> dict:
            deadline = time.monotonic() + BOUND_S
            while time.monotonic() < deadline:
                self.step += 1
                if self.step == 20:  # well after the guard's first look at the flag
                    record.write_text(json.dumps({"requeue": True, "reason": "rank 0 did"}))
                time.sleep(0.05)
            return {"finished_at": self.step}

    trainer = Rank1(flag)
    outcome, _ = _run(trainer, (10**9,), tmp_path, rank=1)
    assert outcome is CheckpointStop
    assert trainer.step >= 20  # stopped once the record was there, not on the flag alone
    fn, _, _ = load_spec(tmp_path / "spec.pkl")
    assert fn.step == 0 and saves == []  # only rank 0 checkpoints


def test_checkpoint_method_lookup() -> None:
    assert checkpoint_method(Moves(Path("x"))).__name__ == "__submitit_checkpoint__"
    assert checkpoint_method(Trainer(Path("x"))).__name__ == "checkpoint"
    assert checkpoint_method(resumed) is None
    with pytest.raises(TypeError, match="has no __submitit_checkpoint__ or checkpoint method"):
        CheckpointGuard(resumed, (), {}, "spec.pkl", 0, flag=Path("f"))


def test_an_unsavable_checkpoint_refuses_and_keeps_the_spec(tmp_path: Path, saves: list) -> None:
    outcome, guard = _run(ReturnsUnpicklable(tmp_path / "preempt" / "r0.flag"), (10**9,), tmp_path)
    assert outcome is CheckpointStop and isinstance(guard.error, TypeError)
    record = _record(tmp_path)
    assert record["requeue"] is False and "cannot be saved as the next run's" in record["reason"]
    fn, _, _ = load_spec(tmp_path / "spec.pkl")
    assert isinstance(fn, ReturnsUnpicklable) and fn.step == 0 and saves == []


def test_the_checkpoint_event_waits_for_a_lock_the_interrupted_code_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interrupt lands where training holds a lock (the event writer's, when it emits); the
    checkpoint event, which needs that lock, is written once the call has been left."""

    def record_checkpoint(path: Path, step: None) -> None:
        assert HELD.acquire(timeout=5), "the event was written while the interrupted code held it"
        HELD.release()

    monkeypatch.setattr(checkpointing, "record_checkpoint", record_checkpoint)
    outcome, _ = _run(HoldsLock(tmp_path / "preempt" / "r0.flag"), (10**9,), tmp_path)
    assert outcome is CheckpointStop and _record(tmp_path)["requeue"] is True


def test_a_sigwinch_handler_of_the_process_still_works_and_is_restored(
    tmp_path: Path, saves: list
) -> None:
    """Outside a warning the handler there before the guard gets the signal; after, it is back."""
    got: list[int] = []

    def resized(signum: int, frame: object) -> None:
        got.append(signum)

    before = signal.signal(signal.SIGWINCH, resized)
    try:
        flag = tmp_path / "preempt" / "r0.flag"
        with CheckpointGuard(Trainer(flag), (1,), {}, tmp_path / "spec.pkl", 0, flag=flag):
            signal.raise_signal(signal.SIGWINCH)  # a terminal resize, not the guard's interrupt
        assert got == [signal.SIGWINCH]
        assert signal.getsignal(signal.SIGWINCH) is resized  # restored
    finally:
        signal.signal(signal.SIGWINCH, before)


def test_a_callable_that_takes_sigwinch_over_is_checkpointed_when_it_returns(
    tmp_path: Path, saves: list, caplog: pytest.LogCaptureFixture
) -> None:
    class TakesItOver(Trainer):
        def __call__(self, total: int) -> dict:
            interrupted = threading.Event()
            signal.signal(signal.SIGWINCH, lambda signum, frame: interrupted.set())
            write_flag(self.flag, {"cause": "time_limit"})
            assert interrupted.wait(BOUND_S)  # the guard's interrupt reached its handler instead
            return {"finished_at": self.step}

    with caplog.at_level(logging.WARNING, logger=checkpointing.__name__):
        outcome, _ = _run(TakesItOver(tmp_path / "preempt" / "r0.flag"), (1,), tmp_path)
    assert outcome == {"finished_at": 0} and _record(tmp_path)["requeue"] is True
    assert saves == [tmp_path / "spec.pkl"]
    assert "the callable replaced nvrx's SIGWINCH handler: rank 0 stops only when it returns" in (
        caplog.text
    )
    assert signal.getsignal(signal.SIGWINCH) == signal.SIG_DFL  # the guard's is not left behind


@pytest.mark.parametrize(("trainer", "code"), [(Trainer, 0), (Raises, 1)])
def test_run_callable_ends_a_checkpointed_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saves: list, trainer: type, code: int
) -> None:
    """Stopped for a checkpoint: exit 0 and no result; a checkpoint that raised: exit 1, its error."""
    flag = tmp_path / "preempt" / "r0.flag"
    monkeypatch.setenv("NVRX_PREEMPT_FLAG", str(flag))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(run_callable.RESULT_DIR_ENV, str(tmp_path / "results"))
    spec = dump_spec(tmp_path / "spec.pkl", trainer(flag), (10**9,), {})
    assert run_callable.main([str(spec)]) == code
    outcome = read_outcome(tmp_path / "results", 0)
    if code == 0:
        assert outcome is None
    else:
        assert outcome is not None and outcome[0] == "error" and "disk full" in outcome[1]
