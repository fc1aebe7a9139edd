"""How the monitor thread raises the restart in the main thread (``monitor_thread.Delivery``)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from nvrx.inprocess.monitor_thread import Delivery, RankShouldRestart


def _deliver_later(delivery: Delivery) -> threading.Thread:
    """The monitor thread's part: the restart raised, then the main thread woken until it took it."""

    def deliver() -> None:
        delivery.deliver("a rank faulted: restarting")
        delivery.keep_waking()

    return threading.Thread(target=deliver, name="test-delivery")


def test_a_restart_signalled_just_before_a_blocking_call_still_interrupts_it(monkeypatch) -> None:
    """A signal that lands in the bytecodes before ``time.sleep`` interrupts nothing: its
    handler runs once the sleep returned (a rank whose collective failed, then waited for
    the restart, waited for all of it). The kernel's timing cannot be forced here, so the
    first signal is dropped, as such a signal is lost to the sleep; the ones after it wake
    the main thread."""
    sent: list[int] = []
    real_kill = signal.pthread_kill

    def kill(thread_id: int, signum: int) -> None:
        sent.append(signum)
        if len(sent) > 1:
            real_kill(thread_id, signum)

    monkeypatch.setattr(signal, "pthread_kill", kill)
    delivery = Delivery()
    delivery.install_signal()
    monitor = _deliver_later(delivery)
    try:
        delivery.enter_user()
        with pytest.raises(RankShouldRestart, match="restarting"):
            monitor.start()
            time.sleep(60)  # a sleep the first signal did not interrupt would run to its end
        delivery.caught()
        monitor.join(10)
        assert not monitor.is_alive()  # it stops once the restart is taken
        assert len(sent) >= 2
    finally:
        delivery.uninstall_signal()

