"""Heartbeats without a supervisor (``nvrx.inprocess.host_beats``, ``host_group``,
``host_ring``): the first monitor of a host leads and alone talks to the store; a silent
follower, a dead or frozen leader and a silent host are each found, and their ranks taken
out of the running round.

Real sockets in a private directory and a real TCPStore (the ``base`` fixture); each
monitor is a ``HostBeats`` object, driven beat by beat with explicit monotonic times.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from nvrx.inprocess import store as rstore
from nvrx.inprocess.host_beats import HostBeats
from nvrx.inprocess.host_group import HostGroup, Leader, Stale
from nvrx.inprocess.host_group_dir import group_dir
from nvrx.inprocess.host_ring import Thresholds, live_ranks
from nvrx.rank_beats import Beat
from nvrx.store import keys, rounds
from tests.support.waiting import wait_until

TIMEOUT = 0.5
PERIOD = 0.05  # between two beats of a monitor in these tests
LIMITS = Thresholds(TIMEOUT, PERIOD)  # a stalled leader replaced after 0.25 s, a host after 0.5
WORLD = 4


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


class Member:
    """The monitor of ``rank`` on ``host``: its HostBeats, the events it wrote, the
    termination-barrier arrivals it made for others."""

    def __init__(self, root: Path, store: Any, rank: int, host: str = "h0") -> None:
        self.rank, self.events, self.arrived = rank, [], []
        own = Leader(monitor_pid=1000 + rank, initial_rank=rank, rank_pid=2000 + rank)
        group = HostGroup(group_dir("job", host, root=str(root)), own, LIMITS.replace_s)
        self.hb = HostBeats(
            group, host, lambda: store, WORLD,
            lambda kind, **f: self.events.append((kind, f)), self.arrived.append, LIMITS,
        )  # fmt: skip

    def beat(self, now: float) -> None:
        """One heartbeat interval of this monitor, at monotonic time ``now``."""
        beat = Beat(self.rank, pid=2000 + self.rank, rank=self.rank, world_size=WORLD,
                    round=0, timeout=TIMEOUT)  # fmt: skip
        self.hb.beat(beat, now)

    @property
    def leading(self) -> bool:
        return self.hb.group.leading

    def faults(self) -> list[tuple[int, str]]:
        return [(f["origin_rank"], f["fault_kind"]) for kind, f in self.events if kind == "fault"]


def _round(store: Any) -> Any:
    """Round 0 at world size ``WORLD``, each rank at its initial rank."""
    rounds.publish_round(store, 0)
    view = rstore.round_store(store, 0)
    for rank in range(WORLD):
        view.set(rounds.rank_state(rank), json.dumps({"initial_rank": rank, "world_size": WORLD}))
    return view


def test_the_first_monitor_of_a_host_leads_and_alone_talks_to_the_store(sockets_dir, base) -> None:
    store = Counting(base)
    members = [Member(sockets_dir, store, rank) for rank in range(3)]
    assert [m.leading for m in members] == [True, False, False]
    for now in (1.0, 1.1, 1.2):
        for m in reversed(members):
            m.beat(now)
    assert live_ranks(base, 0) == [0, 1, 2]
    before = store.requests
    for now in (1.3, 1.4, 1.5):
        for m in reversed(members):
            m.beat(now)
    # at most two requests per beat of the host (its counter, the next host's), none per rank
    assert 3 <= store.requests - before <= 3 * 2
    assert int(base.add(keys.host_alive(0), 0)) == 6
    assert all(m.faults() == [] for m in members)


def test_a_follower_silent_for_its_timeout_is_taken_out_once(sockets_dir, base) -> None:
    view = _round(base)
    leader, follower = Member(sockets_dir, base, 0), Member(sockets_dir, base, 1)
    follower.beat(1.0)
    leader.beat(1.0)
    leader.beat(1.0 + TIMEOUT / 2)
    assert rstore.terminated_ranks(view) == set()
    leader.beat(1.0 + TIMEOUT + 0.1)
    leader.beat(1.0 + 2 * TIMEOUT + 0.2)
    assert rstore.terminated_ranks(view) == {1}
    assert leader.faults() == [(1, "unresponsive")]
    assert leader.arrived == [1]


def test_a_leader_that_ends_hands_over_and_the_next_knows_the_hosts_ranks(sockets_dir, base) -> None:
    """Rank 0's leader ends on purpose; rank 1 leads next. Rank 2, known to it only from the
    store (it never beat to it), is taken out when it stays silent; rank 0 is not."""
    view = _round(base)
    a, b, c = (Member(sockets_dir, base, rank) for rank in range(3))
    b.beat(1.0)
    c.beat(1.0)
    a.beat(1.0)
    a.hb.end()
    assert not a.leading
    assert live_ranks(base, 0) == [1, 2]
    b.beat(2.0)
    assert b.leading and b.faults() == []
    b.beat(2.0 + TIMEOUT + 0.1)
    assert rstore.terminated_ranks(view) == {2}
    assert b.faults() == [(2, "unresponsive")]


LEADER_PROGRAM = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "from nvrx.inprocess.host_group import HostGroup, Leader\n"
    "own = Leader(monitor_pid=os.getpid(), initial_rank=0, rank_pid=2000)\n"
    "group = HostGroup(Path(sys.argv[1]), own, 0.5)\n"
    "assert group.join()\n"
    "print('leading', flush=True)\n"
    "for line in sys.stdin:  # one stamp per line\n"
    "    group.touch()\n"
    "    print('stamped', flush=True)\n"
)


def _leader_process(sockets_dir: Path) -> subprocess.Popen[str]:
    """Rank 0's monitor, leading the group of host h0, in a process of its own."""
    directory = group_dir("job", "h0", root=str(sockets_dir))
    proc = subprocess.Popen(
        [sys.executable, "-c", LEADER_PROGRAM, str(directory)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "leading\n"
    return proc


def _stamp(leader: subprocess.Popen[str]) -> None:
    assert leader.stdin is not None and leader.stdout is not None
    leader.stdin.write("\n")
    leader.stdin.flush()
    assert leader.stdout.readline() == "stamped\n"


@pytest.mark.parametrize("seen", [True, False], ids=["seen-alive", "left-by-an-earlier-run"])
def test_a_leader_that_died_is_replaced(sockets_dir, base, seen) -> None:
    """A leader SIGKILLed leaves its socket behind: the follower's next beat is refused and
    it leads in its place. It takes the dead leader's rank out at once where it saw that
    leader stamp; files of a process it never saw alive (an earlier run of the job) name
    no rank of this job."""
    view = _round(base)
    leader = _leader_process(sockets_dir)
    try:
        follower = Member(sockets_dir, base, 1)
        assert not follower.leading
        follower.beat(1.0)
        if seen:
            _stamp(leader)
            follower.beat(1.1)
        assert not follower.leading  # it listens: beats reach it
    finally:
        leader.send_signal(signal.SIGKILL)
        leader.wait()
    follower.beat(2.0)  # refused: the socket it left behind is replaced
    assert follower.leading
    assert rstore.terminated_ranks(view) == ({0} if seen else set())
    assert follower.faults() == ([(0, "unresponsive")] if seen else [])


def test_a_leader_that_stands_still_is_replaced_and_follows_when_it_comes_back(
    sockets_dir, base
) -> None:
    """A leader that stops stamping (blocked, maybe) is replaced after half the timeout; its
    rank then has a full timeout to beat to the new leader. Back, it follows."""
    view = _round(base)
    a, b = Member(sockets_dir, base, 0), Member(sockets_dir, base, 1)
    a.beat(1.0)
    b.beat(1.0)
    b.beat(1.0 + TIMEOUT / 4)
    assert not b.leading
    b.beat(1.0 + TIMEOUT / 2 + 0.05)
    assert b.leading and rstore.terminated_ranks(view) == set()
    a.beat(1.0 + TIMEOUT)  # back: another leads, it follows and beats to it
    assert not a.leading
    b.beat(1.0 + TIMEOUT + 0.05)
    b.beat(1.0 + 2 * TIMEOUT)
    assert rstore.terminated_ranks(view) == set() and b.faults() == []
    b.beat(1.0 + 3 * TIMEOUT)  # silent since: taken out
    assert rstore.terminated_ranks(view) == {0}
    assert b.faults() == [(0, "unresponsive")]


def test_a_stopped_leader_is_replaced_and_its_rank_taken_out_at_once(sockets_dir, base) -> None:
    view = _round(base)
    leader = _leader_process(sockets_dir)
    try:
        follower = Member(sockets_dir, base, 1)
        follower.beat(1.0)
        leader.send_signal(signal.SIGSTOP)
        wait_until("the leader stopped", lambda: psutil.Process(leader.pid).status() == "stopped", 10)
        follower.beat(1.0 + TIMEOUT / 2 + 0.05)
        assert follower.leading
        assert rstore.terminated_ranks(view) == {0}
        assert follower.faults() == [(0, "unresponsive")]
    finally:
        leader.kill()
        leader.wait()


def test_a_host_whose_leader_stands_still_is_not_taken_out_by_the_host_watching_it(
    sockets_dir, base
) -> None:
    """Host h1's leader (rank 2) stands still; its follower (rank 3) replaces it after half
    the timeout and beats for the host, before h0 could find h1 silent: only rank 2 is
    taken out, by rank 3, once it has been silent for a full timeout more."""
    view = _round(base)
    a = Member(sockets_dir, base, 0, "h0")
    c, d = Member(sockets_dir, base, 2, "h1"), Member(sockets_dir, base, 3, "h1")
    for now in (1.0, 1.1):
        for m in (d, c, a):
            m.beat(now)
    a.hb.new_round(now)  # h1 in the ring of h0 now
    now = 1.1
    while now < 1.1 + 3 * TIMEOUT:
        now += 0.1
        d.beat(now)
        a.beat(now)
    assert d.leading
    assert rstore.terminated_ranks(view) == {2}
    assert a.faults() == [] and d.faults() == [(2, "unresponsive")]


@pytest.mark.parametrize("ends", ["silent", "ended", "one killed"])
def test_a_silent_host_is_taken_out_by_the_host_that_watches_it(sockets_dir, base, ends) -> None:
    """Hosts h0 (ranks 0, 1) and h1 (ranks 2, 3). h1 falls silent: h0's leader takes its
    ranks out; an h1 whose last monitor ended on purpose is nobody's fault. Where rank 3's
    monitor was killed first, rank 2's, ending on purpose, removes the directory but leaves
    the host's place: rank 3 is taken out."""
    view = _round(base)
    a, b = Member(sockets_dir, base, 0, "h0"), Member(sockets_dir, base, 1, "h0")
    c, d = Member(sockets_dir, base, 2, "h1"), Member(sockets_dir, base, 3, "h1")
    for now in (1.0, 1.2):
        for m in (b, a, d, c):
            m.beat(now)
    assert c.leading and live_ranks(base, 1) == [2, 3]
    if ends == "one killed":
        d.hb.group.close()  # as its death would: its member file stays, its lock is gone
        c.hb.end()
        assert not c.hb.group.dir.exists()
    if ends == "ended":
        d.hb.end()
        c.hb.end()
    now = 1.2
    while now < 1.2 + 3 * TIMEOUT:
        now += 0.2
        b.beat(now)
        a.beat(now)
    if ends == "ended":
        assert rstore.terminated_ranks(view) == set() and a.faults() == []
        assert not c.hb.group.dir.exists()  # its last monitor removed the host's directory
    elif ends == "one killed":
        assert rstore.terminated_ranks(view) == {3} and a.faults() == [(3, "unresponsive")]
    else:
        assert rstore.terminated_ranks(view) == {2, 3}
        assert sorted(a.faults()) == [(2, "unresponsive"), (3, "unresponsive")]
        assert sorted(a.arrived) == [2, 3]


def test_a_rank_silent_before_its_round_is_taken_out_once_a_round_names_it(
    sockets_dir, base
) -> None:
    """Rank 1 falls silent before any round names it: nothing to take it out of, and it
    does not pass for out at the termination barrier. Tried again later, once round 0
    names it, it is taken out."""
    a, b = Member(sockets_dir, base, 0), Member(sockets_dir, base, 1)
    b.beat(1.0)
    now = 1.0
    while now < 1.0 + TIMEOUT + 0.1:
        a.beat(now)
        now += 0.1
    assert a.faults() == [] and a.arrived == []
    view = _round(base)
    a.beat(now)  # too early to try again
    assert rstore.terminated_ranks(view) == set()
    a.beat(now + 0.1)
    a.beat(now + LIMITS.replace_s)
    assert rstore.terminated_ranks(view) == {1}
    assert a.faults() == [(1, "unresponsive")] and a.arrived == [1]


def test_a_rank_that_ended_on_purpose_is_not_taken_out_though_its_bye_was_lost(
    sockets_dir, base
) -> None:
    view = _round(base)
    a, b = Member(sockets_dir, base, 0), Member(sockets_dir, base, 1)
    b.beat(1.0)
    a.beat(1.0)
    base.append(keys.host_ended(b.hb.slot), "1,")  # its end, written; its bye never came
    a.beat(1.0 + TIMEOUT + 0.1)
    assert rstore.terminated_ranks(view) == set() and a.faults() == []


def test_groups_of_one_host_name_that_see_different_directories_beat_apart(
    sockets_dir, base
) -> None:
    """Ranks of one host name whose /dev/shm are private (containers) form two groups: each
    has a place of its own in the ring, and neither watches the other's ranks."""
    a = Member(sockets_dir / "shm-a", base, 0, "node-1")
    b = Member(sockets_dir / "shm-b", base, 1, "node-1")
    assert a.leading and b.leading and a.hb.slot != b.hb.slot
    for now in (1.0, 1.2, 1.4, 1.6, 1.8):
        a.beat(now)
        b.beat(now)
    assert a.faults() == [] and b.faults() == []


def test_ending_never_raises_when_the_store_is_gone(sockets_dir) -> None:
    from nvrx.store import client

    server = client.serve("127.0.0.1", 0, timeout=10)
    store = client.connect("127.0.0.1", server.port, timeout=2)
    a, b = Member(sockets_dir, store, 0), Member(sockets_dir, store, 1)
    b.beat(1.0)
    a.beat(1.0)
    del server  # the store host ended first, as at the end of a job
    b.hb.end()
    a.hb.end()
    assert not a.leading and not a.hb.group.dir.exists()


class Failing(Counting):
    """A real store client whose connection breaks on demand (``broken``)."""

    broken = False

    def __getattr__(self, name: str) -> Any:
        method = super().__getattr__(name)

        def maybe(*args: Any) -> Any:
            if self.broken:
                raise ConnectionResetError("the store's connection was reset")
            return method(*args)

        return maybe


def test_a_leader_that_cannot_reach_the_store_stops_stamping_and_is_replaced(
    sockets_dir, base
) -> None:
    """Rank 0's leader lost its link to the store: it leads on, but stamps no more, so rank
    1, whose link works, leads in its place and beats for the host; rank 0 follows."""
    broken = Failing(base)
    a, b = Member(sockets_dir, broken, 0), Member(sockets_dir, base, 1)
    for now in (1.0, 1.1):
        b.beat(now)
        a.beat(now)
    broken.broken = True
    now = 1.1
    while not b.leading and now < 1.1 + TIMEOUT:
        now += 0.1
        b.beat(now)
        a.beat(now)
    assert b.leading and not a.leading
    beats = int(base.add(keys.host_alive(a.hb.slot), 0))
    b.beat(now + 0.1)
    assert int(base.add(keys.host_alive(a.hb.slot), 0)) == beats + 1


def test_a_take_out_the_store_failed_is_done_at_a_later_beat(sockets_dir, base, monkeypatch) -> None:
    """The store fails the first take-out of silent rank 1 (a reset connection, injected
    into the real ``leave_round``): the next beat does it."""

    real, calls = rounds.leave_round, []

    def once_failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1])
        if len(calls) == 1:
            raise ConnectionResetError("the store's connection was reset")
        return real(*args, **kwargs)

    monkeypatch.setattr(rounds, "leave_round", once_failing)
    view = _round(base)
    a, b = Member(sockets_dir, base, 0), Member(sockets_dir, base, 1)
    b.beat(1.0)
    a.beat(1.0)
    a.beat(1.0 + TIMEOUT + 0.1)
    assert calls == [[1]] and rstore.terminated_ranks(view) == set()
    a.beat(1.0 + TIMEOUT + 0.2)  # tried again only after replace_s
    assert calls == [[1]]
    a.beat(1.0 + TIMEOUT + 0.15 + LIMITS.replace_s)
    assert calls == [[1], [1]] and rstore.terminated_ranks(view) == {1}
    assert a.faults() == [(1, "unresponsive")]


def test_a_monitor_joining_while_the_last_one_leaves_makes_the_group_again(sockets_dir) -> None:
    directory = group_dir("job", "h0", root=str(sockets_dir))
    first = HostGroup(directory, Leader(1000, 0, 2000), LIMITS.replace_s)
    assert first.join()
    assert first.leave() and not directory.exists()
    second = HostGroup(directory, Leader(1001, 1, 2001), LIMITS.replace_s)
    assert second.join() and (directory / "leader.json").exists()
    assert second.leave()


def test_a_silent_host_whose_ranks_no_round_names_yet_keeps_its_place_until_they_are_out(
    sockets_dir, base
) -> None:
    """h1 falls silent before any round: its place in the ring is not ended (a later leader
    would find it silent again) until its ranks are out, once round 0 names them."""
    a = Member(sockets_dir, base, 0, "h0")
    c, d = Member(sockets_dir, base, 2, "h1"), Member(sockets_dir, base, 3, "h1")
    for now in (1.0, 1.1):
        for m in (d, c, a):
            m.beat(now)
    a.hb.new_round(now)
    while now < 1.1 + 2 * LIMITS.host_s:
        now += 0.1
        a.beat(now)
    assert a.faults() == [] and int(base.add(keys.host_claim(c.hb.slot), 0)) == 0
    view = _round(base)
    a.beat(now + LIMITS.replace_s)
    assert rstore.terminated_ranks(view) == {2, 3}
    assert sorted(a.faults()) == [(2, "unresponsive"), (3, "unresponsive")]
    assert int(base.add(keys.host_claim(c.hb.slot), 0)) == 1


def test_a_rank_that_beat_again_after_a_silence_is_found_silent_again(sockets_dir, base) -> None:
    a, b = Member(sockets_dir, base, 0), Member(sockets_dir, base, 1)
    b.beat(1.0)
    a.beat(1.0)
    a.beat(1.0 + TIMEOUT + 0.1)  # silent, but in no round: nothing to take it out of
    b.beat(2.0)  # it beats again
    a.beat(2.0)
    view = _round(base)
    a.beat(2.0 + TIMEOUT + 0.1)  # silent again
    assert rstore.terminated_ranks(view) == {1}
    assert a.faults() == [(1, "unresponsive")]


def test_replacing_a_leader_whose_group_directory_is_gone_declines_without_raising(sockets_dir) -> None:
    directory = group_dir("job", "h0", root=str(sockets_dir))
    leader = HostGroup(directory, Leader(1000, 0, 2000), LIMITS.replace_s)
    follower = HostGroup(directory, Leader(1001, 1, 2001), LIMITS.replace_s)
    assert leader.join() and not follower.join()
    seen = follower.leader()
    leader.close()
    for path in directory.iterdir():  # the group's last member removed it meanwhile
        path.unlink()
    directory.rmdir()
    assert follower.replace(Stale("gone", seen)) is False
    assert follower.replace(Stale("still", seen, stamp=1)) is False
    assert not directory.exists() and not follower.leading
    follower.close()
