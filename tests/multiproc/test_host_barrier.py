"""The round protocol's barriers met per host (``nvrx.node_agent.rank_wire``), on a real store.

A host's ranks arrive at their agent's relay, which arrives for all of them in one
``multi_set`` and one ``add`` and holds one wait on the release: what the store serves for
a host does not grow with its ranks. A rank whose agent is absent, silent or gone meets
the barrier at the store itself. In a Wrapper job without a supervisor, the node agent
meets the barriers of the ranks of its host.
"""

from __future__ import annotations

import collections
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvrx.node_agent import rank_wire
from nvrx.node_agent.rank_wire import BarrierRelay, HostBarrierClient, Meeting
from nvrx.store import barrier, rounds
from nvrx.store.seal import ENTRY, Sealer
from nvrx.store.service import StoreService
from nvrx.store.wire import WireStore

sys.path.insert(0, str(Path(__file__).parent))


class Counting:
    """A store client that counts the requests made through it, by method."""

    def __init__(self, store: WireStore, counts: collections.Counter[str]) -> None:
        self.store, self.counts = store, counts

    def __getattr__(self, name: str):
        method = getattr(self.store, name)
        if name in ("close", "timeout", "clone", "set_timeout"):
            return method

        def counted(*args, **kwargs):
            self.counts[name] += 1
            return method(*args, **kwargs)

        return counted


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with StoreService("127.0.0.1", 0) as service:
        yield service.port


def _client(port: int) -> WireStore:
    return WireStore("127.0.0.1", port, timeout=10)


def _fresh(port: int) -> str:
    """A barrier name of its own in the module's store."""
    return f"test/{secrets.token_hex(4)}"


def _address() -> str:
    return f"\0nvrx-test-relay-{secrets.token_hex(6)}"


def test_a_group_arrival_takes_two_requests_and_counts_a_rank_once(port):
    counts: collections.Counter[str] = collections.Counter()
    store, name, opened = Counting(_client(port), counts), _fresh(port), []
    assert not barrier.arrive_group(store, name, [0, 1], 3, before_release=lambda: opened.append(1))
    assert counts == {"multi_set": 1, "add": 1}
    assert not barrier.arrive(store, name, 1, 3, reentrant=True)  # registered: no count
    assert not barrier.is_released(store, name)
    # ranks 0 and 1 again with 2: the count runs past 3, the keys say it is complete
    assert barrier.arrive_group(store, name, [0, 1, 2], 3, before_release=lambda: opened.append(2))
    assert opened == [2] and barrier.is_released(store, name)
    assert not barrier.arrive_group(store, name, [2], 3, before_release=lambda: opened.append(3))
    assert opened == [2]  # released once
    assert not barrier.arrive(store, name, 0, 3, reentrant=True)


def test_a_count_past_the_participants_is_not_a_barrier_complete(port):
    """Rank 0 twice (by itself, then in its host's group): the count says 3 of 3 while
    rank 2 never came; nobody releases, and the timeout names rank 2."""
    store, name = _client(port), _fresh(port)
    barrier.arrive(store, name, 0, 3, reentrant=True)
    assert not barrier.arrive_group(store, name, [0, 1], 3)
    assert int(store.add(f"{name}/n", 0)) == 3 and not barrier.is_released(store, name)
    with pytest.raises(barrier.BarrierTimeout) as caught:
        barrier.wait(store, name, 3, 0.2)
    assert caught.value.missing == [2]


def test_a_sealed_group_arrival_is_one_append_and_forged_arrivals_keep_nobody_out(port):
    """Forged: rank 1's arrival key, and an entry of the group list naming ranks 1 and 2
    (sealed with another secret). Neither counts; the groups' own entries meet the barrier
    past them, and the arrival that closes it reports the forged entry once."""
    counts: collections.Counter[str] = collections.Counter()
    store, name = Counting(_client(port), counts), _fresh(port)
    reports: list[tuple[str, int]] = []
    sealing = barrier.Sealing(Sealer(b"k" * 32, 0), report=lambda key, size: reports.append((key, size)))
    store.set(f"{name}/a/1", "forged")
    forged = Sealer(b"x" * 32, 0).entry(f"{name}/group", "1,2:00")
    store.append(f"{name}/group", forged)
    counts.clear()
    assert not barrier.arrive_group(store, name, [0, 2], 3, sealing=sealing)
    assert (counts["append"], counts["multi_set"], counts["compare_set"]) == (1, 0, 0)
    assert not barrier.has_arrived(store, name, 1, sealing)
    assert barrier.has_arrived(store, name, 2, sealing) and barrier.has_arrived(store, name, 0, sealing)
    assert barrier.missing_ranks(store, name, range(3), sealing) == [1]
    assert reports == []  # not closed yet: nobody reported it
    assert barrier.arrive_group(store, name, [1], 3, sealing=sealing)
    assert barrier.is_released(store, name, sealing)
    assert not barrier.is_released(store, name, barrier.Sealing(Sealer(b"x" * 32, 0)))
    assert reports == [(f"{name}/group", len(forged) - 2)]  # the entry without its two marks


def _meet_all(port: int, address: str | None, meeting: Meeting, ranks, timeout=20.0) -> list:
    """Each of ``ranks`` meets ``meeting`` in a thread of its own; what each raised."""
    raised: list = [None] * len(ranks)

    def one(i: int, rank: int) -> None:
        try:
            HostBarrierClient(address).meet(_client(port), meeting, rank, timeout)
        except Exception as exc:
            raised[i] = exc

    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return raised


def _relay(port: int, counts: collections.Counter[str], local: int) -> BarrierRelay:
    relay = BarrierRelay(_address(), lambda: Counting(_client(port), counts))
    relay.count(local)
    return relay.start()


def _requests_of_one_host(port: int, ranks: int) -> dict[str, int]:
    """The requests one relay makes for ``ranks`` ranks of its host at the initial barrier
    of a generation of their own, which opens (its ``before_release`` ran in the relay)."""
    counts: collections.Counter[str] = collections.Counter()
    relay = _relay(port, counts, ranks)
    generation = 1000 * ranks
    try:
        raised = _meet_all(port, relay.address, Meeting("initial", generation, ranks), range(ranks))
    finally:
        relay.close()
    assert raised == [None] * ranks
    assert rounds.current_round(_client(port)) == generation
    return dict(counts)


def test_a_host_meets_a_barrier_with_the_same_requests_whatever_its_ranks(port, monkeypatch):
    monkeypatch.setattr(rank_wire, "LINGER_S", 30.0)  # every rank comes: no thread start is late
    two, sixteen = _requests_of_one_host(port, 2), _requests_of_one_host(port, 16)
    assert two == sixteen
    assert two["multi_set"] == 1 and two["wait"] == 1  # one arrival, one wait for the host


def test_a_barrier_of_a_round_does_not_wait_for_a_replacement_not_admitted_yet(port, monkeypatch):
    """A replacement waiting to be admitted meets none of the round's barriers: once the
    agent counts it out, the relay sends its peer's held arrival at once (it held it
    ``LINGER_S`` before). The initial barrier, met before any round, waits for every rank
    that beats."""
    from tests.support.waiting import wait_until

    monkeypatch.setattr(rank_wire, "LINGER_S", 600.0)  # only the counts end a hold
    counts: collections.Counter[str] = collections.Counter()
    relay = _relay(port, counts, 2)
    at = 700_000 + secrets.randbelow(10_000) * 100

    def meet_in_thread(meeting: Meeting, rank: int) -> tuple[threading.Thread, list]:
        raised: list = []
        thread = threading.Thread(
            target=lambda: raised.extend(_meet_all(port, relay.address, meeting, [rank]))
        )
        thread.start()
        wait_until("the arrival held", lambda: meeting in relay._held, 20)
        return thread, raised

    try:
        # rank 1's replacement beats: counted among the host's ranks, not the round's
        thread, raised = meet_in_thread(Meeting("termination", at, 1), 0)
        relay.count(relay.local_ranks, 1)  # the agent's count: sent at once, not after LINGER_S
        thread.join(30)
        assert raised == [None] and counts["multi_set"] == 1

        initial = Meeting("initial", at, 2)
        thread, raised = meet_in_thread(initial, 0)
        assert _meet_all(port, relay.address, Meeting("termination", at + 1, 1), [0]) == [None]
        assert initial in relay._held  # the relay looked again since, and still holds it
        assert _meet_all(port, relay.address, initial, [1]) == [None]
        thread.join(30)
        assert raised == [None] and counts["multi_set"] == 3  # both ranks in one arrival
    finally:
        relay.close()


def test_two_hosts_meet_one_barrier_each_through_its_relay(port, monkeypatch):
    monkeypatch.setattr(rank_wire, "LINGER_S", 30.0)
    counts: collections.Counter[str] = collections.Counter()
    relays = [_relay(port, counts, 3), _relay(port, counts, 3)]
    meeting, raised = Meeting("termination", 7, 6), [None] * 6
    try:
        threads = [
            threading.Thread(target=lambda h=h: raised.__setitem__(
                slice(3 * h, 3 * h + 3), _meet_all(port, relays[h].address, meeting, range(3 * h, 3 * h + 3))))
            for h in (0, 1)
        ]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for relay in relays:
            relay.close()
    assert raised == [None] * 6
    assert counts["multi_set"] == 2 and counts["wait"] == 2
    # the closer's one look at the arrivals, its closing, its release: no more on a first try
    assert counts["check"] == 1 and counts["compare_set"] == 1 and counts["set"] == 1


def test_ranks_without_an_agent_meet_at_the_store(port):
    meeting = Meeting("termination", 11, 3)
    assert _meet_all(port, _address(), meeting, range(3)) == [None] * 3  # nothing bound there
    assert rounds.await_barrier(_client(port), "termination", 11, 3, 1.0)


def test_a_rank_whose_agent_does_not_answer_arrives_itself(port, monkeypatch):
    monkeypatch.setattr(rank_wire, "ACK_S", 0.3)
    address = _address()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as silent:
        silent.bind(address)  # bound, never read
        assert _meet_all(port, address, Meeting("termination", 12, 2), range(2)) == [None, None]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["closes", "vanishes"])
def test_a_rank_whose_agent_ends_while_it_waits_is_released_at_the_store(port, monkeypatch, end):
    """Rank 0's arrival went through the relay, which then ends: closed, it tells rank 0 at
    once (its resend would come only after this test's timeout); gone without a word, rank
    0 finds it gone at its next resend. Rank 0 then waits at the store, where rank 1
    (without an agent) completes the barrier."""
    from tests.support.waiting import wait_until

    monkeypatch.setattr(rank_wire, "RESEND_S", 3600.0 if end == "closes" else 0.2)
    counts: collections.Counter[str] = collections.Counter()
    relay = _relay(port, counts, 1)
    meeting, at = Meeting("termination", 13 if end == "closes" else 17, 2), []
    first = threading.Thread(target=lambda: at.extend(_meet_all(port, relay.address, meeting, [0])))
    first.start()
    name = rounds.termination_barrier(meeting.at)
    wait_until("the relay's arrival", lambda: barrier.has_arrived(_client(port), name, 0), 10)
    if end == "closes":
        relay.close()
    else:  # as when its process is killed: no word, and its socket is gone
        relay._stop.set()
        relay._thread.join()
        relay._sock.close()
    assert _meet_all(port, None, meeting, [1]) == [None]
    first.join()
    assert at == [None]


def test_a_relay_that_waits_for_a_rank_that_does_not_come_goes_after_its_linger(port, monkeypatch):
    """The relay serves 3 ranks, 2 come (the third is outside the barrier): it arrives for
    the two once ``LINGER_S`` passed, in one arrival."""
    monkeypatch.setattr(rank_wire, "LINGER_S", 2.0)
    counts: collections.Counter[str] = collections.Counter()
    relay = _relay(port, counts, 3)
    try:
        assert _meet_all(port, relay.address, Meeting("termination", 15, 2), [0, 1]) == [None, None]
    finally:
        relay.close()
    assert counts["multi_set"] == 1 and counts["wait"] == 1


def test_a_relay_drops_what_is_not_an_arrival_and_serves_on(port):
    counts: collections.Counter[str] = collections.Counter()
    relay = _relay(port, counts, 1)
    junk = [b"not json", b"[1, 2]", b'{"op": "arrive"}',
            b'{"op": "arrive", "kind": "termination", "at": 16, "world": 1, "rank": 0, '
            b'"reply": "x", "timeout": "soon"}',
            b'{"op": "arrive", "kind": "termination", "at": 16, "world": 1, "rank": 9, "reply": "x"}',
            b'{"op": "arrive", "kind": "nope", "at": 16, "world": 1, "rank": 0, "reply": "x"}']  # fmt: skip
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            for datagram in junk:
                sender.sendto(datagram, relay.address)
        assert _meet_all(port, relay.address, Meeting("termination", 16, 1), [0]) == [None]
    finally:
        relay.close()
    assert counts["multi_set"] == 1  # the one real arrival


@pytest.mark.skipif(os.geteuid() != 0, reason="sending as another user needs root")
def test_a_relay_drops_an_arrival_of_another_user(port):
    """An arrival of uid 65534 at the relay's abstract name (which any user of the host can
    reach) for a barrier of one rank is not met: the one arrival the relay makes is the
    real rank's, at the next barrier."""
    counts: collections.Counter[str] = collections.Counter()
    relay = _relay(port, counts, 1)
    forged = (b'{"op": "arrive", "kind": "termination", "at": 30, "world": 1, "rank": 0, '
              b'"reply": "x"}')  # fmt: skip
    pid = os.fork()
    if pid == 0:  # the other user
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
                sender.sendto(forged, relay.address)
            code = 0
        finally:
            os._exit(code)
    try:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # it was sent
        assert _meet_all(port, relay.address, Meeting("termination", 31, 1), [0]) == [None]
    finally:
        relay.close()
    assert counts["multi_set"] == 1  # the real rank's arrival only


def test_with_the_jobs_secret_a_forged_group_entry_is_reported_by_a_rank(
    port, tmp_path, monkeypatch
):
    """A forged entry naming both ranks stands in the barrier's group list ahead of the
    host's arrival: the relay's own entry meets the barrier, the relay closes it, and the
    batch's lowest rank reports the forged entry once (as a rank that closed it itself
    would have)."""
    from nvrx import jobenv
    from nvrx.store.seal import new_secret

    secret = tmp_path / "secret"
    secret.write_text(new_secret())
    secret.chmod(0o600)
    monkeypatch.setenv(jobenv.JOB_SECRET_FILE, str(secret))
    monkeypatch.setattr(rank_wire, "LINGER_S", 30.0)
    name = rounds.termination_barrier(21)
    _client(port).append(f"{name}/group", f"{ENTRY}0,1:00{ENTRY}")
    counts: collections.Counter[str] = collections.Counter()
    relay, reports, raised = _relay(port, counts, 2), [], []

    def rank(r: int) -> None:
        try:
            HostBarrierClient(relay.address).meet(
                _client(port), Meeting("termination", 21, 2), r, 20.0,
                on_forged=lambda key, size: reports.append((r, key, size)),
            )  # fmt: skip
        except Exception as exc:
            raised.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        relay.close()
    assert raised == [] and reports == [(0, f"{name}/group", len("0,1:00"))]
    assert counts["append"] == 1 and counts["multi_set"] == 0 and counts["wait"] == 1
    assert counts["compare_set"] == 2  # the closing and the release: no arrival key taken


def test_a_relay_whose_kept_connection_broke_arrives_on_a_new_one(port, monkeypatch):
    """The connection the relay kept from its last barrier was closed (its store went away
    meanwhile, as a rank-hosted store does after each call): the next barrier is met on a
    new connection, not left to the ranks."""
    monkeypatch.setattr(rank_wire, "LINGER_S", 30.0)
    counts: collections.Counter[str] = collections.Counter()
    relay = _relay(port, counts, 2)
    try:
        assert _meet_all(port, relay.address, Meeting("termination", 22, 2), [0, 1]) == [None] * 2
        assert len(relay._idle) == 1  # kept before the ranks heard of the release
        for kept in relay._idle:
            kept.store.close()
        assert _meet_all(port, relay.address, Meeting("termination", 23, 2), [0, 1]) == [None] * 2
    finally:
        relay.close()
    assert barrier.has_arrived(_client(port), rounds.termination_barrier(23), 1)
    assert counts["multi_set"] == 3  # the second barrier's first try failed on the closed one


def test_a_relay_whose_connection_broke_after_it_took_the_closing_releases_on_a_new_one(
    port, monkeypatch
):
    """The kept connection breaks between the closing, which the relay's arrival took, and
    the release: the arrival, tried on a new connection, finds the closing its own and
    releases the barrier (not left to nobody until the ranks' deadline)."""
    monkeypatch.setattr(rank_wire, "LINGER_S", 30.0)
    counts: collections.Counter[str] = collections.Counter()
    armed = threading.Event()

    class BreaksAtRelease(Counting):
        def set(self, key, value):
            if armed.is_set() and key == barrier.release_key(rounds.termination_barrier(26)):
                armed.clear()
                self.store.close()
                raise ConnectionResetError("the store dropped the connection")
            return Counting.__getattr__(self, "set")(key, value)

    relay = BarrierRelay(_address(), lambda: BreaksAtRelease(_client(port), counts))
    relay.count(2)
    relay.start()
    try:
        assert _meet_all(port, relay.address, Meeting("termination", 25, 2), [0, 1]) == [None] * 2
        armed.set()
        meeting = Meeting("termination", 26, 2)
        assert _meet_all(port, relay.address, meeting, [0, 1], timeout=8.0) == [None] * 2
    finally:
        relay.close()
    assert not armed.is_set()  # the break happened
    assert counts["multi_set"] == 3  # the second barrier's arrival was made twice


_KILLED_WHILE_CLOSING = """
import os, signal, sys
from nvrx.node_agent.rank_wire import BarrierRelay
from nvrx.store.wire import WireStore

class KilledAtRelease(WireStore):
    def set(self, key, value):
        if key.endswith("/go"):  # the closing is taken: the release is the next write
            os.kill(os.getpid(), signal.SIGKILL)
        return super().set(key, value)

relay = BarrierRelay("\\0" + sys.argv[1], lambda: KilledAtRelease("127.0.0.1", int(sys.argv[2]), 10))
relay.count(2)
relay.start()
print("ready", flush=True)
sys.stdin.read()
"""


def test_ranks_whose_agent_was_killed_while_it_closed_their_barrier_close_it(port, monkeypatch):
    """A host's agent (its relay, in a process of its own) takes the closing of the barrier
    its arrival completed and is killed before it releases: its ranks, which heard no
    ``arrived``, arrive at the store themselves, and the first finds the closing held by a
    process of its host that ended: it closes the barrier, well before its timeout."""
    monkeypatch.setattr(rank_wire, "ACK_S", 1.0)
    address, root = _address(), str(Path(__file__).parents[2])
    arrive_one = rounds.arrive_one

    def after_the_agent_ended(*args, **kwargs):  # a slow agent closes it itself otherwise
        agent.wait(timeout=60)
        return arrive_one(*args, **kwargs)

    monkeypatch.setattr(rounds, "arrive_one", after_the_agent_ended)
    agent = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WHILE_CLOSING, address[1:], str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=root,
        env={**os.environ, "PYTHONPATH": root},
    )  # fmt: skip
    try:
        assert agent.stdout.readline() == b"ready\n"
        at = 800_000 + secrets.randbelow(10_000) * 100
        raised = _meet_all(port, address, Meeting("termination", at, 2), [0, 1], timeout=60.0)
        assert agent.wait(timeout=30) == -9  # killed at the release, after it took the closing
    finally:
        agent.kill()
        agent.wait()
    assert raised == [None, None]
    store, name = _client(port), rounds.termination_barrier(at)
    assert barrier.has_arrived(store, name, 0) and barrier.has_arrived(store, name, 1)


def test_an_arrival_tried_again_while_it_opened_a_generation_opens_it_once(port):
    """The arrival that closes a generation's initial barrier loses its connection while it
    opens the generation (its restart counted already): tried again with the same token, it
    opens it again and releases, and the restart counts once; tried once more after the
    release, it runs nothing again; another token does not close it."""
    store, generation = _client(port), 500_000 + secrets.randbelow(10_000) * 100
    armed = threading.Event()
    armed.set()

    class BreaksAtPublish(Counting):
        def set(self, key, value):
            if armed.is_set() and key == rounds.CURRENT_ROUND:
                armed.clear()
                raise ConnectionResetError("the store dropped the connection")
            return Counting.__getattr__(self, "set")(key, value)

    counts: collections.Counter[str] = collections.Counter()
    release = barrier.release_key(rounds.initial_barrier(generation))
    before = rounds.job_restarts(store)
    with pytest.raises(ConnectionResetError):
        rounds.arrive_group(BreaksAtPublish(_client(port), counts), "initial", generation, [0, 1], 2, None, "a")
    assert rounds.job_restarts(store) == before + 1 and not barrier.raised(store, release, None)
    again = {"on_forged": None, "closer": "a", "again": True}
    assert rounds.arrive_group(_client(port), "initial", generation, [0, 1], 2, **again)
    assert rounds.job_restarts(store) == before + 1 and barrier.raised(store, release, None)
    torch_key = f"{rounds.TORCH_DEFAULT_PG_PREFIX}test-{secrets.token_hex(4)}"
    store.set(torch_key, "written by a released rank")
    assert rounds.arrive_group(_client(port), "initial", generation, [0, 1], 2, **again)
    assert store.check([torch_key])  # the generation was not opened again: nothing cleared
    assert not rounds.arrive_group(_client(port), "initial", generation, [0, 1], 2, None, "b")


@pytest.mark.timeout(60)
def test_ranks_whose_relay_cannot_reach_the_store_meet_at_the_store_at_once(port, monkeypatch):
    """The relay fails to connect: it says so, and its ranks do not wait ``ACK_S`` (made far
    longer than this test's timeout) before they meet the barrier at the store."""
    monkeypatch.setattr(rank_wire, "ACK_S", 3600.0)

    def unreachable():
        raise ConnectionRefusedError("no store here")

    relay = BarrierRelay(_address(), unreachable)
    relay.count(2)
    relay.start()
    try:
        assert _meet_all(port, relay.address, Meeting("termination", 24, 2), [0, 1]) == [None] * 2
    finally:
        relay.close()


@pytest.mark.timeout(60)
def test_ranks_whose_relay_fails_while_they_wait_meet_at_the_store_at_once(port, monkeypatch):
    """The relay arrived for both ranks (and released the barrier), then its wait fails: it
    says so, and the ranks find the release at the store (a resend would come only after
    this test's timeout)."""
    monkeypatch.setattr(rank_wire, "RESEND_S", 3600.0)
    monkeypatch.setattr(rank_wire, "LINGER_S", 30.0)

    class WaitFails(Counting):
        def wait(self, *args, **kwargs):
            raise ConnectionResetError("the store dropped the wait")

    counts: collections.Counter[str] = collections.Counter()
    relay = BarrierRelay(_address(), lambda: WaitFails(_client(port), counts))
    relay.count(2)
    relay.start()
    try:
        raised = _meet_all(port, relay.address, Meeting("termination", 25, 2), [0, 1])
    finally:
        relay.close()
    assert raised == [None, None] and counts["multi_set"] == 1


@pytest.mark.timeout(60)
def test_a_held_batch_goes_once_the_agent_serves_fewer_ranks(port, monkeypatch):
    """The relay holds two ranks' arrivals for a third of its host (``LINGER_S`` made longer
    than this test's timeout); that rank ends (the agent serves 2 now): they go at once."""
    from tests.support.waiting import wait_until

    monkeypatch.setattr(rank_wire, "LINGER_S", 3600.0)
    counts: collections.Counter[str] = collections.Counter()
    relay = _relay(port, counts, 3)
    raised: list = []
    try:
        ranks = threading.Thread(
            target=lambda: raised.extend(_meet_all(port, relay.address, Meeting("termination", 26, 2), [0, 1]))
        )
        ranks.start()
        wait_until("both arrivals held", lambda: sum(len(b.replies) for b in list(relay._held.values())) == 2, 20)
        relay.count(2)
        ranks.join()
    finally:
        relay.close()
    assert raised == [None, None] and counts["multi_set"] == 1


def test_a_barrier_that_times_out_through_the_relay_names_who_is_missing(port):
    counts: collections.Counter[str] = collections.Counter()
    relay = _relay(port, counts, 2)
    try:
        raised = _meet_all(port, relay.address, Meeting("termination", 14, 3), [0, 1], timeout=1.0)
    finally:
        relay.close()
    assert all(isinstance(e, barrier.BarrierTimeout) and e.missing == [2] for e in raised), raised
    # the whole wait, not the remainder the rank had left once the relay's wait ran out
    assert all(e.timeout == 1.0 and "timed out after 1 s" in str(e) for e in raised), raised


def _met(log: str, barrier_of: str) -> set[int]:
    """The ranks an agent's log says it arrived for at ``barrier_of`` (``iteration 0``)."""
    ranks: set[int] = set()
    for line in log.splitlines():
        if f"barrier {barrier_of}: arrived for ranks [" in line:
            ranks.update(int(r) for r in line.split("ranks [")[1].split("]")[0].split(","))
    return ranks


def test_a_wrapper_job_without_supervisor_meets_its_barriers_at_the_node_agent(tmp_path):
    """4 ranks on one host, rank 1 raises once: the node agent arrives for all four at the
    round's iteration barrier and at the termination barrier (its log says so)."""
    from helpers_inprocess import FAST, launch

    wrapper = dict(FAST, monitor_process_logfile=str(tmp_path / "monitor-{rank}.log"))
    ranks = launch(tmp_path / "job", 4, wrapper=wrapper, fault="exception", fault_ranks=[1])
    assert ranks.wait(120) == [0, 0, 0, 0], ranks.logs()
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("monitor-*.log"))
    assert _met(logs, "iteration 0") == {0, 1, 2, 3}, logs
    assert _met(logs, "termination 0") == {0, 1, 2, 3}, logs


# The group's timeout is well below the Wrapper's hard timeout, as docs/abort.md asks:
# a rank that gloo keeps in a collective after the abort (its known race: a queued send
# it does not fail) then restarts in-process too, rather than at the hard timeout in a
# new process that meets the barriers as a replacement.
RAISES_ONCE = """
from datetime import timedelta

import torch.distributed as dist
import nvrx.inprocess as inprocess


@inprocess.Wrapper()
def train(call_wrapper: inprocess.CallWrapper = None) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    if RANK == 1 and call_wrapper.iteration == 0:
        raise RuntimeError("bad batch")
    dist.barrier()


train()
"""


@pytest.mark.timeout(240)
def test_under_a_supervisor_the_node_agent_meets_the_barriers_of_its_node(tmp_path):
    """2 nodes of 2 Wrapper ranks, rank 1 raises once: each node agent arrives for
    its ranks at the round's iteration barrier (the supervisors' verbose output says so),
    and the job completes."""
    from test_supervisor_local import Job, script

    job = Job(tmp_path, 2, 2, script(tmp_path, RAISES_ONCE), "--verbose")
    assert job.wait(180) == [0, 0], job.output()
    out = job.output()
    node = {line.split("nvrx.node_agent[")[1].split("]")[0] for line in out.splitlines()
            if "barrier iteration 0: arrived for ranks" in line}  # fmt: skip
    assert _met(out, "iteration 0") == {0, 1, 2, 3} and len(node) == 2, out  # one agent a node
