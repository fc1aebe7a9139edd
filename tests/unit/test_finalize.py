"""ThreadedFinalize on CPU: runs the callable, bounds it with a timeout, passes errors on."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from nvrx.inprocess import exception
from nvrx.inprocess.finalize import Finalize, ThreadedFinalize
from nvrx.inprocess.progress_watchdog import ProgressBoard, ProgressWatchdog
from nvrx.inprocess.state import State
from tests.support.waiting import wait_until

STATE = State(rank=0, world_size=1).freeze()


@pytest.mark.timeout(30)
def test_runs_fn_with_args_in_another_thread():
    seen = []
    fin = ThreadedFinalize(
        timeout=timedelta(seconds=10),
        fn=lambda a, b=0: seen.append((a, b, threading.current_thread().name)),
        args=(1,),
        kwargs={"b": 2},
    )
    assert isinstance(fin, Finalize)
    assert fin(STATE) is STATE
    assert seen[0][:2] == (1, 2) and seen[0][2] != threading.current_thread().name


@pytest.mark.timeout(30)
def test_timeout_raises_nvrx_timeout_error():
    release = threading.Event()
    fin = ThreadedFinalize(timeout=0.2, fn=release.wait, args=(20,))
    try:
        with pytest.raises(exception.TimeoutError, match="within 0.2 s") as info:
            fin(STATE)
        assert isinstance(info.value, TimeoutError)  # also the builtin
    finally:
        release.set()


@pytest.mark.timeout(30)
def test_errors_of_fn_reach_the_caller():
    def broken():
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        ThreadedFinalize(timeout=5, fn=broken)(STATE)


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="timeout"):
        ThreadedFinalize(timeout=-1, fn=print)
    # not a wait a thread can be joined for (an infinity overflowed the join at the fault)
    for value, shown in ((float("nan"), "nan"), (float("inf"), "inf")):
        message = f"ThreadedFinalize timeout must be a finite number of seconds >= 0, got {shown}"
        with pytest.raises(ValueError, match=message):
            ThreadedFinalize(timeout=value, fn=print)
    with pytest.raises(ValueError, match=r"must be at most 315360000 seconds \(10 years\), got 1e\+12"):
        ThreadedFinalize(timeout=1e12, fn=print)
    with pytest.raises(TypeError, match="fn must be callable"):
        ThreadedFinalize(timeout=1, fn=None)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 1e12])
@pytest.mark.parametrize("plugin", ["ThreadedFinalize", "CudaHealthCheck", "FilterCountGroupedByKey"])
def test_a_plugin_timeout_that_is_not_a_finite_duration_is_refused(plugin: str, value: float) -> None:
    """A plug-in's own timeout follows the Wrapper's rule: refused when it is built, naming it."""
    from nvrx.inprocess.health_check import CudaHealthCheck
    from nvrx.inprocess.rank_assignment.grouped_filter import FilterCountGroupedByKey

    build = {
        "ThreadedFinalize": lambda: ThreadedFinalize(value, lambda: None),
        "CudaHealthCheck": lambda: CudaHealthCheck(timeout=value),
        "FilterCountGroupedByKey": lambda: FilterCountGroupedByKey(lambda r: r, lambda n: True, value),
    }[plugin]
    with pytest.raises(ValueError, match=f"{plugin} timeout"):
        build()


@pytest.mark.timeout(60)
def test_the_main_thread_makes_progress_while_it_waits_for_the_finalize_thread():
    """The progress watchdog's probe runs in the main thread between bytecodes only: joined
    in one blocking wait, a finalize slower than the hard timeout (within its own timeout)
    got its rank ended between rounds. Joined in slices, the board is stamped meanwhile."""
    board = ProgressBoard()
    watchdog = ProgressWatchdog(0, board, 0.01)
    watchdog.start()
    stamps: set[float] = set()

    def flush() -> None:  # done once the main thread, waiting for it, was stamped again
        def stamped() -> bool:
            stamps.add(board.read()["auto"])
            return len(stamps) >= 3  # (one stamp may come before the wait starts)

        wait_until("stamps of the main thread while it waits", stamped, 10, 0.01)

    try:
        ThreadedFinalize(timeout=30, fn=flush)(STATE)
    finally:
        watchdog.shutdown(timeout=5)
        board.close()


@pytest.mark.timeout(30)
def test_the_thread_runs_on_the_callers_cuda_device(monkeypatch):
    """CUDA's current device is per thread (0 in a new one): the caller's is read before
    the thread starts, as the reference does, when LOCAL_RANK does not name it."""
    import torch

    main = threading.get_ident()
    chosen = []
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3 if threading.get_ident() == main else 0)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert ThreadedFinalize(timeout=5, fn=lambda: None)(STATE) is STATE
    assert chosen == [3]
    monkeypatch.setenv("LOCAL_RANK", "5")
    ThreadedFinalize(timeout=5, fn=lambda: None)(STATE)
    assert chosen == [3, 5]
