"""The monitor thread's store wait: one per round, ended by the round, never polled.

Against a real TCPStore; the store is wrapped only to count the waits the
thread issues.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import threading
import time

import psutil
import torch.distributed as dist

from nvrx.inprocess import monitor_thread
from nvrx.inprocess import store as rstore
from nvrx.inprocess.monitor_thread import Delivery, MonitorThread
from nvrx.store import client, rounds
from nvrx.store.rounds import DONE


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
        store, delivery, lambda state: aborts.append(state), "frozen", **kw
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
    rstore.record_fault(rstore.round_store(base, 0), rstore.failures.FaultRecord(rank=1, kind="exception"))
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


def test_a_forged_interruption_is_passed_over_and_the_real_one_ends_the_wait(base, tmp_path, monkeypatch):
    """With the job's secret, a value at the round's interruption that does not unseal is
    reported once and the thread waits on (a second wait); the real fault then restarts."""
    from nvrx import jobenv

    secret_file = tmp_path / "secret"
    secret_file.write_text(bytes(range(32)).hex())
    secret_file.chmod(0o600)
    monkeypatch.setenv(jobenv.JOB_SECRET_FILE, str(secret_file))
    aborts: list = []
    rejected: list = []
    thread, store, delivery = _thread(base, aborts, on_rejected=rejected.append)
    store.waiting.clear()
    rstore.round_store(base, 0).set(rounds.INTERRUPTED, "fault")  # a client without the secret
    assert store.waiting.wait(10)  # waiting again, on the next generation
    assert [r.key for r in rejected] == ["nvrx/r0/interrupted"] and not delivery.requested.is_set()
    rstore.record_fault(rstore.round_store(base, 0), rstore.failures.FaultRecord(rank=1, kind="exception"))
    assert delivery.requested.wait(10)
    thread.join(10)
    assert aborts == ["frozen"] and store.waits == 2 and len(rejected) == 1


def test_a_thread_that_nobody_wakes_is_left_to_its_renewal(base, monkeypatch):
    """A rank without a rank number leaves without interrupting: finish does not wait a chunk."""
    monkeypatch.setattr(monitor_thread, "WAKE_WAIT_S", 0.2)
    aborts: list = []
    thread, store, delivery = _thread(base, aborts, chunk=1.0)
    assert not thread.finish(60)  # returned after WAKE_WAIT_S, not 60 s
    thread.join(10)  # ends at its renewal: the stop is seen there
    assert not thread.is_alive() and store.waits == 1
    assert not delivery.requested.is_set() and aborts == []


def test_a_fault_wakes_the_thread_on_torchs_legacy_store_server():
    """torch's legacy TCPStore backend answers a ``compare_set`` without waking waiters:
    the interruption must still end the one wait (not its renewal, a day later)."""
    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1", 0, world_size=None, is_master=True,
        timeout=datetime.timedelta(seconds=10), wait_for_workers=False, use_libuv=False,
    )  # fmt: skip
    try:
        base = client.connect("127.0.0.1", server.port, timeout=10)
        aborts: list = []
        thread, store, delivery = _thread(base, aborts)
        fault = rstore.failures.FaultRecord(rank=1, kind="exception")
        rstore.record_fault(rstore.round_store(base, 0), fault)
        assert delivery.requested.wait(10)  # not the WAIT_CHUNK_S renewal
        thread.join(10)
        assert aborts == ["frozen"] and store.waits == 1 and not thread.is_alive()
    finally:
        del server


def test_finish_returns_at_once_when_the_thread_ended_without_waking():
    """Its store failed (the thread delivered a restart and ended): a leaving rank does not
    wait ``WAKE_WAIT_S`` for a wake-up that cannot come."""
    from torch.distributed import DistNetworkError

    class GoneStore:
        def wait(self, keys_, timeout):
            raise DistNetworkError("the store is gone")

    delivery = Delivery()
    thread = MonitorThread(GoneStore(), delivery, None, "frozen")
    thread.start()
    assert delivery.requested.wait(10)  # the failure restarts the rank
    thread.join(10)
    t0 = time.monotonic()
    assert thread.finish(60)
    assert time.monotonic() - t0 < monitor_thread.WAKE_WAIT_S / 2


def test_a_thread_whose_store_failed_aborts_before_it_restarts_the_rank():
    """As for a fault: the main thread may be blocked in a collective, which only the abort
    ends; the restart names the failure."""
    from torch.distributed import DistNetworkError

    class GoneStore:
        def wait(self, keys_, timeout):
            raise DistNetworkError("the store is gone")

    aborts: list = []
    delivery = Delivery()
    thread = MonitorThread(GoneStore(), delivery, aborts.append, "frozen")
    thread.start()
    assert delivery.requested.wait(10)
    thread.join(10)
    assert aborts == ["frozen"] and isinstance(thread.error, DistNetworkError)
    assert delivery.message.startswith("monitor thread failed: DistNetworkError")


def _client(server_port: int) -> tuple[dist.TCPStore, dict]:
    """A new client of the test's store, and its sockets (file descriptor by local address)."""
    def ours() -> dict:
        return {c.laddr: c.fd for c in psutil.Process().net_connections("tcp")
                if c.raddr and c.raddr.port == server_port}  # fmt: skip

    before = ours()
    store = dist.TCPStore("127.0.0.1", server_port, is_master=False, wait_for_workers=False)
    return store, {laddr: fd for laddr, fd in ours().items() if laddr not in before}


def _shut_reads(sockets: dict) -> None:
    """Close these sockets for reading, as a store or a network that dropped the connection:
    the next answer never comes (``DistNetworkError``)."""
    for fd in sockets.values():
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RD)


def test_a_thread_whose_connection_failed_lets_go_of_it(base):
    """The failed connection closes as soon as the rank drops its own reference (it makes a
    new one), while the ended thread is still kept (the round's ``RoundRun`` holds it): the
    error's traceback, kept on the thread, must not hold it open until a garbage collection,
    one broken socket per round where the application turned the collector off."""
    gc.disable()
    try:
        store, sockets = _client(base.port)
        _shut_reads(sockets)
        addresses = set(sockets)
        assert addresses
        delivery = Delivery()
        thread = MonitorThread(rstore.round_store(store, 0), delivery, None, "frozen")
        del store  # the rank's own reference (``RankServices.reconnect_monitor_thread``)
        thread.start()
        assert delivery.requested.wait(10)
        thread.join(10)
        assert thread.error is not None and not thread.is_alive()
        still = {c.laddr for c in psutil.Process().net_connections("tcp")} & addresses
        assert not still, f"the failed connection is still open: {still}"
    finally:
        gc.enable()


def test_a_thread_told_to_stop_whose_connection_fails_restarts_nothing(base):
    """The rank is done with the round (it completed, leaves, or restarts already: ``stop``)
    when the thread's connection fails: no abort tears down the process groups it still
    uses (finalize, the code after the Wrapper), and no restart is requested."""
    store, sockets = _client(base.port)
    aborts: list = []
    counting = CountingStore(rstore.round_store(store, 0))
    delivery = Delivery()
    thread = MonitorThread(counting, delivery, aborts.append, "frozen")
    thread.start()
    assert counting.waiting.wait(10)
    thread.stop.set()
    _shut_reads(sockets)
    thread.join(10)
    assert not thread.is_alive() and thread.error is not None
    assert aborts == [] and not delivery.requested.is_set()


def test_finish_waits_for_an_abort_in_progress_beyond_the_wake_wait(base, monkeypatch):
    """A peer's fault woke the thread and its abort still runs: the leaving rank waits for it."""
    monkeypatch.setattr(monitor_thread, "WAKE_WAIT_S", 0.2)
    started, release = threading.Event(), threading.Event()

    def abort(state) -> None:  # an abort that takes 1 s
        started.set()
        release.wait(10)

    thread, _store, delivery = _thread(base, [], chunk=60.0)
    thread.abort = abort
    rstore.record_fault(rstore.round_store(base, 0), rstore.failures.FaultRecord(rank=1, kind="exception"))
    assert started.wait(10)
    threading.Timer(1.0, release.set).start()
    assert thread.finish(30)  # past WAKE_WAIT_S: the abort's end
    assert delivery.requested.is_set()


def test_a_restart_is_marked_requested_before_it_is_raised_in_the_main_thread(monkeypatch):
    """The main thread that takes the restart reads ``requested`` to tell it from one the
    function raised itself: it must be set when the restart lands, not after."""
    delivery = Delivery()
    delivery.state = Delivery.USER  # the main thread in user code, no wake-up signal installed
    seen: list[bool] = []
    monkeypatch.setattr(
        monitor_thread, "async_raise", lambda ident, exc: seen.append(delivery.requested.is_set()) or 1
    )
    delivery.deliver("a rank faulted: restarting", delivery.round)
    assert seen == [True] and delivery.state == Delivery.RAISED


def test_an_abort_that_ends_after_the_next_round_began_restarts_nothing(base, monkeypatch):
    """The main thread waited ``RESTART_WAIT_S`` for a peer's abort and went on to the next
    round: that abort's end must not raise a restart into the round that runs now."""
    started, release = threading.Event(), threading.Event()

    def abort(state) -> None:
        started.set()
        release.wait(10)

    told: list[float] = []
    monkeypatch.setattr(monitor_thread, "tell_kept_state", told.append)
    thread, _store, delivery = _thread(base, [], chunk=60.0)
    thread.abort = abort
    rstore.record_fault(rstore.round_store(base, 0), rstore.failures.FaultRecord(rank=1, kind="exception"))
    assert started.wait(10)
    delivery.reset()  # the next round starts
    delivery.enter_user()  # its user code runs
    release.set()
    thread.join(10)
    assert not thread.is_alive()
    assert not delivery.requested.is_set() and delivery.state == Delivery.USER
    delivery.leave_user()  # nothing raised: the round runs on
    assert len(told) == 1  # before the abort only: the new round's commits are not spoilt
