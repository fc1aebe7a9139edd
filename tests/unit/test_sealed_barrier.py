"""Sealed barriers and signals (``nvrx.store.barrier`` with a ``Sealing``), and the round
protocol's barriers with the job's secret: a client without it neither releases a barrier
nor keeps an arrival out."""

from __future__ import annotations

import threading

import pytest

from nvrx import jobenv
from nvrx.store import barrier
from nvrx.store.seal import Sealer, new_secret
from nvrx.store.wire import StoreTimeout

SECRET = bytes.fromhex(new_secret())

pytestmark = pytest.mark.timeout(60)


def _store():
    from torch.distributed import HashStore

    return HashStore()


def _sealing(reports: list[tuple[str, int]]) -> barrier.Sealing:
    return barrier.Sealing(Sealer(SECRET, 0), report=lambda key, size: reports.append((key, size)))


class _Waiter(threading.Thread):
    """Waits at a barrier in a thread; what it saw when it was released."""

    def __init__(self, target) -> None:
        super().__init__(daemon=True)
        self.target, self.seen, self.error = target, None, None

    def run(self) -> None:
        try:
            self.seen = self.target()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc


def test_forged_counts_releases_and_arrivals_neither_release_a_sealed_barrier_nor_keep_a_rank_out():
    store, reports, released_by = _store(), [], []
    sealing = _sealing(reports)
    store.add("b/n", 2)  # a forged count: two arrivals that never came
    store.set("b/go", "1")  # a forged release
    store.set("b/a/2", "forged")  # rank 2's arrival, written ahead of it
    assert not barrier.is_released(store, "b", sealing)
    assert barrier.missing_ranks(store, "b", range(3), sealing) == [0, 1, 2]
    waiter = _Waiter(lambda: (barrier.wait(store, "b", 3, 30.0, sealing=sealing), list(released_by)))
    waiter.start()

    def arrive(rank: int) -> bool:
        return barrier.arrive(store, "b", rank, 3, before_release=lambda: released_by.append(rank),
                              sealing=sealing)  # fmt: skip

    assert not arrive(0)  # the count says 3: not every arrival unseals
    assert not arrive(0)  # reentrant: counted once
    assert not arrive(1)
    assert not released_by and waiter.is_alive()
    assert arrive(2)  # its own value replaced the forged one, and completed the barrier
    waiter.join(30)
    assert waiter.error is None and waiter.seen == (None, [2])  # released after the release only
    assert released_by == [2]  # once: the other arrivals that saw the count did not release
    assert barrier.is_released(store, "b", sealing) and barrier.missing_ranks(store, "b", range(3), sealing) == []
    # each forged value reported once, by the process whose value took its place
    assert sorted(reports) == [("b/a/2", 6), ("b/go", 1)]


def test_a_forged_count_ahead_of_the_last_arrival_does_not_release_early():
    store, reports, released_by = _store(), [], []
    sealing = _sealing(reports)

    def arrive(rank: int) -> bool:
        return barrier.arrive(store, "it", rank, 3, reentrant=True,
                              before_release=lambda: released_by.append(rank), sealing=sealing)  # fmt: skip

    assert not arrive(0)
    store.add("it/n", 1)  # a forged arrival: the next one brings the count to 3
    assert not arrive(1)  # ... with rank 2 still out
    assert not arrive(1)  # a proxy's second arrival for it counts nothing
    assert not released_by and not barrier.is_released(store, "it", sealing)
    assert arrive(2)
    assert released_by == [2] and reports == []


def test_of_two_arrivals_that_find_the_barrier_complete_one_releases():
    """Ranks 1 and 2 both wrote their arrival before either counted it (with a forged count
    ahead, both then find every arrival there): one of them runs ``before_release`` and
    releases, the other does not."""
    store, reports, released_by = _store(), [], []
    sealing = _sealing(reports)
    barrier.arrive(store, "c", 0, 3, sealing=sealing)
    store.add("c/n", 1)  # forged
    assert barrier._take(store, "c/a/1", sealing)[0] and barrier._take(store, "c/a/2", sealing)[0]
    closes = [barrier._count_and_close(store, "c", 3, 1, lambda r=r: released_by.append(r), sealing)
              for r in (1, 2)]  # fmt: skip
    assert closes == [True, False] and released_by == [1]
    assert barrier.raised(store, barrier.release_key("c"), sealing)
    assert not store.check([barrier.signal_key(barrier.release_key("c"), 2)])  # released once


def test_a_forged_value_deleted_while_an_arrival_replaces_it_does_not_lose_the_arrival():
    """torch answers a ``compare_set`` on a key deleted meanwhile with the value expected:
    the arrival writes its value all the same."""

    class DeletesOnce:
        def __init__(self, store) -> None:
            self.store, self.deleted = store, False

        def compare_set(self, key, expected, desired):
            if expected and not self.deleted:  # replacing the forged value: it goes first
                self.deleted = self.store.delete_key(key)
            return self.store.compare_set(key, expected, desired)

        def __getattr__(self, name):
            return getattr(self.store, name)

    store, reports = _store(), []
    sealing = _sealing(reports)
    store.set("d/a/0", "forged")
    racing = DeletesOnce(store)
    assert barrier.arrive(racing, "d", 0, 1, sealing=sealing)
    assert racing.deleted and barrier.has_arrived(store, "d", 0, sealing)
    assert reports == [("d/a/0", 6)]


def test_a_signal_passes_over_forged_generations_and_its_waiters_follow():
    store, reports = _store(), []
    sealing = _sealing(reports)
    store.set("s", "forged")
    store.set(barrier.signal_key("s", 2), "forged too")
    waiter = _Waiter(lambda: barrier.await_signal(store, "s", 30.0, sealing))
    waiter.start()
    assert not barrier.raised(store, "s", sealing)
    barrier.signal(store, "s", sealing)
    barrier.signal(store, "s", sealing)  # raised already: nothing more written or reported
    waiter.join(30)
    assert waiter.seen is True and barrier.raised(store, "s", sealing)
    assert not store.check([barrier.signal_key("s", 4)])
    assert reports == [("s", 6), ("s/g2", 10)]
    # without sealing: a plain key, as before
    plain = _store()
    barrier.signal(plain, "p", None)
    assert plain.get("p") == b"1" and barrier.raised(plain, "p", None)


def test_a_rounds_completion_is_not_released_nor_a_spare_woken_by_a_forged_value(tmp_path, monkeypatch):
    """With the job's secret: a forged release of the completion barrier does not make a
    rank that completed read a fault (and restart a round that ended), a forged
    ``completed`` wakes no spare; the ranks' own values pass over them, reported once."""
    from nvrx.store import rounds

    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET.hex())
    secret_file.chmod(0o600)
    monkeypatch.setenv(jobenv.JOB_SECRET_FILE, str(secret_file))
    base = _store()
    round_5 = rounds.round_store(base, 5)
    round_5.set(barrier.release_key(rounds.COMPLETION_BARRIER), "1")
    round_5.set(rounds.COMPLETED, "1")
    reports: list[tuple[str, int]] = []
    report = lambda key, size: reports.append((key, size))  # noqa: E731
    with pytest.raises(StoreTimeout):  # the forged value is waited past, not taken
        rounds.wait_completed(round_5, 0.05)
    spare = _Waiter(lambda: rounds.wait_completed(round_5, 30.0))
    spare.start()
    rounds.mark_completed(round_5, report)  # an active rank returned from its function
    spare.join(30)
    assert spare.error is None and not spare.is_alive()
    ranks = [_Waiter(lambda r=r: rounds.arrive_completion(round_5, r, 3, 30.0, report)) for r in range(3)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(30)
    assert [r.seen for r in ranks] == [True] * 3, [r.error for r in ranks]  # no rank read a fault
    assert rounds.completed(round_5)
    prefix = rounds.round_prefix(5)
    assert sorted(reports) == [(prefix + "completed", 1), (prefix + "completion/go", 1)]
