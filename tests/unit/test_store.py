"""nvrx.store: barriers, fault records, rounds and client helpers against a real TCPStore."""

from __future__ import annotations

import threading
import time

import pytest

from nvrx.events import failures
from nvrx.store import barrier as B
from nvrx.store import client, keys, rounds


@pytest.fixture()
def server():
    store = client.serve("127.0.0.1", 0, timeout=10)
    yield store
    del store


def _client(server):
    return client.connect("127.0.0.1", server.port, timeout=10)


def test_barrier_releases_everyone_and_runs_before_release_once(server):
    n = 6
    released = []
    hooks = []

    def run(rank):
        store = _client(server)
        B.barrier(store, "b1", rank, n, 10.0, before_release=lambda: hooks.append(rank))
        released.append(rank)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(released) == list(range(n))
    assert len(hooks) == 1
    assert B.is_released(server, "b1")


def test_barrier_blocks_until_last_arrival(server):
    store = _client(server)
    assert B.arrive(store, "b2", 0, 2) is False
    assert not B.is_released(server, "b2")
    done = threading.Event()

    def waiter():
        B.wait(_client(server), "b2", 2, 10.0)
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert not done.wait(0.3)
    assert B.arrive(store, "b2", 1, 2) is True
    assert done.wait(10)
    t.join()


def test_reentrant_arrival_counts_once(server):
    store = _client(server)
    assert B.arrive(store, "b3", 0, 2, reentrant=True) is False
    assert B.arrive(store, "b3", 0, 2, reentrant=True) is False  # by proxy: ignored
    assert not B.is_released(store, "b3")
    assert B.arrive(store, "b3", 1, 2, reentrant=True) is True
    assert B.is_released(store, "b3")


def test_a_reentrant_barrier_of_any_rank_ids_completes_at_its_count(server):
    """The reference's API names its participants freely: ranks 1 and 3 of a barrier of 2
    release it (only the round protocol's barriers, ``by_keys``, expect ranks 0..count-1)."""
    store = _client(server)
    assert B.arrive(store, "b3x", 3, 2, reentrant=True) is False
    assert B.arrive(store, "b3x", 1, 2, reentrant=True) is True
    assert B.is_released(store, "b3x")
    with pytest.raises(B.BarrierOverflow, match="b3x"):
        B.arrive(store, "b3x", 5, 2, reentrant=True)


def test_non_reentrant_double_arrival_overflows(server):
    store = _client(server)
    B.arrive(store, "b4", 0, 1)
    with pytest.raises(B.BarrierOverflow, match="b4"):
        B.arrive(store, "b4", 0, 1)


def test_timeout_names_missing_ranks(server):
    store = _client(server)
    B.arrive(store, "b5", 1, 4)
    B.arrive(store, "b5", 3, 4)
    with pytest.raises(B.BarrierTimeout) as info:
        B.wait(store, "b5", 4, 0.3, participants=range(4))
    assert info.value.missing == [0, 2]
    assert "ranks [0, 2]" in str(info.value)


def test_timeout_zero_registers_without_waiting(server):
    store = _client(server)
    B.barrier(store, "b6", 0, 3, B.NO_WAIT)
    assert B.has_arrived(store, "b6", 0)


def test_bad_count_is_rejected(server):
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        B.arrive(_client(server), "b7", 0, 0)


def test_barrier_does_not_poll(server):
    """A waiting rank sends one wait request, whatever the wait lasts."""

    waiting = threading.Event()

    class Counting:
        def __init__(self, inner):
            self.inner, self.calls = inner, []

        def __getattr__(self, name):
            attr = getattr(self.inner, name)

            def call(*a, **k):
                self.calls.append(name)
                if name == "wait":
                    waiting.set()
                return attr(*a, **k)

            return call

    def release() -> None:
        waiting.wait(10)  # rank 0 arrived first and waits
        time.sleep(0.5)  # for a while: a poller would ask again meanwhile
        B.arrive(_client(server), "b8", 1, 2, reentrant=True)

    store = Counting(_client(server))
    releaser = threading.Thread(target=release)
    releaser.start()
    B.barrier(store, "b8", 0, 2, 10.0, reentrant=True)
    releaser.join()
    assert store.calls == ["add", "add", "wait"]


def test_plain_barrier_timeout_names_missing_ranks(server):
    """The native-barrier path also names who never came."""
    done = []

    def run(rank):
        try:
            B.barrier(_client(server), "b9", rank, 4, 0.5)
        except B.BarrierTimeout as exc:
            done.append(exc.missing)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert done == [[1, 3], [1, 3]]


def test_plain_barrier_releases_across_threads(server):
    n = 5
    out = []
    threads = [
        threading.Thread(
            target=lambda r=r: (B.barrier(_client(server), "b10", r, n, 10.0), out.append(r))
        )
        for r in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(out) == list(range(n))


def test_fault_record_json_roundtrip(server):
    def boom():
        raise KeyError("missing thing")

    try:
        boom()
    except KeyError as exc:
        record = failures.from_exception(3, exc)
    # the failure vocabulary's spelling (nvrx.events.failures): type, innermost user frame
    assert record.signature.startswith("KeyError at test_store.py:")
    assert record.signature.endswith(" in boom")
    round_0 = rounds.round_store(_client(server), 0)
    assert rounds.fault_records(round_0) == []
    rounds.append_fault(round_0, record)
    round_0.append(rounds.FAULT_LIST, "not json\n")  # logged and skipped, never a fault
    rounds.append_fault(round_0, failures.FaultRecord(rank=1, kind="hang_soft", message="stuck"))
    got = rounds.fault_records(round_0)
    assert [r.rank for r in got] == [3, 1]
    assert got[0] == record
    assert got[1].kind == "hang_soft"
    assert rounds.fault_records(rounds.round_store(_client(server), 1)) == []


def test_fault_record_rejects_unknown_kind():
    with pytest.raises(ValueError, match="fault kind must be one of"):
        failures.FaultRecord(rank=0, kind="oops")


def test_rounds_generation_base_jumps_past_last_round(server):
    store = _client(server)
    assert rounds.current_round(store) is None
    assert rounds.generation_base(store) == 0
    rounds.publish_round(store, 7)
    assert rounds.current_round(store) == 7
    assert rounds.generation_base(store) == 100
    rounds.publish_round(store, 103)
    assert rounds.generation_base(store) == 200
    assert rounds.job_restarts(store) == 0
    assert rounds.count_job_restart(store, "g100") == 1
    assert rounds.job_restarts(store) == 1


def test_rounds_generation_base_takes_step_by_keyword_only(server):
    store = _client(server)
    rounds.publish_round(store, 7)
    assert rounds.generation_base(store, step=10) == 10
    with pytest.raises(TypeError):
        rounds.generation_base(store, False)  # the former restarted_process flag, positional


class _DictStore:
    """A duck-typed store: torch's Store API in Python, no torch Store underneath."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value

    def add(self, key, n):
        self.data[key] = int(self.data.get(key, 0)) + n
        return self.data[key]

    def check(self, keys_):
        return all(k in self.data for k in keys_)

    def wait(self, keys_, timeout):
        assert self.check(keys_)


def test_a_duck_typed_store_serves_every_barrier_but_the_plain_one():
    store = _DictStore()
    B.barrier(store, "re", 0, 1, 5.0, reentrant=True)
    B.barrier(store, "hook", 0, 1, 5.0, before_release=lambda: None)
    with pytest.raises(TypeError):  # the plain barrier is torch's native Store.barrier
        B.barrier(store, "plain", 0, 1, 5.0)


def test_keys_are_namespaced_per_round():
    assert rounds.round_prefix(0) != rounds.round_prefix(1)
    assert rounds.round_prefix(12).startswith(keys.ROOT)
    with pytest.raises(ValueError, match="round must be >= 0, got -1"):
        rounds.round_prefix(-1)


def test_external_store_address_validation():
    assert client.external_store_address({}) is None
    assert client.external_store_address({"NVRX_STORE_HOST": "h", "NVRX_STORE_PORT": "1234"}) == (
        "h",
        1234,
    )
    with pytest.raises(ValueError, match="NVRX_STORE_PORT"):
        client.external_store_address({"NVRX_STORE_HOST": "h"})
    with pytest.raises(ValueError, match="got 'x'"):
        client.external_store_address({"NVRX_STORE_HOST": "h", "NVRX_STORE_PORT": "x"})
    # The store never falls back to MASTER_PORT.
    assert client.external_store_address({"MASTER_ADDR": "h", "MASTER_PORT": "29500"}) is None


def test_delete_prefix_only_touches_prefix(server):
    store = _client(server)
    store.set("default_pg/0//a", "1")
    store.set("default_pg/0//b", "1")
    store.set("nvrx/keep", "1")
    assert client.delete_prefix(store, "default_pg/") == 2
    assert store.check(["nvrx/keep"])
    assert not store.check(["default_pg/0//a"])


def test_clone_waits_independently(server):
    store = _client(server)
    other = client.clone(store)
    t0 = time.monotonic()
    t = threading.Timer(0.2, lambda: store.set("late", "1"))
    t.start()
    other.wait(["late"])
    t.join()
    assert time.monotonic() - t0 < 10
