"""The monitor thread's store wait: one per round, ended by the round, never polled.

Against a real TCPStore; the store is wrapped only to count the waits the
thread issues.
"""

from __future__ import annotations

import threading

import pytest

from nvrx.inprocess import monitor_thread
from nvrx.inprocess import store as rstore
from nvrx.inprocess.monitor_thread import DONE, Delivery, MonitorThread
from nvrx.store import client, keys


@pytest.fixture()
def base():
    server = client.serve("127.0.0.1", 0, timeout=10)
    yield client.connect("127.0.0.1", server.port, timeout=10)
    del server


class CountingStore:
    """A round store that counts ``wait`` requests and says when one started."""

    def __init__(self, store) -> None:
        self._store = store
        self.waits = 0
        self.waiting = threading.Event()

    def wait(self, keys_, timeout):
        self.waits += 1
        self.waiting.set()
        return self._store.wait(keys_, timeout)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _thread(base, aborts: list, **kw) -> tuple[MonitorThread, CountingStore, Delivery]:
    store = CountingStore(rstore.round_store(base.clone(), 0))
    delivery = Delivery()
    thread = MonitorThread(
        store, keys.INTERRUPTED, [], delivery, lambda state: aborts.append(state), "frozen", **kw
    )
    thread.start()
    assert store.waiting.wait(10)
    return thread, store, delivery


def test_a_running_round_costs_one_wait_and_a_fault_ends_it(base):
    aborts: list = []
    thread, store, delivery = _thread(base, aborts)
    # far longer than the reference's 1 s polling interval: still the one wait
    assert not delivery.requested.wait(2.5)
    assert store.waits == 1 and thread.is_alive()
    rstore.record_fault(rstore.round_store(base, 0), rstore.nvrx_faults.FaultRecord(rank=1, kind="exception"))
    assert delivery.requested.wait(10)
    thread.join(10)
    assert aborts == ["frozen"] and store.waits == 1 and not thread.is_alive()


def test_completion_ends_the_wait_without_a_restart(base):
    aborts: list = []
    thread, store, delivery = _thread(base, aborts)
    rstore.interrupt(rstore.round_store(base, 0), DONE)
    thread.join(10)
    assert not thread.is_alive() and not delivery.requested.is_set() and aborts == []


def test_a_rank_that_leaves_stops_its_thread_without_an_abort(base):
    """The leave interrupts the round; the stopped thread wakes and does nothing."""
    aborts: list = []
    thread, _store, delivery = _thread(base, aborts)
    thread.stop.set()
    rstore.interrupt(rstore.round_store(base, 0), "fault")
    assert thread.finish(10)
    assert not delivery.requested.is_set() and aborts == []


def test_a_thread_that_nobody_wakes_is_left_to_its_renewal(base, monkeypatch):
    """A rank without a rank number leaves without interrupting: finish does not wait a chunk."""
    monkeypatch.setattr(monitor_thread, "WAKE_WAIT_S", 0.2)
    aborts: list = []
    thread, store, delivery = _thread(base, aborts, chunk=1.0)
    assert not thread.finish(60)  # returned after WAKE_WAIT_S, not 60 s
    thread.join(10)  # ends at its renewal: the stop is seen there
    assert not thread.is_alive() and store.waits == 1
    assert not delivery.requested.is_set() and aborts == []
