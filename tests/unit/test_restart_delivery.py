"""How the monitor thread raises the restart in the main thread (``monitor_thread.Delivery``)."""

from __future__ import annotations

import itertools
import signal
import threading
import time

import pytest

from nvrx.inprocess.monitor_thread import Delivery, RankShouldRestart


def _deliver_later(delivery: Delivery) -> threading.Thread:
    """The monitor thread's part: the restart raised, then the main thread woken until it took it."""

    def deliver() -> None:
        delivery.deliver("a rank faulted: restarting", delivery.round)
        delivery.keep_waking()

    return threading.Thread(target=deliver, name="test-delivery")


def _first_signal_dropped(monkeypatch) -> list[int]:
    """``pthread_kill`` drops its first signal, as a signal that lands just before a blocking
    call is lost to it; the signals asked for, in order."""
    sent: list[int] = []
    real_kill = signal.pthread_kill

    def kill(thread_id: int, signum: int) -> None:
        sent.append(signum)
        if len(sent) > 1:
            real_kill(thread_id, signum)

    monkeypatch.setattr(signal, "pthread_kill", kill)
    return sent


def test_a_restart_signalled_just_before_a_blocking_call_still_interrupts_it(monkeypatch) -> None:
    """A signal that lands in the bytecodes before ``time.sleep`` interrupts nothing: its
    handler runs once the sleep returned (a rank whose collective failed, then waited for
    the restart, waited for all of it). The kernel's timing cannot be forced here, so the
    first signal is dropped, as such a signal is lost to the sleep; the ones after it wake
    the main thread."""
    sent = _first_signal_dropped(monkeypatch)
    delivery = Delivery()
    delivery.install_signal()
    monitor = _deliver_later(delivery)
    try:
        delivery.enter_user()
        with pytest.raises(RankShouldRestart, match="restarting"):
            monitor.start()
            time.sleep(10)  # a sleep the first signal did not interrupt would run to its end
        delivery.caught()
        monitor.join(10)
        assert not monitor.is_alive()  # it stops once the restart is taken
        assert len(sent) >= 2
    finally:
        delivery.uninstall_signal()



def test_the_monitor_thread_wakes_a_main_thread_that_missed_the_first_signal(base, monkeypatch) -> None:
    """The same through a real monitor thread, woken by a fault recorded in a real store:
    after its abort it delivers the restart and keeps waking the main thread."""
    from nvrx.inprocess import store as rstore
    from nvrx.inprocess.monitor_thread import MonitorThread

    sent = _first_signal_dropped(monkeypatch)
    delivery = Delivery()
    delivery.install_signal()
    aborted = threading.Event()
    thread = MonitorThread(rstore.round_store(base.clone(), 0), delivery, lambda _: aborted.set(), "frozen")
    thread.start()
    try:
        delivery.enter_user()
        fault = rstore.failures.FaultRecord(rank=1, kind="exception")
        with pytest.raises(RankShouldRestart):
            rstore.record_fault(rstore.round_store(base, 0), fault)
            time.sleep(10)  # the user's blocking call, which the first signal does not reach
        delivery.caught()
        thread.join(10)
        assert aborted.is_set() and not thread.is_alive() and len(sent) >= 2
    finally:
        thread.stop.set()
        delivery.uninstall_signal()


@pytest.mark.parametrize("query_fails", [False, True], ids=["copy-running", "cuda-error"])
def test_the_monitor_thread_tells_kept_state_of_the_fault_before_and_after_its_abort(
    base, monkeypatch, query_fails: bool
) -> None:
    """A kept state's device copy still running when the round's fault comes is marked before
    the abort lets the stream run on (``KeptState.interrupted``), also where the device
    cannot say (a CUDA error its query raises); one the main thread queues while the abort
    runs is dropped after it, though finished."""
    import torch

    from nvrx.inprocess import kept_state, state_tree
    from nvrx.inprocess import store as rstore
    from nvrx.inprocess.monitor_thread import MonitorThread

    class Running:  # a device copy behind the step's collectives
        def query(self) -> bool:
            if query_fails:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return False

        def synchronize(self) -> None:  # the abort lets the stream run on
            pass

    kept = kept_state.KeptState()
    kept.register("model", torch.nn.Linear(1, 1))
    monkeypatch.setattr(state_tree.Copier, "finish", lambda self: Running())
    kept.commit(1)
    marked_before_abort: list[bool] = []
    delivery = Delivery()
    delivery.install_signal()

    class Finished(Running):  # a device copy the main thread queued while the abort ran
        def query(self) -> bool:
            return True

    def abort(_: object) -> None:
        marked_before_abort.append(kept._slots[kept._pending].interrupted)
        monkeypatch.setattr(state_tree.Copier, "finish", lambda self: Finished())
        kept.commit(2)  # it settles the interrupted copy first: nothing complete is left

    thread = MonitorThread(rstore.round_store(base.clone(), 0), delivery, abort, "frozen")
    thread.start()
    try:
        delivery.enter_user()
        with pytest.raises(RankShouldRestart):
            rstore.record_fault(rstore.round_store(base, 0), rstore.failures.FaultRecord(rank=1, kind="exception"))
            thread.join(30)  # the restart comes while this rank waits
        delivery.caught()
        thread.join(10)
        assert marked_before_abort == [True]
        assert kept.steps() == []  # step 1's copy was spoilt, step 2's queued during the abort
    finally:
        thread.stop.set()
        delivery.uninstall_signal()


def test_the_signal_is_sent_again_at_doubling_waits_and_no_longer_than_its_limit(monkeypatch) -> None:
    """A main thread that never takes the restart gets the signal again after 2 ms, then
    after waits that double up to ``RESIGNAL_MAX_S``, until ``RESIGNAL_FOR_S`` (here 0.5 s)
    passed: each wait is at least its step of the schedule, and no more signals come than
    the schedule holds within that time."""
    from nvrx.inprocess import monitor_thread

    monkeypatch.setattr(monitor_thread, "RESIGNAL_FOR_S", 0.5)
    sent: list[float] = []
    monkeypatch.setattr(signal, "pthread_kill", lambda _thread, _signum: sent.append(time.monotonic()))
    delivery = Delivery()
    delivery.install_signal()
    try:
        delivery.enter_user()
        start = time.monotonic()
        delivery.deliver("a rank faulted: restarting", delivery.round)  # the first signal, never taken
        delivery.keep_waking()
        ended = time.monotonic()
    finally:
        delivery.uninstall_signal()
    schedule, delay = [], monitor_thread.RESIGNAL_FIRST_S
    while sum(schedule) <= 0.5:
        schedule.append(delay)
        delay = min(2 * delay, monitor_thread.RESIGNAL_MAX_S)
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert 2 <= len(sent) <= len(schedule) + 1, (len(sent), schedule)
    assert all(gap >= step - 1e-4 for gap, step in zip(gaps, schedule, strict=False)), (gaps, schedule)
    assert ended >= start + 0.5  # it kept trying for all of it
