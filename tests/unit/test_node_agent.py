"""The node agent of a Wrapper job without a supervisor (``nvrx.node_agent.host``), and a monitor's
link to it (``nvrx.inprocess.agent_link``).

In-process: each host's agent is a ``NodeAgent`` on a real datagram socket at an
abstract address, beside a real TCPStore (the ``base`` fixture), driven step by step
with explicit monotonic times; each rank's monitor is a real ``BeatSender``. Then the
real thing: monitors' ``AgentLink`` start one agent process per host, which beats,
comes back after it is killed, and ends by itself, leaving no file behind.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from nvrx.inprocess import agent_link
from nvrx.inprocess import store as rstore
from nvrx.inprocess.monitor_process import MonitorConfig
from nvrx.node_agent import host as node_agent
from nvrx.node_agent.host import HostConfig
from nvrx.node_agent.rank_wire import Beat, BeatSender, BeatSocket
from nvrx.store import barrier, client, host_ring, keys, ring, rounds
from nvrx.store.host_ring import ENTRIES, RING, list_ended, list_rank, live_ranks, register
from nvrx.store.wire import WireStore
from tests.support.waiting import wait_until

TIMEOUT = 0.5
INTERVAL = 0.05
WORLD = 4


def _claims(store, slot: int) -> int:
    """How many entries end host ``slot``'s place in the ring."""
    return len(ring.read_claims(store, RING, ENTRIES, slot).valid)


def _config(**fields: Any) -> MonitorConfig:
    values: dict[str, Any] = dict(
        target_pid=0, board_path="", initial_rank=0, monitor_process_interval=0.0,
        heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT, soft_timeout=60.0,
        hard_timeout=60.0, termination_grace_time=1.0, logfile=None,
        store_host="127.0.0.1", store_port=1, initial_world_size=WORLD,
    )  # fmt: skip
    values.update(fields)
    return MonitorConfig(**values)


CFG = _config()
LIMITS = node_agent.limits_of(HostConfig.of(CFG))


class Counting:
    """A store client that counts the requests it passes on."""

    def __init__(self, store: Any) -> None:
        self.store, self.requests = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.requests += 1
            return method(*args)

        return counted


class Host:
    """One host: its agent on an abstract socket, the monitors of its ranks, the events."""

    def __init__(self, store: Any, name: str, ranks: list[int]) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.address = f"\0nvrx-test-{uuid.uuid4().hex}"
        self.sock = BeatSocket(self.address)
        slot = register(store, node_agent.host_key(HostConfig.of(CFG), name))
        for rank in ranks:  # what each monitor writes before its rank goes on
            list_rank(store, slot, rank)
        emit = lambda kind, **f: self.events.append((kind, f))  # noqa: E731
        self.agent = node_agent.NodeAgent(HostConfig.of(CFG), self.sock, emit, name, store=store)
        self.monitors = {rank: BeatSender(self.address) for rank in ranks}

    def beat(self, *ranks: int, bye: bool = False) -> None:
        for rank in ranks:
            beat = Beat(rank, pid=2000 + rank, rank=rank, world_size=WORLD, round=0,
                        timeout=TIMEOUT, bye=bye)  # fmt: skip
            assert self.monitors[rank].send(beat)

    def faults(self) -> list[tuple[int, str]]:
        return sorted((f["origin_rank"], f["fault_kind"]) for k, f in self.events if k == "fault")

    def close(self) -> None:
        self.sock.close(unlink=False)
        for sender in self.monitors.values():
            sender.close()


@pytest.fixture
def hosts(base):
    made: list[Host] = []

    def make(name: str, ranks: list[int], store: Any = None) -> Host:
        made.append(Host(base if store is None else store, name, ranks))
        return made[-1]

    yield make
    for host in made:
        host.close()
    # a duty call that raised is only logged by the loop: here it is a failure of the test
    assert [host.agent.loop.failures for host in made] == [0] * len(made)


def _round(store: Any) -> Any:
    """Round 0 at world size ``WORLD``, each rank at its initial rank."""
    rounds.publish_round(store, 0)
    view = rstore.round_store(store, 0)
    for rank in range(WORLD):
        view.set(rounds.rank_state(rank), json.dumps({"initial_rank": rank, "world_size": WORLD}))
    return view


def _termination_arrivals(store: Any) -> int:
    return int(store.add(barrier._count_key(rounds.termination_barrier(0)), 0))


def test_only_the_agent_talks_to_the_store_two_requests_per_tick(base, hosts) -> None:
    counted = Counting(base)
    h = hosts("h0", [0, 1, 2], store=counted)
    t = time.monotonic()
    for i in range(3):
        h.beat(0, 1, 2)
        h.agent.step(t + i * INTERVAL)
    before = counted.requests
    for i in range(3, 6):
        h.beat(0, 1, 2)
        h.agent.step(t + i * INTERVAL)
    # its counter and the next host's counter: none per rank (one host: no next host)
    assert counted.requests - before == 3
    assert int(base.add(RING.alive(h.agent.slot), 0)) == 6
    assert h.faults() == []


def test_a_tick_reads_the_next_hosts_counter_and_its_claim_only_while_it_stands_still(
    base, hosts
) -> None:
    """Two requests per tick while the next host beats; one more, for its claim, while its
    counter stands still."""
    counted = Counting(base)
    b = hosts("h1", [1])  # first: h0, which registers after it, watches it from the start
    a = hosts("h0", [0], store=counted)
    t = time.monotonic()
    for i in range(2):  # the first tick reads h0's own claim besides
        a.beat(0), b.beat(1)
        b.agent.step(t + i * INTERVAL), a.agent.step(t + i * INTERVAL)
    before = counted.requests
    a.beat(0), b.beat(1)
    b.agent.step(t + 2 * INTERVAL), a.agent.step(t + 2 * INTERVAL)
    assert counted.requests - before == 2  # its counter, h1's counter
    before = counted.requests
    a.beat(0)
    a.agent.step(t + 3 * INTERVAL)  # h1 did not beat
    assert counted.requests - before == 3  # its counter, h1's counter, h1's claim


def test_a_rank_silent_for_its_timeout_is_taken_out_once(base, hosts) -> None:
    view = _round(base)
    h = hosts("h0", [0, 1])
    t = time.monotonic()
    h.beat(0, 1)
    h.agent.step(t)
    h.beat(0)
    h.agent.step(t + TIMEOUT / 2)
    assert rstore.terminated_ranks(view) == set()
    for dt in (TIMEOUT + 0.1, 2 * TIMEOUT + 0.2):
        h.beat(0)
        h.agent.step(t + dt)
    assert rstore.terminated_ranks(view) == {1}
    assert h.faults() == [(1, "unresponsive")]
    assert [(f["rank"], f["round"]) for _, f in h.events] == [(1, 0)]  # as its monitor's would
    # silent since its last beat, at the first step, until the step that found it: the
    # report counts the fault from that beat
    assert [f["detection_s"] for _, f in h.events] == [pytest.approx(TIMEOUT + 0.1)]
    assert _termination_arrivals(base) == 1  # nobody waits for it at the end
    assert h.agent.done == {1}


def test_ranks_silent_since_different_moments_leave_the_round_in_one_call(
    base, hosts, monkeypatch
) -> None:
    """Ranks 1 and 2 fall silent 0.2 s apart while no round names them; once one does,
    both are taken out of it by one ``leave_round`` (one round read, one pass over the
    ranks' states), each with its event saying how long that rank had been silent."""
    calls: list[list[int]] = []
    real = rounds.leave_round

    def counted(base_: Any, ranks: list[int], *args: Any, **kw: Any) -> Any:
        calls.append(sorted(ranks))
        return real(base_, ranks, *args, **kw)

    monkeypatch.setattr(rounds, "leave_round", counted)
    h = hosts("h0", [0, 1, 2])
    t = time.monotonic()
    h.beat(0, 1, 2)
    h.agent.step(t)
    h.beat(0, 1)
    h.agent.step(t + 0.2)
    for dt in (TIMEOUT + 0.1, TIMEOUT + 0.3):  # rank 2 found silent, then rank 1: no round yet
        h.beat(0)
        h.agent.step(t + dt)
    assert h.faults() == [] and set(h.agent._out) == {1, 2}
    view = _round(base)
    calls.clear()
    now = t + TIMEOUT + 0.4 + LIMITS.replace_s
    h.beat(0)
    h.agent.step(now)
    assert calls == [[1, 2]]
    assert rstore.terminated_ranks(view) == {1, 2}
    silent = {f["origin_rank"]: f["detection_s"] for _, f in h.events}
    assert silent == {1: pytest.approx(now - t - 0.2), 2: pytest.approx(now - t)}


def test_a_rank_that_said_bye_or_ended_in_the_store_is_not_taken_out(base, hosts) -> None:
    view = _round(base)
    h = hosts("h0", [0, 1, 2])
    t = time.monotonic()
    h.beat(0, 1, 2)
    h.agent.step(t)
    h.beat(1, bye=True)
    list_ended(base, h.agent.slot, 2)  # its end, written; its bye never came
    h.beat(0)
    h.agent.step(t + TIMEOUT + 0.1)
    h.beat(0)
    h.agent.step(t + TIMEOUT + 0.1 + LIMITS.replace_s)
    assert rstore.terminated_ranks(view) == set() and h.faults() == []


def test_a_listed_rank_that_never_beat_gets_a_full_timeout_then_is_taken_out(base, hosts) -> None:
    """Rank 1's monitor wrote it in the host's list but its beats never came (the agent
    started after it died)."""
    view = _round(base)
    h = hosts("h0", [0, 1])
    t = time.monotonic()
    h.beat(0)
    h.agent.step(t + TIMEOUT / 2)
    assert rstore.terminated_ranks(view) == set()
    h.beat(0)
    h.agent.step(t + TIMEOUT + 0.1)
    assert rstore.terminated_ranks(view) == {1}


def test_a_rank_silent_before_its_round_is_taken_out_once_a_round_names_it(base, hosts) -> None:
    h = hosts("h0", [0, 1])
    t = time.monotonic()
    h.beat(0, 1)
    h.agent.step(t)
    h.beat(0)
    h.agent.step(t + TIMEOUT + 0.1)
    assert h.faults() == []  # in no round: nothing to take it out of
    view = _round(base)
    h.agent.step(t + TIMEOUT + 0.2)  # too early to try again
    assert rstore.terminated_ranks(view) == set()
    h.agent.step(t + TIMEOUT + 0.1 + LIMITS.replace_s)
    assert rstore.terminated_ranks(view) == {1}
    assert h.faults() == [(1, "unresponsive")]


def test_a_rank_that_beat_again_after_a_silence_is_found_silent_again(base, hosts) -> None:
    h = hosts("h0", [1])
    t = time.monotonic()
    h.beat(1)
    h.agent.step(t)
    h.agent.step(t + TIMEOUT + 0.1)  # silent, in no round
    h.beat(1)
    h.agent.step(t + 2)
    view = _round(base)
    h.agent.step(t + 2 + TIMEOUT + 0.1)
    assert rstore.terminated_ranks(view) == {1}


def test_a_silent_host_is_taken_out_by_the_agent_watching_it(base, hosts) -> None:
    view = _round(base)
    a, b = hosts("h0", [0, 1]), hosts("h1", [2, 3])
    t = time.monotonic()
    for i in range(3):
        a.beat(0, 1), b.beat(2, 3)
        a.agent.step(t + i * INTERVAL), b.agent.step(t + i * INTERVAL)
    now = t + 2 * INTERVAL
    while not a.faults() and now < t + 3 * LIMITS.host_s:  # h1's agent stopped beating
        now += INTERVAL
        a.beat(0, 1)
        a.agent.step(now)
    assert now - t >= LIMITS.host_s
    assert rstore.terminated_ranks(view) == {2, 3}
    assert a.faults() == [(2, "unresponsive"), (3, "unresponsive")]
    assert all(f["message"].startswith("its host sent no heartbeat") for _, f in a.events)
    # the faults are h1's, though h0's agent wrote them: the report must not blame h0
    assert [f["rank_host"] for _, f in a.events] == ["h1", "h1"]
    # h1's agent last beat at the third step: its ranks count as silent since then, give or
    # take the step that saw it stand still, and the millisecond the event rounds to
    silent = pytest.approx(now - (t + 2 * INTERVAL), abs=INTERVAL + 1e-3)
    assert [f["detection_s"] for _, f in a.events] == [silent] * 2
    assert _claims(base, b.agent.slot) == 1  # its place ended
    assert a.agent.done == set()  # not its own ranks
    assert _termination_arrivals(base) == 2  # nobody waits for them at the end
    # h1's agent thaws: its next beat shows the fence, it reads the claim and beats no more,
    # not even in a place of its own after its store connection was made again
    fenced, slot = int(base.add(RING.alive(b.agent.slot), 0)), b.agent.slot
    assert fenced >= ring.FENCE
    assert b.agent.step(now + INTERVAL) and b.agent.fenced
    b.agent._drop_store()
    b.agent._attach(base, now + 2 * INTERVAL)  # connected again (this test's store: no address)
    assert b.agent.step(now + 2 * INTERVAL)  # the store answers
    assert b.agent.slot == slot and b.agent.place is None
    assert int(base.add(RING.alive(slot), 0)) == fenced + 1
    assert int(base.add(keys.HOST_COUNT, 0)) == 2  # no new place taken
    b.agent._drop_store()
    b.agent._attach(_Gone(), now + 3 * INTERVAL)  # fenced, it still finds a store gone
    assert not b.agent.step(now + 3 * INTERVAL)


def test_a_host_lost_before_its_ranks_wrote_their_state_in_the_round_is_taken_out(
    base, hosts
) -> None:
    """Round 0 was published and h0's ranks wrote their state there; h1 died before its ranks
    did. Numbered as they began (no rank left before, no state shows another numbering),
    they stand at their initial ranks: taken out, h1's place ended, nobody waits for them."""
    rounds.publish_round(base, 0)
    view = rstore.round_store(base, 0)
    for rank in (0, 1):
        view.set(rounds.rank_state(rank), json.dumps({"initial_rank": rank, "world_size": WORLD}))
    a, b = hosts("h0", [0, 1]), hosts("h1", [2, 3])
    t = now = time.monotonic()
    for _ in range(3):
        now += INTERVAL
        a.beat(0, 1), b.beat(2, 3)
        a.agent.step(now), b.agent.step(now)
    while not a.faults() and now < t + 3 * LIMITS.host_s:  # h1 stopped beating
        now += INTERVAL
        a.beat(0, 1)
        a.agent.step(now)
    assert rstore.terminated_ranks(view) == {2, 3}
    assert a.faults() == [(2, "unresponsive"), (3, "unresponsive")]
    assert _claims(base, b.agent.slot) == 1
    assert _termination_arrivals(base) == 2


def test_a_rank_that_died_with_its_monitor_before_writing_its_state_is_taken_out(
    base, hosts
) -> None:
    """Its process group killed (its monitor with it) as the round began: no state of its own
    in the round, nobody else leaves for it but its host's agent."""
    rounds.publish_round(base, 0)
    view = rstore.round_store(base, 0)
    view.set(rounds.rank_state(0), json.dumps({"initial_rank": 0, "world_size": WORLD}))
    h = hosts("h0", [0, 1])
    t = time.monotonic()
    h.beat(0, 1)
    h.agent.step(t)
    for dt in (TIMEOUT + 0.1, 2 * TIMEOUT + 0.2):
        h.beat(0)
        h.agent.step(t + dt)
    assert rstore.terminated_ranks(view) == {1}
    assert h.faults() == [(1, "unresponsive")]


def _h1_silent_in_no_round(base: Any, a: Host, b: Host) -> float:
    """Round 0 runs ranks 0, 1 and 3; h1's agent (rank 2, in no round) stops beating until
    h0 finds h1 silent and its take-out finds rank 2 in no round, to try again: the time."""
    rounds.publish_round(base, 0)
    view = rstore.round_store(base, 0)
    for rank, initial in enumerate((0, 1, 3)):
        view.set(rounds.rank_state(rank), json.dumps({"initial_rank": initial, "world_size": 3}))
    t = now = time.monotonic()
    for _ in range(3):
        now += INTERVAL
        a.beat(0, 1), b.beat(2)
        a.agent.step(now), b.agent.step(now)
    while b.agent.slot not in a.agent._silent_hosts and now < t + 4 * LIMITS.host_s:
        now += INTERVAL
        a.beat(0, 1)
        a.agent.step(now)
    assert b.agent.slot in a.agent._silent_hosts and a.faults() == []
    return now


def test_a_silent_host_whose_place_beats_again_before_any_take_out_is_watched_again(
    base, hosts
) -> None:
    """h1's agent stops beating while its only rank, 2, is in no round (the round runs
    without it): h0 finds h1 silent, and its take-out finds rank 2 in no round, to try
    again. Rank 3 then starts on h1, in the place h1 still holds, and the agent it starts
    beats there. h1 is alive: h0 takes nobody of h1 out (rank 3 is in the round), does not
    end h1's place, and watches it again."""
    a, b = hosts("h0", [0, 1]), hosts("h1", [2])
    now = _h1_silent_in_no_round(base, a, b)
    view = rstore.round_store(base, 0)
    late = hosts("h1", [3])  # h1's place stands: rank 3 takes it, and its agent beats there
    assert late.agent.slot == b.agent.slot
    back = now
    while now < back + 3 * LIMITS.host_s:
        now += INTERVAL
        a.beat(0, 1), late.beat(3)
        a.agent.step(now), late.agent.step(now)
    assert a.faults() == [] and rstore.terminated_ranks(view) == set()
    assert not host_ring.claimed(base, late.agent.slot) and a.agent._silent_hosts == {}
    assert a.agent.place is not None and a.agent.place.ring.target == late.agent.slot


def test_a_silent_host_declared_lost_by_another_is_not_taken_as_beating_again(base, hosts):
    """h0 finds h1 silent while its only rank is in no round; another host then declares
    h1 lost, which raises h1's counter by its fence: h0 goes on with h1 as silent, it does
    not watch it again."""
    a, b = hosts("h0", [0, 1]), hosts("h1", [2])
    now = _h1_silent_in_no_round(base, a, b)
    slot = b.agent.slot
    assert host_ring.declare_lost(base, slot, register(base, "h2"))
    passes = now + 2 * LIMITS.replace_s  # h0's take-out of rank 2 is tried again meanwhile
    while now < passes:
        now += INTERVAL
        a.beat(0, 1)
        a.agent.step(now)
        assert a.agent.place is not None and slot in a.agent.place.ring.ended
    assert slot in a.agent._silent_hosts and a.faults() == []


def test_a_silent_host_that_beats_as_it_is_found_silent_is_watched_again(
    base, hosts, monkeypatch
) -> None:
    """h1's agent stalls for longer than a silent host stands, then beats again just after
    h0's read that finds h1 silent, before h0 acts on it: h0 counts that beat, takes nobody
    of h1 out (rank 2 runs in the round) and watches h1 again."""
    view = _round(base)
    a, b = hosts("h0", [0, 1]), hosts("h1", [2])
    slot = b.agent.slot
    assert a.agent.place is not None
    watch = a.agent.place.ring
    observe = watch.observe

    found_at: list[float] = []

    def beats_as_found_silent(beats: int, now: float, wall: float) -> Any:
        found = observe(beats, now, wall)
        if found is not None and found["slot"] == slot:  # h1's agent beats just then
            base.add(RING.alive(slot), 1)
            found_at.append(now)
        return found

    monkeypatch.setattr(watch, "observe", beats_as_found_silent)
    t = now = time.monotonic()
    for _ in range(3):
        now += INTERVAL
        a.beat(0, 1), b.beat(2)
        a.agent.step(now), b.agent.step(now)
    for step in range(int(4 * LIMITS.host_s / INTERVAL)):  # h1's agent stalls
        if found_at:
            break
        now += INTERVAL
        a.beat(0, 1)
        if step % 4 == 0:  # rank 2's beats wait in the stalled agent's socket (a few fit)
            b.beat(2)
        a.agent.step(now)
    assert found_at == [now] and a.faults() == []  # h0 found h1 silent, and acted at once
    while now < found_at[0] + 3 * LIMITS.host_s:  # h1's agent beats on
        now += INTERVAL
        a.beat(0, 1), b.beat(2)
        a.agent.step(now), b.agent.step(now)
    assert a.faults() == [] and b.faults() == [] and rstore.terminated_ranks(view) == set()
    assert a.agent._silent_hosts == {} and watch.target == slot and found_at[0] > t


class _ListsOnClaim:
    """The real store, where a monitor lists ``rank`` in host ``slot`` just as the place is
    ended: before the first append to ``slot``'s claim."""

    def __init__(self, store: Any, slot: int, rank: int) -> None:
        self.store, self.slot, self.rank, self.listed = store, slot, rank, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def append(self, key: str, value: str) -> Any:
        if key == RING.claim(self.slot) and not self.listed:
            self.listed = True
            list_rank(self.store, self.slot, self.rank)
        return self.store.append(key, value)


def test_a_rank_listed_while_its_silent_host_is_declared_lost_is_taken_out_too(base, hosts):
    """Rank 3's monitor lists it on silent h1 between h0's read of h1's list and h0's claim:
    it read no claim, so it stays on h1; h0 reads the list again and takes it out too."""
    view = _round(base)
    slot = register(base, node_agent.host_key(HostConfig.of(CFG), "h1"))
    list_rank(base, slot, 2)
    store = _ListsOnClaim(base, slot, 3)
    a = hosts("h0", [0, 1], store=store)
    t = now = time.monotonic()
    while rstore.terminated_ranks(view) != {2, 3} and now < t + 5 * LIMITS.host_s:
        now += INTERVAL
        a.beat(0, 1)
        a.agent.step(now)
    assert store.listed and host_ring.declared_lost(base, slot)
    assert rstore.terminated_ranks(view) == {2, 3}
    assert a.faults() == [(2, "unresponsive"), (3, "unresponsive")]
    assert a.agent._silent_hosts == {}  # done with h1


class _ClaimsOnList:
    """The real store, as a monitor starting on h1 uses it: the claim ``entry`` (held back
    by ``_StartsOnClaim``) goes in just before the monitor lists its rank in ``slot``, after
    it found the place unclaimed."""

    def __init__(self, store: Any, slot: int, entry: tuple[str, str]) -> None:
        self.store, self.slot, self.entry = store, slot, entry
        self.claimed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def append(self, key: str, value: str) -> Any:
        if key == keys.host_ranks(self.slot) and not self.claimed:
            self.claimed = True
            self.store.append(*self.entry)
        return self.store.append(key, value)


class _StartsOnClaim:
    """The real store, where rank ``rank``'s monitor starts on h1 (``AgentLink``) as h1's
    ``slot`` is claimed: it finds the place unclaimed, the claim goes in, it lists its rank
    there, then reads the claim."""

    def __init__(self, store: Any, slot: int, rank: int) -> None:
        self.store, self.slot, self.rank = store, slot, rank
        self.link: agent_link.AgentLink | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def append(self, key: str, value: str) -> Any:
        if key != RING.claim(self.slot) or self.link is not None:
            return self.store.append(key, value)
        monitor = _ClaimsOnList(self.store, self.slot, (key, value))
        cfg = _config(store_port=self.store.port, initial_rank=self.rank)
        self.link = agent_link.AgentLink(cfg, lambda: monitor)
        assert monitor.claimed
        return None


def test_a_rank_that_starts_as_its_silent_host_is_declared_lost_is_left_alone(
    base, hosts, monkeypatch
) -> None:
    """Rank 3's monitor starts on h1 as h0 declares silent h1 lost: it lists itself in h1's
    place after h0 read that list, then reads h0's claim and takes h1's next place. h0 reads
    the list again after its claim: it takes rank 2 out, not rank 3."""
    monkeypatch.setenv("NVRX_HOST_ID", "h1")
    view = _round(base)
    slot = register(base, _h1(base))
    list_rank(base, slot, 2)
    store = _StartsOnClaim(base, slot, 3)
    a = hosts("h0", [0, 1], store=store)
    t = now = time.monotonic()
    while (a.agent._silent_hosts or not a.faults()) and now < t + 5 * LIMITS.host_s:
        now += INTERVAL
        a.beat(0, 1)
        a.agent.step(now)
    assert store.link is not None and store.link.slot != slot
    store.link.sender.close()
    assert host_ring.declared_lost(base, slot) and a.agent._silent_hosts == {}
    assert a.faults() == [(2, "unresponsive")] and rstore.terminated_ranks(view) == {2}


def test_a_listed_rank_whose_first_word_is_its_bye_is_not_taken_out(base, hosts) -> None:
    """Rank 1 was listed, then its call ended before its monitor's first beat reached the
    agent, and its end could not be written in the store: its bye alone says so. The
    agent watched it from the list meanwhile (a beat of no process): it is not silent."""
    view = _round(base)
    h = hosts("h0", [0, 1])
    t = time.monotonic()
    h.beat(0)
    h.agent.step(t)  # rank 1 is watched from the host's list
    h.beat(1, bye=True)
    for dt in (TIMEOUT + 0.1, TIMEOUT + 0.1 + LIMITS.replace_s):
        h.beat(0)
        h.agent.step(t + dt)
    assert rstore.terminated_ranks(view) == set() and h.faults() == []
    assert h.agent.done == {1} and h.agent._out == {}


def test_a_fenced_agent_ends_once_its_last_rank_fell_silent(base, hosts) -> None:
    b = hosts("h1", [2])
    t = time.monotonic()
    b.beat(2)
    b.agent.step(t)
    host_ring.declare_lost(base, b.agent.slot, 0)
    b.beat(2)
    assert b.agent.step(t + INTERVAL) and b.agent.fenced
    assert not b.agent.finished(t + INTERVAL, t)
    b.agent.step(t + INTERVAL + TIMEOUT + 0.1)  # rank 2 stopped beating: out already
    assert b.agent.done == {2} and b.agent._out == {} and b.faults() == []
    assert b.agent.finished(t + INTERVAL + TIMEOUT + 0.1, t)


def test_a_fenced_agent_counts_a_rank_it_was_about_to_take_out_as_ended(base, hosts) -> None:
    """h1's rank 3 falls silent before any round names it: its take-out waits. h1 is then
    declared lost: fenced, its agent counts rank 3 as out with the rest, and ends once rank
    2 says it ended."""
    b = hosts("h1", [2, 3])
    t = now = time.monotonic()
    b.beat(2, 3)
    b.agent.step(now)
    while 3 not in b.agent._out and now < t + 4 * TIMEOUT:  # rank 3 stopped beating
        now += INTERVAL
        b.beat(2)
        b.agent.step(now)
    assert 3 in b.agent._out and 3 not in b.agent.done and b.agent.heard == {2, 3}
    host_ring.declare_lost(base, b.agent.slot, 0)
    b.beat(2)
    assert b.agent.step(now + INTERVAL) and b.agent.fenced
    b.beat(2, bye=True)
    b.agent.step(now + 2 * INTERVAL)
    assert b.agent.finished(now + 2 * INTERVAL, t)


class _Gone:
    """A store that no longer answers."""

    def __getattr__(self, name: str) -> Any:
        def gone(*args: Any) -> Any:
            raise ConnectionError("the store is gone")

        return gone


def test_a_host_declared_lost_while_its_connection_was_down_takes_no_new_place(base, hosts):
    """h1 is declared lost while its agent's store connection is down: connected again, the
    agent finds its place ended by another and stays out of the ring."""
    a, b = hosts("h0", [0]), hosts("h1", [1])
    t = time.monotonic()
    a.agent.step(t), b.agent.step(t)
    b.agent._drop_store()
    host_ring.declare_lost(base, b.agent.slot, a.agent.slot)
    counted, slot = int(base.add(RING.alive(b.agent.slot), 0)), b.agent.slot
    b.agent._attach(base, t + INTERVAL)
    assert b.agent.fenced and b.agent.slot == slot
    assert b.agent.step(t + 2 * INTERVAL)
    assert int(base.add(RING.alive(slot), 0)) == counted  # no beat
    assert int(base.add(keys.HOST_COUNT, 0)) == 2  # no new place taken


def _h1_declared_lost(base: Any, a: Host) -> int:
    """h1's ranks 2 and 3 listed in its slot, which never beats: h0 takes them out of round
    0 and ends h1's place (the path above); h1's slot."""
    view = _round(base)
    slot = register(base, _h1(base))
    for rank in (2, 3):  # what h1's monitors wrote before their ranks went on
        list_rank(base, slot, rank)
    t = now = time.monotonic()
    while not host_ring.claimed(base, slot) and now < t + 5 * LIMITS.host_s:
        now += INTERVAL
        a.beat(0, 1)
        a.agent.step(now)
    assert host_ring.declared_lost(base, slot) and rstore.terminated_ranks(view) == {2, 3}
    return slot


def _h1(base: Any) -> str:
    """Host h1's name in the store, as its agent connected to ``base`` names it."""
    return node_agent.host_key(HostConfig.of(_config(store_port=base.port)), "h1")


class _Thawed:
    """An agent of h1 that never ran before (it stalled before its first tick)."""

    def __init__(self, base: Any) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        address = f"\0nvrx-test-{uuid.uuid4().hex}"
        self.sock, self.sender = BeatSocket(address), BeatSender(address)
        emit = lambda kind, **f: self.events.append((kind, f))  # noqa: E731
        self.agent = node_agent.NodeAgent(HostConfig.of(_config(store_port=base.port)), self.sock, emit, "h1")

    def beat(self, rank: int, slot: int, bye: bool = False) -> None:
        assert self.sender.send(Beat(rank, pid=2000 + rank, timeout=TIMEOUT, slot=slot, bye=bye))

    def close(self) -> None:
        self.agent._drop_store()
        self.sock.close(unlink=False)
        self.sender.close()


@pytest.fixture
def thawed(base, monkeypatch):
    # The agent connects at its first step, within its host threshold (0.5 s here) by
    # default; the test's store server may stall on a reverse-DNS look-up for longer
    # (``tests/conftest.py``), and the connection's timeout is not what these tests test.
    monkeypatch.setattr(
        node_agent, "connect_store",
        lambda cfg, connect_within=0.0: WireStore("127.0.0.1", cfg.store_port, timeout=30),
    )
    made = _Thawed(base)
    yield made
    made.close()


def test_an_agent_that_stalled_before_its_first_tick_finds_its_host_fenced(base, hosts, thawed):
    """h1's agent stalls before it ever connects; h0 finds h1 silent, takes its ranks out
    and fences it. Thawed, the agent takes the place its ranks' beats name, finds it ended by
    another, and stays out: no new place, no beat, nobody taken out; it ends once its ranks
    ended or fell silent."""
    slot = _h1_declared_lost(base, hosts("h0", [0, 1]))
    agent, now = thawed.agent, time.monotonic()
    assert not agent.step(now) and agent.store is None  # no beat yet: its place is unknown
    thawed.beat(2, slot), thawed.beat(3, slot)  # they waited in its socket while it stalled
    assert agent.step(now)  # its first connection
    assert agent.fenced and agent.slot == slot and agent.place is None
    assert int(base.add(keys.HOST_COUNT, 0)) == 2  # no new place taken
    counted = int(base.add(RING.alive(slot), 0))
    for i in range(1, 4 * int(TIMEOUT / INTERVAL)):  # rank 2 beats on, rank 3 falls silent
        thawed.beat(2, slot)
        assert agent.step(now + i * INTERVAL)
        assert not agent.finished(now + i * INTERVAL, now)
    assert int(base.add(RING.alive(slot), 0)) == counted  # no beat
    assert thawed.events == [] and agent.done == {3}
    thawed.beat(2, slot, bye=True)
    agent.step(now + (i + 1) * INTERVAL)
    assert agent.finished(now + (i + 1) * INTERVAL, now)
    assert _claims(base, slot) == 1  # no claim of its own added


def test_a_fenced_agent_ends_when_a_rank_of_its_host_beats_for_a_later_place(base, hosts, thawed):
    """A rank started on h1 after h1 was declared lost lists itself in h1's next place; its
    beat ends the fenced agent, so that its next one starts the agent of that place."""
    slot = _h1_declared_lost(base, hosts("h0", [0, 1]))
    agent, now = thawed.agent, time.monotonic()
    thawed.beat(2, slot)
    assert agent.step(now) and agent.fenced
    later = register(base, _h1(base))  # a rank that starts on h1 now
    assert later != slot
    thawed.beat(4, later)
    agent.step(now + INTERVAL)
    assert agent.finished(now + INTERVAL, now)  # the next beat starts the agent of that place


def test_an_agent_whose_ranks_place_its_predecessor_ended_takes_the_hosts_next(base, thawed):
    """A place ended by the host's own agent (its ranks all ended) is no fence: an agent
    started later for a rank listed there takes the host's next place."""
    slot = register(base, _h1(base))
    list_rank(base, slot, 2)
    assert host_ring.end_place(base, slot) and not host_ring.declared_lost(base, slot)
    thawed.beat(2, slot)
    assert thawed.agent.step(time.monotonic())
    assert not thawed.agent.fenced and thawed.agent.slot != slot
    assert thawed.agent.slot == register(base, _h1(base))  # h1's next place
    assert int(base.add(keys.HOST_COUNT, 0)) == 2


def _h1_agent_ends_its_place(base: Any, rank: int, wrap: Callable[[int], Any]) -> tuple[int, float, Any]:
    """h1's place with its only rank ``rank`` listed; h1's agent, through the store
    ``wrap(slot)``, hears that rank beat and end, and ends the place. The place's slot, when
    the agent began, and that store."""
    slot = register(base, _h1(base))
    list_rank(base, slot, rank)
    address = f"\0nvrx-test-{uuid.uuid4().hex}"
    sock, sender = BeatSocket(address), BeatSender(address)
    store = wrap(slot)
    ending = node_agent.NodeAgent(HostConfig.of(_config(store_port=base.port)), sock,
                                  lambda kind, **f: None, "h1", store=store)  # fmt: skip
    try:
        t = time.monotonic()
        assert sender.send(Beat(rank, pid=2000 + rank, timeout=TIMEOUT, slot=slot))
        assert ending.step(t)
        assert sender.send(Beat(rank, pid=2000 + rank, timeout=TIMEOUT, slot=slot, bye=True))
        ending.step(t + INTERVAL)
        assert ending.finished(t + INTERVAL, t) and host_ring.claimed(base, slot)
    finally:
        sock.close(unlink=False)
        sender.close()
    return slot, t, store


def test_a_rank_listed_as_its_hosts_agent_ends_the_place_is_taken_out_with_the_next(
    base, hosts, thawed
) -> None:
    """Rank 3 starts on h1 just as h1's agent ends its place (rank 2, its only rank, ended):
    its monitor lists it between the agent's read of the list and its claim, reads no claim
    yet, and beats for the ended place. The agent its beat starts takes h1's next place;
    when that agent falls silent, the host watching it takes rank 3 out."""
    view = _round(base)
    slot, t, _ = _h1_agent_ends_its_place(base, 2, lambda slot: _ListsOnClaim(base, slot, 3))
    thawed.beat(3, slot)  # rank 3's monitor beats for the place it listed itself in
    assert thawed.agent.step(t + 2 * INTERVAL) and thawed.agent.slot != slot
    a = hosts("h0", [0, 1])  # watches h1's next place, the last one
    now = t + 2 * INTERVAL
    while not a.faults() and now < t + 5 * LIMITS.host_s:  # h1's new agent falls silent
        now += INTERVAL
        a.beat(0, 1)
        a.agent.step(now)
    assert a.faults() == [(3, "unresponsive")] and rstore.terminated_ranks(view) == {3}


class _LinksOnClaim:
    """The real store, where rank ``rank``'s monitor starts on h1 (``AgentLink``) just as
    h1's agent ends ``slot``: before the first append to that slot's claim, it lists its
    rank there and reads no claim yet."""

    def __init__(self, store: Any, slot: int, rank: int) -> None:
        self.store, self.slot, self.rank = store, slot, rank
        self.link: agent_link.AgentLink | None = None
        self.ended = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def append(self, key: str, value: str) -> Any:
        if key == RING.claim(self.slot) and self.link is None:
            cfg = _config(store_port=self.store.port, initial_rank=self.rank)
            self.link = agent_link.AgentLink(cfg, lambda: self.store)
        return self.store.append(key, value)

    def end(self) -> None:
        """Rank ``rank``'s monitor ends on purpose; its bye finds no agent at the address it
        beats to (the test's agents listen elsewhere): lost unless the test sends it."""
        assert self.link is not None and not self.ended
        self.link.end()
        self.ended = True


def test_a_rank_carried_to_its_hosts_next_place_that_ends_is_left_alone_there(
    base, hosts, thawed, monkeypatch
) -> None:
    """Rank 3's monitor starts on h1 just as h1's agent ends its place (rank 1, its only
    rank, ended): that agent lists rank 3 in h1's next place, where the agent rank 3's beat
    starts beats, and rank 2 of h1 starts there later. Rank 3 ends on purpose once that
    agent took the place: neither that agent nor, once it falls silent, the host watching
    it takes rank 3 out; rank 2 is."""
    monkeypatch.setenv("NVRX_HOST_ID", "h1")
    view = _round(base)
    slot, t, store = _h1_agent_ends_its_place(base, 1, lambda slot: _LinksOnClaim(base, slot, 3))
    assert store.link is not None and store.link.slot == slot
    thawed.beat(3, slot)  # rank 3's monitor beats for the place it listed itself in
    now = t + 2 * INTERVAL
    assert thawed.agent.step(now) and thawed.agent.slot != slot
    later = register(base, _h1(base))  # rank 2 starts on h1: its monitor lists it there
    assert later == thawed.agent.slot
    list_rank(base, later, 2)
    store.end()
    thawed.beat(3, slot, bye=True)
    a = hosts("h0", [0])  # watches h1's next place, the last one
    lost = now + 3 * TIMEOUT
    while now < lost:  # rank 2 beats on, rank 3 does not
        now += INTERVAL
        a.beat(0), thawed.beat(2, later)
        a.agent.step(now), thawed.agent.step(now)
    assert thawed.events == [] and a.faults() == []
    while not a.faults() and now < lost + 5 * LIMITS.host_s:  # h1's agent is lost
        now += INTERVAL
        a.beat(0)
        a.agent.step(now)
    assert a.faults() == [(2, "unresponsive")] and rstore.terminated_ranks(view) == {2}

def test_a_host_whose_place_ended_takes_a_new_one_that_is_watched(base, hosts) -> None:
    """h1's only rank ends early and its agent ends the host's place; rank 3 of h1 starts
    later: it takes h1's next place, where its agent beats and h0's agent watches it."""
    view = _round(base)
    a, b = hosts("h0", [0, 1]), hosts("h1", [2])
    t = time.monotonic()
    a.beat(0, 1), b.beat(2)
    a.agent.step(t), b.agent.step(t)
    b.beat(2, bye=True)
    b.agent.step(t + INTERVAL)
    assert b.agent.finished(t + INTERVAL, t)
    ended = b.agent.slot
    late = hosts("h1", [3])
    assert late.agent.slot != ended and live_ranks(base, late.agent.slot) == [3]
    now = t + INTERVAL
    late.beat(3)
    late.agent.step(now)
    while not a.faults() and now < t + 4 * LIMITS.host_s:  # h1's new agent stops beating
        now += INTERVAL
        a.beat(0, 1)
        a.agent.step(now)
    assert a.faults() == [(3, "unresponsive")]
    assert rstore.terminated_ranks(view) == {3}


def test_a_bye_that_comes_with_the_ranks_last_beat_ends_its_watch(base, hosts) -> None:
    view = _round(base)
    h = hosts("h0", [0, 1])
    t = time.monotonic()
    h.beat(0, 1)
    h.agent.step(t)
    h.beat(1)
    h.beat(1, bye=True)  # read in one batch with the beat before it
    h.beat(0)
    h.agent.step(t + INTERVAL)
    assert 1 in h.agent.done and 1 not in h.agent.table.ranks
    h.beat(0)
    h.agent.step(t + TIMEOUT + 0.2)
    assert rstore.terminated_ranks(view) == set() and h.faults() == []


def test_an_agent_ends_once_its_ranks_ended_and_ends_its_place_in_the_ring(base, hosts) -> None:
    h = hosts("h0", [0, 1])
    t = time.monotonic()
    h.beat(0, 1)
    h.agent.step(t)
    assert not h.agent.finished(t, t)
    h.beat(0, bye=True)
    h.agent.step(t + INTERVAL)
    assert not h.agent.finished(t + INTERVAL, t)
    h.beat(1, bye=True)
    h.agent.step(t + 2 * INTERVAL)
    assert h.agent.finished(t + 2 * INTERVAL, t)
    assert _claims(base, h.agent.slot) == 1


@contextlib.contextmanager
def _slow_job(own_client: bool = False) -> Iterator[tuple[list[Any], node_agent.NodeAgent, BeatSender]]:
    """An agent with a day's heartbeat timeout (as a job may set) whose rank 0 beat once,
    connected to a store that serves until its list (``servers``) is emptied; with
    ``own_client``, through the agent's own client as ``connect_store`` makes it."""
    servers = [client.serve("127.0.0.1", 0, timeout=10)]
    port = servers[0].port
    store = WireStore("127.0.0.1", port, timeout=2) if own_client else client.connect("127.0.0.1", port, timeout=2)
    sock = BeatSocket(f"\0nvrx-test-{uuid.uuid4().hex}")
    slow = _config(heartbeat_timeout=86400.0, store_port=port)
    agent = node_agent.NodeAgent(HostConfig.of(slow), sock, lambda kind, **f: None, "h0", store=store)
    try:
        sender = BeatSender(sock.path)
        sender.send(_beat(0))
        assert agent.step(time.monotonic())
        yield servers, agent, sender
    finally:
        sock.close(unlink=False)


def test_an_agent_whose_ranks_all_ended_ends_though_its_store_is_gone() -> None:
    """With a day's heartbeat timeout, still at once."""
    with _slow_job() as (servers, agent, sender):
        t = time.monotonic()
        sender.send(_beat(0, bye=True))
        agent.step(t)
        servers.clear()  # the store ended first, as at the end of a job
        wait_until("the agent may end", lambda: agent.finished(time.monotonic(), t), 30)
        assert time.monotonic() - t < node_agent.STORE_GONE_S


def test_an_agent_that_lost_its_store_before_the_last_bye_ends_soon_after_it(monkeypatch) -> None:
    """At a job's end the store may go before the agent reads its ranks' byes: a tick failed
    and dropped the connection. With a day's heartbeat timeout the agent then waited
    ``STORE_GONE_S`` to connect again; once every rank ended it tries for
    ``ENDING_STORE_S`` only, and a refused connection ends it without another try."""
    connect, withins = node_agent.connect_store, []

    def recorded(cfg: HostConfig, connect_within: float = node_agent.STORE_GONE_S) -> Any:
        withins.append(connect_within)
        return connect(cfg, connect_within)

    monkeypatch.setattr(node_agent, "connect_store", recorded)
    with _slow_job() as (servers, agent, sender):
        servers.clear()
        wait_until("a tick that fails", lambda: not agent.step(time.monotonic()), 30)
        assert agent.store is None and agent.live == {0}  # dropped while its rank lives
        sender.send(_beat(0, bye=True))
        now = time.monotonic()
        assert not agent.step(now)  # one look, as the loop's: the bye, then the tick
        assert not agent.live
        assert agent.finished(now, now)  # that look's connection was refused: no other try
        assert withins == [node_agent.ENDING_STORE_S]


def test_an_agent_whose_last_bye_came_as_the_store_ended_ends_without_connecting_again(
    monkeypatch,
) -> None:
    """A job without a supervisor ends: the last monitors say bye and rank 0's monitor
    stops the store. The look that reads the byes finds the store gone and the agent ends
    there: it does not connect again to end a place nobody watches any more."""
    connects: list[float] = []
    with _slow_job(own_client=True) as (servers, agent, sender):
        monkeypatch.setattr(
            node_agent, "connect_store", lambda cfg, connect_within=0.0: connects.append(connect_within)
        )
        sender.send(_beat(0, bye=True))
        servers.clear()
        now = time.monotonic()
        assert not agent.step(now)  # the bye read, then a tick the store did not answer
        assert agent.finished(now, now) and connects == []


class Ending:
    """A store client whose server goes (``gone``): its requests fail from then on."""

    def __init__(self, store: Any) -> None:
        self.store, self.gone = store, False

    def __getattr__(self, name: str) -> Any:
        if self.gone and name != "close":
            raise ConnectionResetError("the store's server is gone")
        return getattr(self.store, name)


def test_an_agent_that_reaches_another_jobs_store_at_its_address_ends_untouched(
    base, hosts, monkeypatch
) -> None:
    """A job killed and started again at the same store address (a fixed ``MASTER_PORT``):
    the killed job's agent outlives it for a while, connects again, and finds the new
    job's store. It ends there and leaves that job alone: no take-out of ranks that share
    its silent ranks' numbers, no place in the new job's ring (its own agent starts)."""
    job = Ending(base)
    h = hosts("h0", [0, 1], store=job)
    h.agent.cfg.job_token = host_ring.job_token(base)  # its monitors wrote it, and gave it on
    server = client.serve("127.0.0.1", 0, timeout=10)
    later = client.connect("127.0.0.1", server.port, timeout=10)
    view = _round(later)
    host_ring.job_token(later)  # the new job's first monitor wrote its own
    monkeypatch.setattr(node_agent, "connect_store", lambda cfg, connect_within=0.0: later)
    t = time.monotonic()
    h.beat(0, 1)
    assert h.agent.step(t) and not h.agent.finished(t, t)
    job.gone = True  # the job is killed: its ranks beat no more, its store is gone
    assert not h.agent.step(t + TIMEOUT + 0.1)
    assert not h.agent.step(t + 2 * TIMEOUT + 0.2)  # connects again: another job's store
    assert h.agent.finished(t + 2 * TIMEOUT + 0.2, t)
    assert rstore.terminated_ranks(view) == set() and h.faults() == []
    assert host_ring.host_count(later) == 0


def test_an_agent_that_reaches_a_store_with_no_job_token_leaves_it_and_ends_unanswered(
    base, hosts, monkeypatch
) -> None:
    """The killed job's agent connects again before the new job's first monitor wrote its
    token: a store without one is not its job's (its monitors wrote theirs before their
    first beat). It takes no place there and takes nobody out, and the store does not
    count as answering: it ends once the store was gone for ``host_s``."""
    job = Ending(base)
    h = hosts("h0", [0, 1], store=job)
    h.agent.cfg.job_token = host_ring.job_token(base)
    server = client.serve("127.0.0.1", 0, timeout=10)
    later = client.connect("127.0.0.1", server.port, timeout=10)
    view = _round(later)  # the new job's round, its ranks sharing the silent ranks' numbers
    monkeypatch.setattr(node_agent, "connect_store", lambda cfg, connect_within=0.0: later)
    t = time.monotonic()
    h.beat(0, 1)
    assert h.agent.step(t)
    job.gone = True
    gone = t + min(LIMITS.host_s, node_agent.STORE_GONE_S)
    for now in (t + 0.1, t + 0.2, gone - 0.1):  # lost, then connects again: no token there
        assert not h.agent.step(now) and not h.agent.finished(now, t)
    assert h.agent.step(gone + 0.1) is False and h.agent.finished(gone + 0.1, t)
    assert rstore.terminated_ranks(view) == set() and h.faults() == []
    assert host_ring.host_count(later) == 0


def test_an_agent_whose_ranks_died_before_any_round_ends_though_its_store_answers(
    base, hosts
) -> None:
    """A job killed before its first round formed, whose store outlives it: the take-outs
    of its silent ranks find them in no round and are tried again for good. The agent ends
    once they stood so for ``NO_ROUND_S``, its place left for the host watching it."""
    h = hosts("h0", [0, 1])
    t = time.monotonic()
    h.beat(0, 1)
    assert h.agent.step(t)
    silent_at = t + TIMEOUT + 0.1
    assert h.agent.step(silent_at) and h.agent._out.keys() == {0, 1}
    assert not h.agent.finished(silent_at, t)  # asked at each tick, as the loop does
    bound = max(LIMITS.host_s, node_agent.NO_ROUND_S)
    for now in (silent_at + 1, silent_at + bound - 1):
        assert h.agent.step(now) and not h.agent.finished(now, t)
    assert h.agent.step(silent_at + bound) and h.agent.finished(silent_at + bound, t)
    assert _claims(base, h.agent.slot) == 0 and h.faults() == []


def test_an_agent_whose_last_rank_to_take_out_is_in_no_round_ends_after_the_others_ended(
    base, hosts
) -> None:
    """Rank 1's monitor died silently (its place on h0's list stands) and the job went on
    without it, in a round that does not name it; an agent started again on h0 watches it
    from the list and finds it silent, and its take-out finds it in no round, for good.
    Rank 0 then ends on purpose: with nothing left but that take-out, the agent ends once it
    stood so for ``NO_ROUND_S``, though the store answers."""
    rounds.publish_round(base, 0)
    view = rstore.round_store(base, 0)
    for rank, initial in enumerate((0, 2, 3)):
        view.set(rounds.rank_state(rank), json.dumps({"initial_rank": initial, "world_size": 3}))
    h = hosts("h0", [0, 1])
    t = time.monotonic()
    h.beat(0)
    assert h.agent.step(t)
    h.beat(0)
    assert h.agent.step(t + TIMEOUT + 0.1) and h.agent._out.keys() == {1}
    ended = t + TIMEOUT + 0.2
    h.beat(0, bye=True)
    assert h.agent.step(ended) and not h.agent.live and not h.agent.finished(ended, t)
    bound = max(LIMITS.host_s, node_agent.NO_ROUND_S)
    assert h.agent.step(ended + bound - 1) and not h.agent.finished(ended + bound - 1, t)
    assert h.agent.step(ended + bound) and h.agent.finished(ended + bound, t)
    assert rstore.terminated_ranks(view) == set() and h.faults() == []


def test_a_silent_rank_before_any_round_keeps_its_agent_while_another_rank_beats(base, hosts):
    """One of two ranks falls silent while no round names it, the other beats on: the agent
    does not end past ``NO_ROUND_S`` (only a host whose every live rank is silent and in no
    round ends), and the silent rank still waits to be taken out once a round names it."""
    h = hosts("h0", [0, 1])
    t = time.monotonic()
    h.beat(0, 1)
    assert h.agent.step(t)
    bound = max(LIMITS.host_s, node_agent.NO_ROUND_S)
    for dt in range(1, int(bound) + 3):
        h.beat(0)
        assert h.agent.step(t + dt) and not h.agent.finished(t + dt, t)
    assert 1 in h.agent._out


def test_an_agent_that_no_monitor_beat_to_ends_within_its_idle_bound(base) -> None:
    """Its starter died before its first beat was read: with a day's heartbeat timeout too."""
    slow = _config(heartbeat_timeout=86400.0)
    sock = BeatSocket(f"\0nvrx-test-{uuid.uuid4().hex}")
    agent = node_agent.NodeAgent(HostConfig.of(slow), sock, lambda kind, **f: None, "h0", store=base)
    try:
        t = time.monotonic()
        assert agent.step(t) and not agent.finished(t, t)
        idle = node_agent.IDLE_START_S
        assert agent.step(t + idle - 1) and not agent.finished(t + idle - 1, t)
        assert agent.step(t + idle) and agent.finished(t + idle + 0.1, t)  # its store answers
    finally:
        sock.close(unlink=False)


def test_an_agent_whose_store_is_gone_ends() -> None:
    server = client.serve("127.0.0.1", 0, timeout=10)
    store = client.connect("127.0.0.1", server.port, timeout=2)
    h = Host(store, "h0", [0])
    try:
        t = last_ok = time.monotonic()
        h.beat(0)
        assert h.agent.step(t)
        del server

        def failed() -> bool:  # a step may still be answered while the server goes
            nonlocal last_ok
            now = time.monotonic()
            if h.agent.step(now):
                last_ok = now
                return False
            return True

        wait_until("a failing store", failed, 30)
        # judged from the last answer, whatever the failing requests took
        assert not h.agent.finished(last_ok + LIMITS.host_s / 2, t)
        assert h.agent.finished(last_ok + LIMITS.host_s + 0.1, t)
    finally:
        h.close()


# -- the real agent process ------------------------------------------------------------
def _agents(host: str) -> list[psutil.Process]:
    """Agent processes of this test (their environment names its host)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if (proc.info["cmdline"] or [])[-3:-1] == ["nvrx.node_agent", "host"]:
                if proc.environ().get("NVRX_HOST_ID") == host:
                    found.append(proc)
    return found


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture
def served(tmp_path, monkeypatch):
    server = client.serve("127.0.0.1", 0, timeout=10)
    host = f"h-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("NVRX_HOST_ID", host)
    cfg = _config(store_port=server.port, heartbeat_interval=0.1, heartbeat_timeout=2.0,
                  events_dir=str(tmp_path / "events"))  # fmt: skip
    store = client.connect("127.0.0.1", server.port, timeout=10)
    yield cfg, store
    for agent in _agents(host):
        agent.kill()
    del server


def _link(cfg: MonitorConfig, store: Any, rank: int) -> agent_link.AgentLink:
    return agent_link.AgentLink(_config(**{**cfg.__dict__, "initial_rank": rank}), lambda: store)


def _beat(rank: int, bye: bool = False) -> Beat:
    return Beat(rank, pid=os.getpid(), rank=rank, world_size=WORLD, round=0, timeout=2.0, bye=bye)


def test_the_monitors_of_a_host_start_one_agent_that_beats_and_ends_by_itself(served) -> None:
    cfg, store = served
    shm_before = _shm()
    links = [_link(cfg, store, rank) for rank in range(3)]
    for rank, link in enumerate(links):  # the first finds no agent and starts it; the others beat to it
        link.beat(_beat(rank))
    # a process just started may show no command line for a moment: its exec is not done
    wait_until("the host's agent", lambda: _agents(os.environ["NVRX_HOST_ID"]), 30)
    agents = _agents(os.environ["NVRX_HOST_ID"])
    assert len(agents) == 1 and agents[0].ppid() == os.getpid()
    assert os.getsid(agents[0].pid) == agents[0].pid  # a session of its own
    assert agents[0].cmdline()[-3:] == ["nvrx.node_agent", "host", agents[0].cmdline()[-1]]
    assert agents[0].cmdline()[-1].isdigit()  # its socket; its configuration came on stdin
    slot = links[0].slot
    wait_until("the host's beats", lambda: int(store.add(RING.alive(slot), 0)) >= 3, 30)
    assert live_ranks(store, slot) == [0, 1, 2]
    for link in links:
        link.end()
    assert psutil.wait_procs(agents, timeout=30)[1] == []
    links[0]._reap()
    assert _claims(store, slot) == 1
    # nothing new in /dev/shm (another test's progress board may live there for a moment)
    wait_until("nothing new in /dev/shm", lambda: not _shm() - shm_before, 20)


def test_a_killed_agent_is_started_again_and_keeps_the_hosts_place(served) -> None:
    cfg, store = served
    link = _link(cfg, store, 0)
    link.beat(_beat(0))
    host = os.environ["NVRX_HOST_ID"]
    wait_until("beats", lambda: int(store.add(RING.alive(link.slot), 0)) >= 2, 30)
    wait_until("the host's one agent", lambda: len(_agents(host)) == 1, 30)
    first = _agents(host)
    first[0].send_signal(signal.SIGKILL)
    first[0].wait(10)
    wait_until(
        "a second agent",
        lambda: link.beat(_beat(0)) or len(_agents(host)) == 1,
        30,
    )
    second = _agents(host)
    assert second[0].pid != first[0].pid
    before = int(store.add(RING.alive(link.slot), 0))
    wait_until("beats", lambda: int(store.add(RING.alive(link.slot), 0)) > before + 2, 30)
    assert int(store.add(keys.HOST_COUNT, 0)) == 1  # the same slot
    link.end()
    assert psutil.wait_procs(second, timeout=30)[1] == []


def test_an_agent_logs_to_the_monitors_log_file(served, tmp_path: Path) -> None:
    cfg, store = served
    log = tmp_path / "monitor.log"
    link = _link(_config(**{**cfg.__dict__, "logfile": str(log)}), store, 0)
    link.beat(_beat(0))
    wait_until("the agent's log", lambda: log.exists() and "serving" in log.read_text(), 30)
    link.end()
    agents = _agents(os.environ["NVRX_HOST_ID"])
    assert psutil.wait_procs(agents, timeout=30)[1] == []
    assert "every rank of this host ended" in log.read_text()


def test_without_a_monitor_log_file_an_agent_logs_beside_the_jobs_events(served, tmp_path: Path) -> None:
    """The monitors log nowhere (no ``monitor_process_logfile``): the agent, whose stderr
    goes nowhere, still says what it did, in ``node_agent-<host>.log`` beside the events."""
    cfg, store = served
    host = os.environ["NVRX_HOST_ID"]
    log = tmp_path / "events" / f"node_agent-{host}.log"
    link = _link(cfg, store, 0)
    link.beat(_beat(0))
    wait_until("the agent's log", lambda: log.exists() and "serving" in log.read_text(), 30)
    link.end()
    assert psutil.wait_procs(_agents(host), timeout=30)[1] == []
    assert "every rank of this host ended" in log.read_text()


@pytest.mark.parametrize("monitor_log", [False, True], ids=["none", "unwritable"])
def test_an_agent_that_cannot_open_its_log_file_logs_to_the_next_or_to_stderr(
    tmp_path: Path, monitor_log: bool
) -> None:
    """A monitor log file that cannot be opened: the agent logs beside the events, and says
    why there. Neither opens (the event directory's place is a file): stderr, saying so."""
    (tmp_path / "events").write_text("not a folder")
    (tmp_path / "monitor").write_text("not a folder either")
    logfile = str(tmp_path / "monitor" / "monitor-0.log") if monitor_log else None
    cfg = HostConfig.of(_config(events_dir=str(tmp_path / "events"), logfile=logfile))
    paths = node_agent.log_paths(cfg, "h/1")
    beside = tmp_path / "events" / "node_agent-h_1.log"
    assert paths == ([Path(logfile)] if logfile else []) + [beside]  # type: ignore[arg-type]
    said = _set_up_logging(paths)
    assert all(f"cannot log to {path}" in said for path in paths) and "still logging" in said
    if monitor_log:  # the first refused, the next one opens
        (tmp_path / "events").unlink()
        said = _set_up_logging(paths)
        assert said == "" and f"cannot log to {paths[0]}" in beside.read_text()


def _set_up_logging(paths: list[Path]) -> str:
    """What the agent's logging, set up for ``paths``, writes to stderr with one line logged."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            node_agent._setup_logging(paths)
            logging.getLogger("nvrx.node_agent.host").info("still logging")
            for handler in set(root.handlers) - set(handlers):
                handler.flush()
    finally:
        for handler in set(root.handlers) - set(handlers):
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
    return err.getvalue()


def test_a_monitor_that_cannot_start_the_agent_says_so_and_beats_on(served, monkeypatch) -> None:
    """Another monitor of the host bound the agent's name between this one's refused beat
    and its own bind: it leaves the start to that one. A start that fails (a fork refused)
    frees the name again. Neither raises into the monitor."""
    cfg, store = served
    link = _link(cfg, store, 0)

    def refused(beat: Beat, wait_s: float = 0.0) -> bool:
        link.sender.listener_gone = True
        return False

    monkeypatch.setattr(link.sender, "send", refused)
    other = BeatSocket(link.sender.path)  # the other monitor's bind
    link.beat(_beat(0))
    assert link._started is None and _agents(os.environ["NVRX_HOST_ID"]) == []
    other.close(unlink=False)

    def no_fork(*args: Any, **kwargs: Any) -> Any:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(agent_link, "start_agent", no_fork)
    link.beat(_beat(0))
    assert link._started is None
    BeatSocket(link.sender.path).close(unlink=False)  # the name is free again


class _MovesOn:
    """The real store, where rank 3's monitor (the store requests of ``AgentLink`` as it
    lists itself) runs beside h1's agent ending ``slot``: it lists rank 3 there just after
    the agent's claim, then reads that claim and lists itself as ended there, to move on,
    just before the agent lists rank 3 in the host's next place."""

    def __init__(self, store: Any, slot: int) -> None:
        self.store, self.slot, self.step = store, slot, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def append(self, key: str, value: str) -> Any:
        if self.step == 1 and key == keys.host_ranks(self.slot + 1):
            assert host_ring.claimed(self.store, self.slot)
            list_ended(self.store, self.slot, 3)  # it moves on
            self.step = 2
        got = self.store.append(key, value)
        if self.step == 0 and key == RING.claim(self.slot):
            list_rank(self.store, self.slot, 3)
            self.step = 1
        return got


def test_a_rank_that_moves_on_from_its_hosts_ended_place_stays_live_in_the_next(
    base, hosts, thawed, monkeypatch
) -> None:
    """Rank 3's monitor lists itself on h1 as h1's agent ends its place, and moves on to
    the next place (listed as ended in the ended one) as that agent carries it over: in
    the next place it is live, so once h1's next agent is lost, the host watching it takes
    rank 3 out."""
    monkeypatch.setenv("NVRX_HOST_ID", "h1")
    view = _round(base)
    slot, t, store = _h1_agent_ends_its_place(base, 1, lambda slot: _MovesOn(base, slot))
    assert store.step == 2
    following = register(base, _h1(base))  # the monitor goes on there, as AgentLink does
    list_rank(base, following, 3)
    assert live_ranks(base, following) == [3]
    thawed.beat(3, following)
    now = t + 2 * INTERVAL
    assert thawed.agent.step(now) and thawed.agent.slot == following
    a = hosts("h0", [0])
    while not a.faults() and now < t + 5 * LIMITS.host_s:  # h1's agent is lost
        now += INTERVAL
        a.beat(0)
        a.agent.step(now)
    assert a.faults() == [(3, "unresponsive")] and rstore.terminated_ranks(view) == {3}
