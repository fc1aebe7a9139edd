"""A restart round's outcome (round_run.RoundRun) and what follows it (round_run.restart, leave).

The round runs against a real TCPStore; the Wrapper around it (``CallWrapper``),
its monitor thread and the restart ``Delivery`` are stand-ins, so each test
decides when the restart request comes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import threading
import time
import traceback
from types import SimpleNamespace
from typing import Any

import pytest

from nvrx.inprocess import rejoin, round_run
from nvrx.inprocess import store as rstore
from nvrx.inprocess.compose import Compose
from nvrx.inprocess.exception import HealthCheckError, InternalError, RestartAbort
from nvrx.inprocess.monitor_thread import RESTART_WAIT_S, Delivery, MonitorThread, RankShouldRestart
from nvrx.inprocess.progress_watchdog import FLAG_BETWEEN, FLAG_RELEASED, FLAG_TIMEOUTS_OFF
from nvrx.inprocess.rank_assignment import (
    ActivateAllRanks,
    RankAssignment,
    RankAssignmentCtx,
    ShiftRanks,
)
from nvrx.inprocess.rank_filter import with_rank_filter
from nvrx.inprocess.round_run import Completed, Leave, Restart, RoundRun
from nvrx.inprocess.state import Mode, State
from nvrx.inprocess.terminate import Terminate
from nvrx.node_agent.rank_wire import HostBarrierClient
from nvrx.store import barrier as nvrx_barrier
from nvrx.store import client, rounds


class FakeDelivery:
    """The restart request comes after ``timeouts`` waits for it ran out."""

    def __init__(self, timeouts: int = 0) -> None:
        self.timeouts = timeouts
        self.waits = 0
        self.requested = threading.Event()  # set where the monitor thread asked for the restart

    def enter_user(self) -> None: ...
    def leave_user(self) -> None: ...
    def begin_wait(self) -> None: ...
    def caught(self) -> None: ...
    def settle(self) -> None: ...

    def await_restart(self, timeout: float) -> None:
        self.waits += 1
        if self.waits <= self.timeouts:
            raise InternalError(f"no restart request within {timeout:g} s")
        self.requested.set()
        raise RankShouldRestart("a rank faulted: restarting")


class FlakyStore:
    """A round store whose first ``fail`` fault writes (``append``) raise."""

    def __init__(self, store, fail: int = 0) -> None:
        self._store = store
        self.fail = fail

    def append(self, key, value):
        if self.fail:
            self.fail -= 1
            raise RuntimeError("store write failed")
        return self._store.append(key, value)

    def __getattr__(self, name):
        return getattr(self._store, name)


class FakeBoard:
    """The progress board's flags and wait limit, without the shared memory."""

    def __init__(self) -> None:
        self.flags = 0
        self.round = 0
        self.wait_limit: float | None = None  # that of the wait for peers the rank is in
        self.waits: list[float] = []  # each wait's limit, in order

    def read(self) -> dict[str, float]:
        return {"flags": float(self.flags), "round": float(self.round)}

    def set_flag(self, flag: int, on: bool) -> None:
        self.flags = (self.flags | flag) if on else (self.flags & ~flag)

    def enter_user(self) -> None:
        pass

    def leave_user(self) -> None:
        pass

    @contextlib.contextmanager
    def between_rounds(self):
        self.set_flag(FLAG_BETWEEN, True)
        try:
            yield
        finally:
            self.set_flag(FLAG_BETWEEN, False)

    @contextlib.contextmanager
    def waiting(self, limit_s: float):
        self.wait_limit = limit_s
        self.waits.append(limit_s)
        try:
            yield
        finally:
            self.wait_limit = None


class FakeCall:
    """What a round (``round_run``) uses of a ``CallWrapper``."""

    def __init__(self, base, world_size: int = 1, **wrapper) -> None:
        seconds = SimpleNamespace(  # the Wrapper's timings, as a call reads them
            monitor_thread_interval=0.1,
            completion_timeout=5.0,
            barrier_timeout=5.0,
            last_call_wait=0.0,
            rejoin_timeout=0.0,
            monitor_process_interval=0.05,
        )
        self.wrapper = SimpleNamespace(
            initialize=None,
            health_check=None,
            finalize=None,
            terminate=None,
            rank_filter=None,
            seconds=seconds,
        )
        for name, value in wrapper.items():
            setattr(seconds if hasattr(seconds, name) else self.wrapper, name, value)
        self.assignment = with_rank_filter(getattr(self.wrapper, "rank_assignment", None), None)
        self.state = State(
            rank=0,
            world_size=world_size,
            active_rank=0,
            active_world_size=world_size,
            initial_rank=0,
            initial_world_size=world_size,
            mode=Mode.ACTIVE,
        )
        self.services = SimpleNamespace(
            base_store=base, board=FakeBoard(), check_monitor=lambda: None,
            barriers=HostBarrierClient(None),  # no host agent: at the store itself
        )  # fmt: skip
        self.delivery = FakeDelivery()
        self.round = self.generation = 0
        self.round_store = rstore.round_store(base, 0)
        self.events: list[tuple[str, dict]] = []
        self.fail_on: str | None = None  # an event kind whose emit raises
        self.pending_latency_from: float | None = None
        self.initial_world_size = world_size
        self.writer = SimpleNamespace(update=lambda **fields: None)

    def emit(self, kind: str, **fields) -> None:
        if kind == self.fail_on:
            raise OSError(f"cannot write the {kind} event")
        self.events.append((kind, fields))

    def kinds(self, kind: str) -> list[dict]:
        return [fields for k, fields in self.events if k == kind]

    @contextlib.contextmanager
    def phase(self, phase: str):
        yield

    def arguments_for(self, fn, args, kwargs):
        return args, kwargs

    def enter_round(self, round_: int) -> None:
        self.round = round_
        self.round_store = rstore.round_store(self.services.base_store, round_)


def _monitor():
    """A monitor thread that has woken: the restart came from it."""
    woke = threading.Event()
    woke.set()
    return SimpleNamespace(
        seen_mono=None, abort_s=0.0, abort_ok=True, join=lambda timeout: None, error=None,
        woke=woke, stop=threading.Event(),
    )  # fmt: skip


def _run(call, store=None) -> RoundRun:
    return RoundRun(call, store if store is not None else call.round_store, _monitor(), time.monotonic())


def _fails():
    raise RuntimeError("own fault")


# -- RoundRun ---------------------------------------------------------------------------
def test_a_round_that_returns_completes(base):
    call = FakeCall(base)
    outcome = _run(call).run(lambda: 5, (), {})
    assert outcome == Completed(5)
    assert [e["outcome"] for e in call.kinds("round_end")] == ["completed"]


def test_a_fault_restarts_the_round_with_this_ranks_fault(base):
    call = FakeCall(base)
    outcome = _run(call).run(_fails, (), {})
    assert isinstance(outcome, Restart) and str(outcome.fault) == "own fault"
    assert [r.kind for r in rstore.fault_records(call.round_store)] == ["exception"]


class _Unprintable(Exception):
    """A user's exception whose ``__str__`` fails (it reads an attribute never set)."""

    def __str__(self) -> str:
        return self.detail  # type: ignore[attr-defined]


def test_a_fault_whose_message_cannot_be_made_still_restarts_the_round_on_its_record(base):
    """Before, the ``AttributeError`` of its ``__str__`` escaped the fault's record: the rank
    left the job, blaming that error, and nothing told the other ranks."""

    def fails() -> None:
        raise _Unprintable()

    call = FakeCall(base)
    outcome = _run(call).run(fails, (), {})
    assert isinstance(outcome, Restart) and isinstance(outcome.fault, _Unprintable)
    [record] = rstore.fault_records(call.round_store)
    assert record.exc_type.endswith("_Unprintable") and "str() failed: AttributeError" in record.message
    assert rounds.interruption(call.round_store) == "fault"


def test_a_restart_the_function_raises_while_handling_an_error_records_no_fault(base):
    """``except KeyError: raise RankShouldRestart(...)``: the function asks for a restart of
    its own, which interrupts nobody (before, the ``KeyError`` it handled was recorded as
    this rank's fault and every rank restarted)."""

    def asks() -> None:
        try:
            {}["missing"]
        except KeyError:
            raise RankShouldRestart("the function asks") from None

    call = FakeCall(base)
    outcome = _run(call).run(asks, (), {})
    assert isinstance(outcome, Restart) and outcome.fault is None
    assert rstore.fault_records(call.round_store) == []
    assert rounds.interruption(call.round_store) is None


def test_a_requested_restart_that_cuts_an_error_short_records_that_error(base):
    """The monitor thread's restart lands while the function's own error unwinds (in a
    ``finally`` of the function): that error is this rank's fault, on record."""
    call = FakeCall(base)

    def cut_short() -> None:
        try:
            raise ValueError("own fault")
        finally:
            call.delivery.requested.set()  # as the monitor thread does before it raises
            raise RankShouldRestart("a rank faulted: restarting")  # noqa: B012

    outcome = _run(call).run(cut_short, (), {})
    assert isinstance(outcome, Restart) and str(outcome.fault) == "own fault"
    assert [r.kind for r in rstore.fault_records(call.round_store)] == ["exception"]


def test_the_main_thread_that_took_the_restart_tells_kept_state_of_the_fault(base, monkeypatch):
    """A commit the main thread queued after the monitor thread's last look at kept state
    is caught here: no commit follows the restart taken."""
    told: list[float] = []
    monkeypatch.setattr(round_run, "tell_kept_state", told.append)
    before = time.monotonic()
    assert isinstance(_run(FakeCall(base)).run(_fails, (), {}), Restart)
    assert len(told) == 1 and told[0] >= before  # the monitor saw none: the time it is taken


def test_a_restart_request_later_than_the_wait_still_restarts(base):
    """An abort slower than RESTART_WAIT_S, and a first store write that failed."""
    call = FakeCall(base)
    call.delivery = FakeDelivery(timeouts=1)
    run = _run(call, FlakyStore(call.round_store, fail=1))
    outcome = run.run(_fails, (), {})
    assert isinstance(outcome, Restart) and str(outcome.fault) == "own fault"
    assert call.delivery.waits == 2
    assert run.recorded  # written on the second attempt, with one event only
    assert [r.message for r in rstore.fault_records(call.round_store)] == ["own fault"]
    assert [e["fault_kind"] for e in call.kinds("fault")] == ["exception"]


def test_a_restart_by_a_failed_monitor_thread_is_put_on_record_as_this_ranks_fault(base):
    """The round's monitor thread failed on its store connection and restarted this rank
    (the main thread took the restart in its function): nothing else tells the other ranks,
    so the main thread records it, naming the failure, and the round is interrupted."""
    from torch.distributed import DistNetworkError

    call = FakeCall(base)
    run = _run(call)
    run.monitor.error = DistNetworkError("Failed to recv, got 0 bytes")

    def restarted():
        raise RankShouldRestart("monitor thread failed")

    outcome = run.run(restarted, (), {})
    assert isinstance(outcome, Restart) and isinstance(outcome.fault, InternalError)
    [record] = rstore.fault_records(call.round_store)
    assert record.kind == "exception" and "monitor thread lost its store connection" in record.message
    assert "DistNetworkError" in record.message
    assert rounds.interruption(call.round_store) == "fault"


def test_a_monitor_thread_that_failed_after_seeing_a_peers_fault_records_nothing_of_its_own(base):
    """The thread saw rank 1's fault (``seen_mono``), then its store connection broke as it
    woke the others: the round is interrupted for every rank already, by rank 1, so this
    rank's restart (taken in its function, which raised nothing) puts nothing of its own on
    record, as a restart for a peer's fault does."""
    from torch.distributed import DistNetworkError

    call = FakeCall(base)
    rstore.record_fault(call.round_store, rstore.failures.FaultRecord(rank=1, kind="exception"))
    run = _run(call)
    run.monitor.seen_mono = time.monotonic()
    run.monitor.error = DistNetworkError("Failed to recv, got 0 bytes")

    def restarted():
        raise RankShouldRestart("monitor thread failed")

    outcome = run.run(restarted, (), {})
    assert isinstance(outcome, Restart) and outcome.fault is None
    assert [r.rank for r in rstore.fault_records(call.round_store)] == [1]
    assert call.kinds("fault") == []


def test_no_restart_request_after_two_waits_leaves(base):
    call = FakeCall(base)
    call.delivery = FakeDelivery(timeouts=2)
    outcome = _run(call).run(_fails, (), {})
    assert isinstance(outcome, Leave) and isinstance(outcome.exc, InternalError)
    assert outcome.recorded
    assert isinstance(outcome.exc.__context__.__context__, RuntimeError)  # the fault, chained


def test_a_failed_round_end_event_takes_the_leave_path(base):
    call = FakeCall(base)
    call.fail_on = "round_end"
    outcome = _run(call).run(lambda: 5, (), {})
    assert isinstance(outcome, Leave) and isinstance(outcome.exc, OSError)


def test_a_rank_whose_monitor_process_ended_leaves_before_its_function(base):
    call = FakeCall(base)
    ran = []

    def ended():
        raise RuntimeError("monitor process 7 exited with 1: this rank is not watched")

    call.services.check_monitor = ended
    outcome = _run(call).run(lambda: ran.append(1), (), {})
    assert isinstance(outcome, Leave) and "not watched" in str(outcome.exc)
    assert ran == [] and not outcome.recorded


def test_a_failed_monitor_join_takes_the_leave_path(base):
    call = FakeCall(base)
    run = _run(call)

    def join(timeout):
        raise RuntimeError("join failed")

    run.monitor.join = join
    outcome = run.run(lambda: 5, (), {})
    assert isinstance(outcome, Leave) and str(outcome.exc) == "join failed"


# -- between rounds ---------------------------------------------------------------------
def _restart(call, fault, signal=None):
    return round_run.restart(call, _run(call), Restart(fault, signal))


def test_restart_abort_in_finalize_records_the_exit_a_rejoin_leader_reads(base):
    def finalize(state):
        raise RestartAbort("stop here")

    call = FakeCall(base, world_size=2, finalize=finalize)
    round_store = call.round_store
    fault = RuntimeError("own fault")
    outcome = _restart(call, fault)
    assert isinstance(outcome, Leave) and isinstance(outcome.exc, RestartAbort)
    assert not outcome.recorded
    round_run.leave(call, round_store, outcome)  # before the decision: released nowhere
    assert not call.services.board.flags & FLAG_RELEASED
    exits = [r for r in rstore.fault_records(round_store) if r.kind == "exit"]
    assert [(r.rank, r.exc_type) for r in exits] == [(0, "nvrx.inprocess.exception.RestartAbort")]
    round_store.set(rounds.rank_state(0), json.dumps({"initial_rank": 0}))  # it started the round
    assert rounds.rejoin_candidates(round_store, base, {0}) == []  # no replacement is awaited for it
    assert [e["outcome"] for e in call.kinds("round_end")] == ["abort"]
    assert call.state.mode == Mode.TERMINATED


class _Looking(RankAssignment):
    """A rank assignment that waits for no peer, running ``look``."""

    def __init__(self, look: Any) -> None:
        self.look = look

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        return self.look(ctx)

    def peer_wait_s(self, barrier_timeout: float) -> float:
        return 0.0


def test_the_board_says_the_rank_is_between_rounds_and_names_each_waits_limit(base, monkeypatch):
    """From ``finalize`` to the rank assignment the monitor process watches the rank
    (``FLAG_BETWEEN``): ``finalize`` and the health check under no wait's limit, the
    iteration barrier and the rank assignment (which may wait for peers) under
    ``barrier_timeout``; once the rank is in the next round, or leaves, no longer."""
    monkeypatch.setattr(State, "set_distributed_vars", lambda self: None)
    seen: dict[str, tuple[bool, float | None]] = {}

    def look(name: str):
        def plug_in(arg):
            board = call.services.board
            seen[name] = (bool(board.flags & FLAG_BETWEEN), board.wait_limit)
            return arg

        return plug_in

    call = FakeCall(
        base, finalize=look("finalize"), health_check=look("health_check"),
        rank_assignment=look("rank_assignment"), barrier_timeout=7.0,
    )  # fmt: skip
    assert _restart(call, RuntimeError("own fault")) is None
    assert seen == {
        "finalize": (True, None),
        "health_check": (True, None),
        "rank_assignment": (True, 7.0),
    }
    board = call.services.board
    assert board.waits == [7.0, RESTART_WAIT_S, 7.0]  # the barrier, the monitor thread's end
    assert not board.flags & FLAG_BETWEEN and board.wait_limit is None

    # the default assignment waits for no peer: watched without a wait's limit
    assignment = look("rank_assignment")
    default = Compose(ActivateAllRanks(), ShiftRanks(), _Looking(assignment))
    call = FakeCall(base, rank_assignment=default, barrier_timeout=7.0)
    assert _restart(call, RuntimeError("own fault")) is None
    assert seen["rank_assignment"] == (True, None)
    assert call.services.board.waits == [7.0, RESTART_WAIT_S]

    def fails(state):
        raise ValueError("finalize failed")

    call = FakeCall(base, finalize=fails)
    assert isinstance(_restart(call, RuntimeError("own fault")), Leave)
    assert not call.services.board.flags & FLAG_BETWEEN  # its leave is not watched so


def test_a_rank_marked_gone_is_not_awaited_for_a_rejoin(base):
    """A lost node's rank that no spare takes over: survivors shrink at once instead of waiting."""
    round_store = rstore.round_store(base, 0)
    for rank in (0, 1, 2):
        round_store.set(rounds.rank_state(rank), json.dumps({"initial_rank": rank + 10}))
    base.set(rounds.rank_gone(11), "1")
    assert rounds.rejoin_candidates(round_store, base, {1, 2}) == [2]
    # a rank with no state in the round: nothing to admit a replacement with, none awaited
    assert rounds.rejoin_candidates(round_store, base, {2, 3}) == [2]


def test_an_exception_between_rounds_is_chained_to_the_rounds_fault(base):
    def finalize(state):
        raise ValueError("finalize failed")

    fault = RuntimeError("own fault")
    outcome = _restart(FakeCall(base, finalize=finalize), fault)
    assert isinstance(outcome, Leave) and outcome.exc.__context__ is fault
    text = "".join(traceback.format_exception(outcome.exc))
    assert "own fault" in text and "finalize failed" in text


def test_a_failed_health_check_is_chained_below_its_cause(base):
    def check(state):
        raise ValueError("sick")

    fault = RuntimeError("own fault")
    outcome = _restart(FakeCall(base, health_check=check), fault)
    assert isinstance(outcome.exc, HealthCheckError)
    assert outcome.exc.__cause__.__context__ is fault
    assert "own fault" in "".join(traceback.format_exception(outcome.exc))


def test_a_failed_finalize_or_health_check_is_caused_by_the_rounds_restart(base):
    """As in the reference: the exception that ends the rank between rounds has the round's
    ``RankShouldRestart`` as its cause (a health check's: below its ``HealthCheckError``)."""

    def finalize(state):
        raise ValueError("finalize failed")

    def check(state):
        raise ValueError("sick")

    fault = RuntimeError("own fault")
    signal = RankShouldRestart("a rank faulted: restarting")
    outcome = _restart(FakeCall(base, finalize=finalize), fault, signal)
    assert isinstance(outcome, Leave) and outcome.exc.__cause__ is signal
    outcome = _restart(FakeCall(base, health_check=check), fault, signal)
    assert isinstance(outcome.exc, HealthCheckError)
    assert str(outcome.exc.__cause__) == "sick" and outcome.exc.__cause__.__cause__ is signal


def test_a_restart_the_function_asked_for_ends_its_monitor_without_abort(base, monkeypatch):
    """The function raised ``RankShouldRestart`` itself: nothing interrupted the round, so its
    monitor thread did not wake. The restart goes on without waiting for it, runs no
    ``abort``, and the thread ends once every rank left the round."""
    monkeypatch.setattr(State, "set_distributed_vars", lambda self: None)
    aborts: list[Any] = []
    call = FakeCall(base, rank_assignment=lambda ctx: ctx)
    monitor = MonitorThread(
        rstore.round_store(client.connect("127.0.0.1", base.port, timeout=10), 0),
        Delivery(), aborts.append, call.state.freeze(),
    )  # fmt: skip
    monitor.start()
    run = RoundRun(call, call.round_store, monitor, time.monotonic())
    t0 = time.monotonic()
    assert round_run.restart(call, run, Restart(None, RankShouldRestart("asked"))) is None
    assert time.monotonic() - t0 < RESTART_WAIT_S
    assert not monitor.is_alive() and aborts == [] and call.round == 1


def test_a_restart_and_the_fault_behind_it_are_logged(base, caplog):
    call = FakeCall(base)
    with caplog.at_level(logging.INFO, logger="nvrx.inprocess"):
        outcome = _run(call).run(_fails, (), {})
        round_run.restart(call, _run(call), outcome)
    levels = [(r.name, r.levelname) for r in caplog.records]
    assert levels == [
        ("nvrx.inprocess.round_run", "ERROR"), ("nvrx.inprocess.round_run", "WARNING"),
    ], levels  # fmt: skip


def test_an_exception_after_a_peers_fault_is_logged_as_its_consequence(base, caplog):
    """The monitor thread saw the round interrupted (another rank's fault) and aborted the
    groups, so this rank's collective failed: a warning that says so, no error naming this
    rank as faulted, and the event calls it a ``peer`` fault (the report reads that)."""
    call = FakeCall(base)
    monitor = _monitor()
    monitor.seen_mono = time.monotonic()
    with caplog.at_level(logging.INFO, logger="nvrx.inprocess.round_run"):
        outcome = RoundRun(call, call.round_store, monitor, time.monotonic()).run(_fails, (), {})
    assert isinstance(outcome, Restart)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "rank 0 raised RuntimeError('own fault') in round 0 after the round was "
                    "interrupted, whose abort ends its collectives"),
    ]  # fmt: skip
    assert [e["fault_kind"] for e in call.kinds("fault")] == ["peer"]


def test_a_terminate_that_raises_is_raised_caused_by_the_exit(base):
    def terminate(state):
        raise OSError("terminate failed")

    call = FakeCall(base, terminate=terminate)
    stop = RestartAbort("stop here")
    left = round_run.leave(call, call.round_store, Leave(stop, False))
    assert isinstance(left, OSError) and left.__cause__ is stop
    assert round_run.leave(FakeCall(base), call.round_store, Leave(stop, True)) is stop


def test_finalize_that_reraises_the_fault_makes_no_cycle(base):
    fault = RuntimeError("own fault")

    def finalize(state):
        raise fault

    outcome = _restart(FakeCall(base, finalize=finalize), fault)
    assert outcome.exc is fault and fault.__context__ is None
    signal = RankShouldRestart("a rank faulted: restarting")
    signal.__cause__ = fault  # as ``RoundRun.run`` chains them
    outcome = _restart(FakeCall(base, finalize=finalize), fault, signal)
    assert outcome.exc is fault and fault.__cause__ is None


def _two_ranks(base, **wrapper) -> list[FakeCall]:
    """Ranks 0 and 1 of one round 0, each with a connection of its own; rank 0 faulted."""
    calls = [
        FakeCall(client.connect("127.0.0.1", base.port, timeout=10), world_size=2, **wrapper)
        for _ in range(2)
    ]
    for rank, call in enumerate(calls):
        call.state.rank = call.state.active_rank = call.state.initial_rank = rank
    rstore.record_fault(calls[0].round_store, rstore.failures.FaultRecord(rank=0, kind="exception"))
    return calls


def test_the_restart_goes_on_once_every_rank_reported_without_sleeping_last_call_wait(
    base, monkeypatch
):
    """The window for concurrent faults is the iteration barrier, not a fixed sleep.

    Two ranks with ``last_call_wait`` of an hour: both reach the next round as soon
    as both reported, and each sees both faults recorded before the last arrival.
    """
    monkeypatch.setattr(State, "set_distributed_vars", lambda self: None)
    calls = _two_ranks(base, last_call_wait=3600.0, rank_assignment=lambda ctx: ctx)
    outcomes: dict[int, Any] = {}

    def restart(rank: int) -> None:
        if rank == 1:  # a concurrent fault, recorded before this rank reports
            rstore.record_fault(calls[1].round_store, rstore.failures.FaultRecord(rank=1, kind="dead"))
        outcomes[rank] = _restart(calls[rank], RuntimeError(f"fault {rank}"))

    threads = [threading.Thread(target=restart, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)  # far below an hour: the restart did not sleep last_call_wait
    assert outcomes == {0: None, 1: None}
    decision = json.loads(rstore.round_store(base, 0).get(rounds.DECISION))
    assert decision["world_size"] == 2  # what a replacement's look reads
    for call in calls:
        assert call.round == 1
        assert call.services.board.flags & FLAG_RELEASED  # the decision kept it: says its board
        (end,) = call.kinds("round_end")
        assert sorted((f["rank"], f["kind"]) for f in end["faults"]) == [(0, "exception"), (1, "dead")]


def test_a_rank_released_into_the_next_round_that_leaves_leaves_that_round(base, monkeypatch):
    """Round 0's decision keeps both ranks; rank 1's rank assignment then raises. Round 1 counts
    rank 1, so rank 1 leaves round 1 (not round 0, which is over), once rank 0 started it:
    its exit is recorded there, and it arrives at round 1's iteration barrier for itself."""
    monkeypatch.setattr(State, "set_distributed_vars", lambda self: None)

    def assign(ctx):
        if ctx.state.rank == 1:
            raise RuntimeError("rank assignment failed")
        return ctx

    calls = _two_ranks(base, rank_assignment=assign)
    round_0 = rstore.round_store(base, 0)
    for rank, call in enumerate(calls):
        rounds.publish_rank_state(round_0, rank, call.state)  # round 0 started
    outcomes: dict[int, Any] = {}
    threads = [
        threading.Thread(target=lambda r=r: outcomes.update({r: _restart(calls[r], None)}))
        for r in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    left = outcomes[1]
    assert outcomes[0] is None and isinstance(left, Leave), outcomes
    assert calls[1].services.board.flags & FLAG_RELEASED
    leaving = threading.Thread(target=round_run.leave, args=(calls[1], round_0, left))
    leaving.start()
    round_1 = rstore.round_store(base, 1)
    rounds.publish_rank_state(round_1, 0, calls[0].state)
    round_1.add(rounds.STARTED, 1)  # rank 0 starts round 1 (``RoundRun.start``)
    leaving.join(30)
    assert not leaving.is_alive()
    exits = [(r.rank, r.message) for r in rstore.fault_records(round_1) if r.kind == "exit"]
    assert exits == [(1, "rank assignment failed")]
    assert not [r for r in rstore.fault_records(round_0) if r.kind == "exit"]
    assert rstore.terminated_ranks(round_1) == {1} and round_1.check([rounds.rank_state(1)])
    assert nvrx_barrier.has_arrived(round_1, rounds.ITERATION_BARRIER, 1)
    assert not calls[1].services.board.flags & FLAG_RELEASED


def test_a_rank_released_whose_rejoin_fails_leaves_the_next_round(base):
    """Round 0's decision kept both ranks; rank 0's ``take_back`` then raised (a store error),
    before it entered round 1: it enters round 1 to leave it, its events there too."""
    call = FakeCall(base, world_size=2)
    updates: list[dict] = []
    call.writer = SimpleNamespace(update=lambda **fields: updates.append(fields))
    round_0, round_1 = rstore.round_store(base, 0), rstore.round_store(base, 1)
    rounds.publish_rank_state(round_0, 0, call.state)
    round_0.set(rounds.DECISION, json.dumps({"terminated": [], "world_size": 2}))
    other = State(**{**vars(call.state), "rank": 1, "active_rank": 1, "initial_rank": 1})
    rounds.publish_rank_state(round_1, 1, other)
    round_1.add(rounds.STARTED, 1)  # the other rank started round 1
    call.services.board.set_flag(FLAG_RELEASED, True)
    round_run.leave(call, round_0, Leave(ConnectionError("store write failed"), False))
    assert call.round == 1 and updates == [{"round": 1, "rank": 0}]
    exits = [r.rank for r in rstore.fault_records(round_1) if r.kind == "exit"]
    assert exits == [0] and rstore.terminated_ranks(round_1) == {0}
    assert not rstore.terminated_ranks(round_0)


def test_a_job_without_a_round_takes_nobody_back() -> None:
    from torch.distributed import HashStore

    from nvrx.store import rounds

    store = HashStore()
    assert rounds.current_round(store) is None  # no round yet: start a generation
    rounds.publish_round(store, 3)
    assert rounds.current_round(store) is not None


def _admission() -> rounds.Admission:
    return rounds.Admission(generation=0, round=4, state={}, terminated=[], job_restarts=1)


def _answer_after(store: Any, delay: float) -> threading.Thread:
    """A survivor that admits the pending replacement of initial rank 1 after ``delay``."""

    def run() -> None:
        store.wait([rounds.join_request(1)], datetime.timedelta(seconds=10))
        join_id = int(store.get(rounds.join_request(1)))
        time.sleep(delay)  # a survivor busy restarting
        store.set(rounds.admission(1, join_id), _admission().to_json())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _restarted_job(terminated: list[int] | None, world_size: int = 2):
    """A job in round 3 after a restart whose iteration barrier decided ``terminated``
    (None: round 2's barrier has not released yet)."""
    from torch.distributed import HashStore

    from nvrx.store import rounds

    store = HashStore()
    rounds.publish_round(store, 3)
    if terminated is not None:
        decision = {"terminated": terminated, "job_restarts": 1, "world_size": world_size}
        rstore.round_store(store, 2).set(rounds.DECISION, json.dumps(decision))
    return store


@pytest.mark.timeout(20)
def test_a_prompt_admission_ends_the_wait_at_once() -> None:
    from torch.distributed import HashStore

    store = HashStore()
    _answer_after(store, 0.0)
    t0 = time.monotonic()
    got = rejoin.request_admission(store, 1, 30.0, lambda *a, **k: None, heartbeat_interval=5.0)
    assert got == _admission()
    assert time.monotonic() - t0 < 5.0  # not one heartbeat interval, let alone two


@pytest.mark.timeout(20)
def test_an_admission_of_an_earlier_process_with_the_same_pid_is_not_taken() -> None:
    """A replacement admitted before (its admission stays) had the pid this process has (a
    pid namespace of its own, on another host): this process's request is its own, and it
    waits for its own admission, not the old one of another round."""
    from torch.distributed import HashStore

    store = HashStore()
    stale = dataclasses.replace(_admission(), round=1)
    store.set(rounds.admission(1, os.getpid()), stale.to_json())
    _answer_after(store, 0.0)
    got = rejoin.request_admission(store, 1, 30.0, lambda *a, **k: None, heartbeat_interval=5.0)
    assert got == _admission() and got != stale


@pytest.mark.timeout(20)
def test_an_admission_written_as_the_replacement_gave_up_is_taken(monkeypatch) -> None:
    """The survivor read the request just before the replacement's wait ran out, and wrote
    its admission as the replacement withdrew: the survivor counts the rank back, so the
    replacement takes that admission instead of starting a generation of its own."""
    from torch.distributed import HashStore

    store = HashStore()
    real_withdraw = rounds.withdraw_join

    def survivor_admits_meanwhile(base, key):
        join_id = int(store.get(rounds.join_request(1)))
        store.set(rounds.admission(1, join_id), _admission().to_json())
        real_withdraw(base, key)

    monkeypatch.setattr(rounds, "withdraw_join", survivor_admits_meanwhile)
    got = rejoin.request_admission(store, 1, 0.2, lambda *a, **k: None, heartbeat_interval=5.0, look=False)
    assert got == _admission()


@pytest.mark.timeout(20)
def test_a_job_whose_every_rank_left_is_given_up_at_the_first_look() -> None:
    """Every rank died at once: the barrier found them all terminated, nobody admits."""
    store = _restarted_job([0, 1])
    t0 = time.monotonic()
    got = rejoin.request_admission(store, 1, 30.0, lambda *a, **k: None, heartbeat_interval=0.3)
    assert got is None
    assert time.monotonic() - t0 < 10.0  # not the 30 s timeout
    assert not store.check([rounds.join_request(1)])  # the request is withdrawn


@pytest.mark.timeout(20)
def test_a_job_whose_last_ranks_leave_while_the_replacement_waits_is_given_up() -> None:
    """The usual order when every rank dies: the replacement asks before the barrier released."""
    store = _restarted_job(None)
    rstore.round_store(store, 2)  # round 2 runs its restart: no decision yet

    def last_arrival() -> None:
        store.wait([rounds.join_request(1)], datetime.timedelta(seconds=10))  # it asked first
        decision = {"terminated": [0, 1], "job_restarts": 1, "world_size": 2}
        rstore.round_store(store, 2).set(rounds.DECISION, json.dumps(decision))

    threading.Thread(target=last_arrival, daemon=True).start()
    got = rejoin.request_admission(store, 1, 30.0, lambda *a, **k: None, heartbeat_interval=0.2)
    assert got is None and not store.check([rounds.join_request(1)])


def test_the_first_round_of_a_generation_does_not_read_the_last_generations_decision() -> None:
    """Generation 100 runs; an earlier generation ended with every rank terminated. A round
    100 that in-process restarts reached (no generation opened there) reads round 99's."""
    from torch.distributed import HashStore

    from nvrx.store import barrier, rounds

    store = HashStore()
    step = rounds.GENERATION_STEP
    rounds.publish_round(store, step)
    decision = {"terminated": [0, 1], "job_restarts": 1, "world_size": 2}
    rstore.round_store(store, step - 1).set(rounds.DECISION, json.dumps(decision))
    assert rounds.nobody_to_admit(store) == "every rank of round 99 left it"
    store.set(barrier.release_key(rounds.initial_barrier(step)), "1")  # opened here
    assert rounds.nobody_to_admit(store) is None


def test_a_survivor_that_died_after_the_decision_counts_as_gone() -> None:
    """The last survivor died in ``take_back``: its monitor registered it in the decided round."""
    store = _restarted_job([1])
    assert rounds.nobody_to_admit(store) is None
    rstore.register_terminated(rstore.round_store(store, 2), 0)
    assert rounds.nobody_to_admit(store) == "every rank of round 2 left it"


def test_a_rank_taken_back_at_the_last_restart_is_a_survivor() -> None:
    """Rank 1 rejoined at round 2's restart, then rank 0 died before round 3 started (its
    monitor registered it in round 2): rank 1 runs, and may admit rank 0's replacement."""
    store = _restarted_job([1])
    rstore.round_store(store, 2).set(rounds.REJOIN, json.dumps([1]))
    rstore.register_terminated(rstore.round_store(store, 2), 1)  # its death in round 2
    rstore.register_terminated(rstore.round_store(store, 2), 0)
    assert rounds.nobody_to_admit(store) is None


def test_a_decision_without_a_world_size_is_no_reason_to_give_up() -> None:
    """Written by an older version: the replacement waits, as it would for a live job."""
    store = _restarted_job(None)
    decision = {"terminated": [0, 1], "job_restarts": 1}
    rstore.round_store(store, 2).set(rounds.DECISION, json.dumps(decision))
    assert rounds.nobody_to_admit(store) is None


@pytest.mark.timeout(20)
def test_a_completed_job_is_given_up() -> None:
    store = _restarted_job(None)
    rstore.round_store(store, 3).set(rounds.INTERRUPTED, "done")
    assert rounds.nobody_to_admit(store) == "round 3 completed"
    got = rejoin.request_admission(store, 1, 30.0, lambda *a, **k: None, heartbeat_interval=0.2)
    assert got is None


@pytest.mark.timeout(20)
def test_a_job_with_a_survivor_is_waited_for_beyond_many_intervals() -> None:
    store = _restarted_job([1])
    assert rounds.nobody_to_admit(store) is None
    _answer_after(store, 1.0)  # five looks at the job before the admission comes
    got = rejoin.request_admission(store, 1, 30.0, lambda *a, **k: None, heartbeat_interval=0.2)
    assert got == _admission()


@pytest.mark.timeout(20)
def test_a_takeover_waits_without_looking_at_the_job() -> None:
    """``NVRX_TAKEOVER``: the spare's supervisor knows the job runs; a round whose
    ranks all left does not end the wait."""
    store = _restarted_job([0, 1])
    _answer_after(store, 1.0)
    got = rejoin.request_admission(
        store, 1, 30.0, lambda *a, **k: None, heartbeat_interval=0.2, look=False
    )
    assert got == _admission()


# -- the call's end -----------------------------------------------------------------------
def test_a_ctrl_c_in_the_termination_barrier_still_ends_the_calls_services():
    """A ``KeyboardInterrupt`` while the store host waits in the termination barrier: the
    monitor process (and the store it hosts), the wake-up signal, the board and the event
    file still end, in their order, and the interrupt goes on (before, all of them were
    left behind)."""
    from nvrx.inprocess.call_wrapper import CallWrapper

    call = CallWrapper.__new__(CallWrapper)  # its parts as stand-ins: only the end runs
    done: list[str] = []
    call.services = SimpleNamespace(
        base_store=object(), stop=lambda: done.append("stop"), close=lambda: done.append("close")
    )
    call.delivery = SimpleNamespace(uninstall_signal=lambda: done.append("uninstall"))
    call.state, call.round_store = SimpleNamespace(fn_exception=ValueError()), object()

    def interrupted() -> None:
        raise KeyboardInterrupt

    call._termination_barrier = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        call.shutdown()
    assert done == ["stop", "uninstall", "close"]
    assert call.round_store is None and call.state.fn_exception is None


def test_the_restart_abort_behind_a_failing_terminate_is_found_through_its_causes():
    abort = RestartAbort("stop", exit_code=130)
    failed = RuntimeError("terminate failed")
    failed.__cause__ = abort
    assert RestartAbort.behind(failed) is abort and RestartAbort.behind(abort) is abort
    handled = RuntimeError("raised while handling one")
    handled.__context__ = abort  # a context is no cause: not this rank's way out
    assert RestartAbort.behind(handled) is None


class _ToldLock:
    """A lock that says when a thread comes to take it (``coming``), then takes it."""

    def __init__(self) -> None:
        self.lock, self.coming = threading.Lock(), threading.Event()

    def __enter__(self) -> None:
        self.coming.set()
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_a_hang_protection_block_entered_as_the_round_changes_counts_in_the_new_round():
    """A thread enters ``disable_hang_protection()`` just as the main thread starts the
    next round: the block counts in the round it took the lock in, so its end turns the
    timeouts back on (before, it read the round gone by, and its end left the timeouts off
    for the whole next round: a hang there went unseen)."""
    from nvrx.inprocess.call_wrapper import CallWrapper

    call = CallWrapper.__new__(CallWrapper)  # its parts as stand-ins: only the blocks run
    flags: list[tuple[int, bool]] = []
    board = SimpleNamespace(
        set_flag=lambda flag, on: flags.append((flag, on)), stamp_auto=lambda: None,
        read=lambda: {"manual": 0},
    )  # fmt: skip
    call.services = SimpleNamespace(board=board)
    call._hang_protection_lock, call._hang_protection_off, call.rounds_run = _ToldLock(), 0, 1
    ended = threading.Event()

    def block() -> None:
        with call.disable_hang_protection():
            pass
        ended.set()

    call._hang_protection_lock.lock.acquire()  # the main thread is starting round 2
    thread = threading.Thread(target=block, daemon=True)
    thread.start()
    assert call._hang_protection_lock.coming.wait(30)
    call.rounds_run, call._hang_protection_off = 2, 0  # what ``_hang_protection_back`` does
    call._hang_protection_lock.lock.release()
    assert ended.wait(30)
    thread.join()
    assert call._hang_protection_off == 0 and flags[-1] == (FLAG_TIMEOUTS_OFF, False), flags


# -- leaving outside a round's run ------------------------------------------------------
def test_a_rank_that_leaves_untold_writes_nothing_in_the_store_but_its_exit_is_an_event(base):
    """Its first rank assignment failed: its number in the first round is not known, so it
    registers none (one could be a live rank's); ``terminate`` runs, its exit is an event."""
    ended: list[Mode] = []

    class Ends(Terminate):
        def __call__(self, state):
            ended.append(state.mode)
            return state

    call = FakeCall(base, world_size=3, terminate=Ends())
    failed = RuntimeError("the rank assignment failed")
    assert round_run.leave(call, call.round_store, Leave(failed, False), told=False) is failed
    assert rstore.fault_records(call.round_store) == []
    assert rounds.interruption(call.round_store) is None and rstore.terminated_ranks(call.round_store) == set()
    [event] = call.kinds("fault")
    assert (event["fault_kind"], event["message"]) == ("exit", "the rank assignment failed")
    assert ended == [Mode.TERMINATED] and call.state.mode == Mode.TERMINATED


@pytest.mark.parametrize(("rounds_run", "told"), [(0, False), (1, True)], ids=["first-assignment", "round-start"])
def test_a_step_outside_a_round_that_raises_leaves_told_only_where_its_number_is_known(
    monkeypatch, rounds_run: int, told: bool
):
    """The first assignment (before any round ran) leaves untold; a round's start (after
    its assignment, whose number it has) leaves told: the others go on without it."""
    from nvrx.inprocess.call_wrapper import CallWrapper

    call = CallWrapper.__new__(CallWrapper)
    call.rounds_run, call.round_store = rounds_run, object()
    left: list[tuple[Leave, bool]] = []

    def leave(c, store, outcome, told=True):
        left.append((outcome, told))
        return outcome.exc

    monkeypatch.setattr(round_run, "leave", leave)
    failed = RuntimeError("failed")

    def step() -> None:
        raise failed

    with pytest.raises(RuntimeError) as raised:
        call._or_leave(step)
    assert raised.value is failed and raised.value.__cause__ is None and raised.value.__context__ is None
    assert left == [(Leave(failed, False), told)]
