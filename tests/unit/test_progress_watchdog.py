"""progress_watchdog: Timestamp and the reference-style ProgressWatchdog(rank, monitor_process, interval)."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import pytest

from nvrx.inprocess.progress_watchdog import ProgressBoard, ProgressWatchdog, Timestamp


class Sink:
    """A reference-style monitor process: it only receives timestamps."""

    def __init__(self):
        self.got: list[Timestamp] = []

    def send_timestamp(self, timestamp: Timestamp) -> None:
        self.got.append(timestamp)


def _run_bytecode(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sum(range(50))


def _run_bytecode_until(what: str, condition: Callable[[], object], timeout: float = 10) -> None:
    """Run bytecode, where the watchdog's probe runs, until ``condition()`` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not seen after {timeout:g} s of bytecode"
        sum(range(50))


def test_timestamp_times_out_on_either_active_stamp():
    now = time.monotonic()
    assert not Timestamp(auto=now).is_timed_out(datetime.timedelta(seconds=5))
    assert Timestamp(auto=now - 10).is_timed_out(datetime.timedelta(seconds=5))
    assert Timestamp(auto=now, manual=now - 10).is_timed_out(5)
    assert not Timestamp().is_timed_out(0)  # nothing active


def test_watchdog_reports_progress_only_while_bytecode_runs():
    sink = Sink()
    watchdog = ProgressWatchdog(0, sink, datetime.timedelta(milliseconds=10))
    watchdog.start()
    try:
        start = time.monotonic()
        _run_bytecode_until("three timestamps", lambda: len(sink.got) >= 3)
        assert sink.got[-1].auto > start
        time.sleep(0.3)  # the main thread blocked in C: the probe does not run
        stalled = sink.got[-1].auto
        assert time.monotonic() - stalled >= 0.25
        watchdog.ping()
        assert sink.got[-1].manual is not None
        watchdog.reset()
        assert sink.got[-1].manual is None
    finally:
        watchdog.shutdown(timeout=5)
    assert not watchdog.is_alive()


def test_pause_and_synchronize_from_the_main_thread_and_resume():
    sink = Sink()
    watchdog = ProgressWatchdog(1, sink, 0.01)
    watchdog.start()
    try:
        _run_bytecode_until("a probe", lambda: watchdog.num_completed >= 1)
        watchdog.pause_and_synchronize()
        assert watchdog.paused.is_set()
        scheduled = watchdog.num_scheduled
        assert watchdog.num_completed == scheduled
        _run_bytecode(0.1)
        assert watchdog.num_scheduled == scheduled, "a paused watchdog must not probe"
        watchdog.resume()
        _run_bytecode_until("a probe after resume", lambda: watchdog.num_scheduled > scheduled)
    finally:
        watchdog.shutdown(timeout=5)


def test_pause_from_another_thread_while_the_main_thread_waits():
    watchdog = ProgressWatchdog(2, Sink(), 0.01)
    watchdog.start()
    try:
        _run_bytecode_until("a probe", lambda: watchdog.num_completed >= 1)
        pauser = threading.Thread(target=watchdog.pause_and_synchronize)
        pauser.start()
        watchdog.spin_till_paused()  # the main thread runs the pending probe meanwhile
        pauser.join(5)
        assert not pauser.is_alive() and watchdog.num_completed == watchdog.num_scheduled
    finally:
        watchdog.shutdown(timeout=5)


def test_watchdog_stamps_a_progress_board():
    board = ProgressBoard()
    watchdog = ProgressWatchdog(0, board, 0.01)
    watchdog.start()
    try:
        start = time.monotonic()
        _run_bytecode_until("a stamp on the board", lambda: board.read()["auto"] > start)
        watchdog.ping()
        assert board.read()["manual"] > start
    finally:
        watchdog.shutdown(timeout=5)
        board.close()


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (
            (0, object(), 1),
            TypeError,
            "monitor_process must be a ProgressBoard or have a send_timestamp",
        ),
        ((0, Sink(), 0), ValueError, "interval must be > 0"),
    ],
)
def test_bad_arguments_are_named(args, error, match):
    with pytest.raises(error, match=match):
        ProgressWatchdog(*args)


def test_resume_of_a_stopped_watchdog_is_named():
    watchdog = ProgressWatchdog(0, Sink(), 0.01)
    with pytest.raises(RuntimeError, match="not running"):
        watchdog.resume()
