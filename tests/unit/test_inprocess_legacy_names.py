"""Names kept from older reference releases: Wrapper(rank_filter=...), FilterGroupedByKey,
the monitor_thread helpers, AbortPersistentCheckpointProcesses, and the attribution records."""

from __future__ import annotations

import threading
import time
import warnings

import pytest

from nvrx.events.failures import FaultRecord
from nvrx.inprocess import Compose, Wrapper, attribution, rank_filter
from nvrx.inprocess.abort import Abort, AbortPersistentCheckpointProcesses
from nvrx.inprocess.monitor_thread import (
    RankShouldRestart,
    async_abort_main_thread,
    async_raise,
    delayed_async_raise,
)
from nvrx.inprocess.rank_assignment import (
    ActivateAllRanks,
    FilterGroupedByKey,
    RankAssignmentCtx,
    RankDiscarded,
    ShiftRanks,
)
from nvrx.inprocess.rank_filter import with_rank_filter
from nvrx.inprocess.state import Mode, State
from tests.support.store_ranks import run_ranks_with_store


def _wrapper_with_filter(flt):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapper = Wrapper(rank_filter=flt)
    return wrapper, [str(w.message) for w in caught if w.category is DeprecationWarning]


def test_wrapper_rank_filter_warns_and_runs_after_every_assignment():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        flt = rank_filter.MaxActiveWorldSize(2)
    wrapper, messages = _wrapper_with_filter(flt)
    assert wrapper.rank_filter is flt
    assert isinstance(wrapper.rank_assignment, Compose)  # kept as given (the default), as in NVRx
    assert any("Wrapper(rank_filter=...) is deprecated" in m for m in messages), messages
    # ShiftRanks drops rank 1, then the filter keeps 2 of the 3 survivors active.
    states = {}
    for rank in range(4):
        ctx = RankAssignmentCtx(State(rank=rank, world_size=4), None, {1})
        try:
            states[rank] = with_rank_filter(wrapper.rank_assignment, wrapper.rank_filter)(ctx).state
        except RankDiscarded:
            states[rank] = None
    assert states[1] is None
    assert [states[r].mode for r in (0, 2, 3)] == [Mode.ACTIVE, Mode.ACTIVE, Mode.INACTIVE]
    assert {states[r].active_world_size for r in (0, 2, 3)} == {2}


def test_wrapper_rank_filter_accepts_a_composition_of_old_filters():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        flt = Compose(rank_filter.WorldSizeDivisibleBy(2), rank_filter.MaxActiveWorldSize(5))
    wrapper, _ = _wrapper_with_filter(flt)
    step = with_rank_filter(wrapper.rank_assignment, wrapper.rank_filter)
    ctx = step(RankAssignmentCtx(State(rank=4, world_size=7), None, set()))
    assert ctx.state.active_world_size == 4 and ctx.state.mode == Mode.INACTIVE


def test_wrapper_rank_filter_of_the_wrong_kind_is_named():
    with pytest.raises(TypeError, match="rank_filter must be an instance of"):
        Wrapper(rank_filter=ActivateAllRanks())


def test_without_rank_filter_the_assignment_is_untouched():
    assignment = Compose(ActivateAllRanks(), ShiftRanks())
    assert Wrapper(rank_assignment=assignment).rank_assignment is assignment


@pytest.mark.timeout(120)
def test_filter_grouped_by_key_takes_rank_and_world_size():
    world, seen = 6, []

    def key(rank, world_size):
        seen.append(world_size)
        return f"pair{rank // 2}"

    def rank_fn(rank, store):
        step = FilterGroupedByKey(key, lambda count: count == 2, timeout=20)
        step.name = "legacy_filter_under_test"
        ctx = RankAssignmentCtx(State(rank=rank, world_size=world, mode=Mode.ACTIVE), store, {3})
        return Compose(ShiftRanks(), step)(ctx).state

    results, errors = run_ranks_with_store(world, rank_fn)
    assert set(errors) == {2, 3} and all(isinstance(e, RankDiscarded) for e in errors.values())
    assert {r: s.rank for r, s in results.items()} == {0: 0, 1: 1, 4: 2, 5: 3}
    assert set(seen) == {world}
    assert FilterGroupedByKey("host", lambda c: True).key_or_fn == "host"


def test_async_abort_main_thread_carries_the_message():
    timer = threading.Timer(0.05, async_abort_main_thread, args=("rank 3 faulted",))
    timer.start()
    with pytest.raises(RankShouldRestart, match="rank 3 faulted"):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            pass
    timer.join()


def test_delayed_async_raise_and_event_gated_async_raise():
    main = threading.main_thread().ident
    with pytest.raises(RankShouldRestart):
        delayed_async_raise(main, RankShouldRestart)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            pass
    event = threading.Event()
    helper = threading.Thread(target=async_raise, args=(main, RankShouldRestart, event))
    helper.start()
    time.sleep(0.05)  # nothing is raised while the event is clear
    with pytest.raises(RankShouldRestart):
        event.set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            pass
    helper.join()
    assert async_raise(2**40, RankShouldRestart) == 0


def test_abort_persistent_checkpoint_processes_is_an_abort_and_a_no_op_without_nvrx():
    from nvrx.inprocess.state import State as S

    step = AbortPersistentCheckpointProcesses()
    frozen = S(rank=0, world_size=1).freeze()
    assert isinstance(step, Abort) and step(frozen) is frozen


def test_interruption_records_from_nvrx_fault_records_and_strings():
    I = attribution.Interruption  # noqa: E741
    records = [
        attribution.InterruptionRecord.from_fault_record(FaultRecord(rank=3, kind="exception")),
        attribution.InterruptionRecord.from_fault_record(FaultRecord(rank=1, kind="hang_soft")),
        attribution.InterruptionRecord.from_fault_record(FaultRecord(rank=0, kind="exception")),
        attribution.InterruptionRecord.from_fault_record(FaultRecord(rank=5, kind="dead")),
    ]
    assert [r.interruption for r in records] == [
        I.EXCEPTION, I.SOFT_TIMEOUT, I.EXCEPTION, I.TERMINATED,
    ]  # fmt: skip
    assert attribution.format_interruption_records(records) == (
        "Interruption.EXCEPTION on ranks={0, 3}, Interruption.SOFT_TIMEOUT on ranks={1}, "
        "Interruption.TERMINATED on ranks={5}"
    )
    for record in records:
        assert attribution.InterruptionRecord.from_str(repr(record)) == record
    short = attribution.InterruptionRecord.from_str("rank=7 interruption=UNRESPONSIVE")
    assert short == attribution.InterruptionRecord(7, I.UNRESPONSIVE)
    with pytest.raises(ValueError, match="interruption=<name of Interruption>"):
        attribution.InterruptionRecord.from_str("rank=1 interruption=NOPE")
    assert set(attribution.FROM_FAULT_KIND) >= {"exception", "exit", "hang_hard", "unresponsive"}


def test_interruption_records_read_from_a_round_store(tmp_path):
    from nvrx.inprocess import store as rstore

    store = rstore.FileStore(str(tmp_path / "fs"), 1)
    rstore.record_fault(store, FaultRecord(rank=2, kind="hang_hard"))
    got = attribution.interruption_records(store)
    assert got == [attribution.InterruptionRecord(2, attribution.Interruption.HARD_TIMEOUT)]
