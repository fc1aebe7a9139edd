"""The beats' half of the wire between a node's ranks and its node agent
(``nvrx.node_agent.rank_wire``: ``Beat``, ``RankBeats``, ``BeatLoop``): a beat on the
socket, and who is declared silent when, under a supervisor too. Its barriers' half:
``tests/multiproc/test_host_barrier.py``."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from nvrx.node_agent.rank_wire import (
    BarrierRelay,
    Beat,
    BeatLoop,
    BeatSender,
    BeatSocket,
    NewPids,
    RankBeats,
    Silence,
    child_of_supervisor,
)
from nvrx.node_agent.supervised import NodeDuty
from nvrx.supervisor.config import SupervisorConfig, local_job
from nvrx.supervisor.course import Course, CourseTracker
from nvrx.supervisor.hang_watch import HangWatch
from nvrx.supervisor.job_store import JobStore
from nvrx.supervisor.local_ranks import LocalRanks
from nvrx.supervisor.step_times import StepTimes
from nvrx.supervisor.store_link import StoreLinkError
from tests.support.waiting import wait_until


def _beat(initial: int = 1, pid: int = 100, *, local_rank: int = 1, attempt: int = 0, **kw) -> Beat:
    fields = dict(rank=initial, world_size=4, round=3, interval=0.5, timeout=10.0)
    fields.update(kw)
    return Beat(initial, pid, local_rank, attempt, **fields)


def test_a_beat_names_its_hosts_slot_only_where_it_has_one() -> None:
    # under a supervisor no slot: its beat is what an nvrx without the field reads too
    plain = _beat()
    assert b'"slot"' not in plain.encode() and Beat.decode(plain.encode()) == plain
    placed = _beat(slot=3)
    assert Beat.decode(placed.encode()) == placed and Beat.decode(placed.encode()).slot == 3


@pytest.mark.parametrize(
    ("env", "child"),
    [
        ({"LOCAL_RANK": "3", "NVRX_RESTART_COUNT": "2"}, (3, 2)),
        # fork_and_monitor: LOCAL_RANK stays the launcher's, the monitor's one child is 0
        ({"LOCAL_RANK": "3", "NVRX_SUPERVISOR_LOCAL_RANK": "0"}, (0, 0)),
        ({}, (-1, 0)),
    ],
)
def test_a_beat_names_the_child_the_supervisor_knows_the_rank_by(monkeypatch, env, child) -> None:
    for name in ("LOCAL_RANK", "NVRX_SUPERVISOR_LOCAL_RANK", "NVRX_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert child_of_supervisor() == child


def test_a_beat_crosses_the_socket_and_garbage_is_dropped(tmp_path) -> None:
    sock = BeatSocket(str(tmp_path / "beats.sock"))
    sender = BeatSender(sock.path)
    try:
        assert sender.send(_beat(monitor_pid=77))
        raw = BeatSender(sock.path)
        raw._sock.sendto(b'{"initial_rank": "x"}', sock.path)
        raw._sock.sendto(b"not json", sock.path)
        raw._sock.sendto(_beat().encode().replace(b'"timeout":10.0', b'"timeout":"x"'), sock.path)
        raw._sock.sendto(_beat().encode().replace(b'"interval":0.5', b'"interval":NaN'), sock.path)
        raw.close()
        assert sender.send(_beat(2, 101, bye=True))
        assert sock.receive() == [_beat(monitor_pid=77), _beat(2, 101, bye=True)]
        assert sock.receive() == []
    finally:
        sender.close()
        sock.close()
    assert not os.path.exists(sock.path)


def test_a_sender_without_a_listener_loses_the_beat_and_does_not_block(tmp_path) -> None:
    sender = BeatSender(str(tmp_path / "nobody.sock"))
    assert not sender.send(_beat())
    assert sender.listener_gone
    sender.close()


def test_a_sender_knows_when_the_supervisor_is_gone_closed_or_killed(tmp_path) -> None:
    """A socket file left by a supervisor that died refuses; one that ended removed it."""
    killed = BeatSocket(str(tmp_path / "killed.sock"))
    sender = BeatSender(killed.path)
    try:
        assert sender.send(_beat()) and not sender.listener_gone
        killed._sock.close()  # as the kernel does for a SIGKILLed supervisor: the file stays
        assert os.path.exists(killed.path)
        assert not sender.send(_beat()) and sender.listener_gone
        ended = BeatSocket(killed.path + ".2")
        sender.path = ended.path
        assert sender.send(_beat()) and not sender.listener_gone  # a beat that arrives again
        ended.close()
        assert not sender.send(_beat()) and sender.listener_gone
    finally:
        sender.close()


def test_a_rank_is_declared_once_per_silence_when_its_timeout_passes() -> None:
    beats = RankBeats()
    beats.record([_beat()], now=100.0)
    assert beats.next_deadline() == 110.0  # its heartbeat timeout (10 s)
    assert beats.due(109.0) == []
    beats.record([_beat()], now=105.0)  # a beat pushes the deadline
    assert beats.due(114.0) == []
    (silence,) = beats.due(115.5)
    assert silence.beat == _beat() and silence.silent_s == pytest.approx(10.5)
    assert beats.due(200.0) == []  # named once
    beats.record([_beat()], now=200.5)  # the same process beats again: its silence ended
    assert [s.silent_s for s in beats.due(211.0)] == [pytest.approx(10.5)]
    beats.record([_beat(round=4)], now=201.0)  # it beats again in a new round: watched again
    assert [s.beat.round for s in beats.due(212.0)] == [4]


def test_time_the_agent_did_not_look_is_no_ranks_silence() -> None:
    """The agent looked 30 s late (stopped with its job, say): a rank whose timeout (10 s)
    is less than twice that has its silence counted from that look; a look 4 s late (less
    than half a timeout) changes nothing. The silence told counts from the last beat."""
    beats = RankBeats()
    beats.record([_beat()], now=100.0)
    beats.forgive(104.0, late_s=4.0)
    assert beats.next_deadline() == 110.0
    beats.forgive(140.0, late_s=30.0)
    assert beats.due(140.0) == [] and beats.next_deadline() == 150.0
    (silence,) = beats.due(150.5)
    assert silence.silent_s == pytest.approx(50.5)
    beats.forgive(300.0, late_s=100.0)  # told already: not watched again until it beats
    assert beats.due(400.0) == []
    beats.record([_beat()], now=500.0)
    for now in (530.0, 545.0, 560.0):  # the agent goes on looking late: forgiven once
        beats.forgive(now, late_s=30.0)
    assert beats.next_deadline() == 540.0  # from the first late look, not the later ones
    assert [s.silent_s for s in beats.due(560.0)] == [pytest.approx(60.0)]


def test_a_bye_ends_a_watch_and_an_ended_attempts_monitor_stands_for_no_replacement() -> None:
    beats = RankBeats()
    beats.record([_beat(1, 100, local_rank=1), _beat(2, 200, local_rank=2)], now=0.0)
    beats.record([_beat(1, 100, local_rank=1, bye=True)], now=1.0)
    beats.record([_beat(2, 300, local_rank=2, attempt=1)], now=3.0)  # its replacement
    beats.record([_beat(2, 200, local_rank=2)], now=4.0)  # attempt 0's monitor beats on
    [silence] = beats.due(100.0)  # the replacement's silence, since its own last beat
    assert silence.beat.pid == 300 and silence.silent_s == 97.0


class _Node:
    """The supervisor as ``HangWatch`` sees it (its ``NodeControl``), with one running child."""

    def __init__(self, link: Any) -> None:
        self.child = SimpleNamespace(local_rank=1, attempt=0, running=True, pid=5, tells=False, training=False)
        self.child.signal_group = lambda signum: self.calls.append(f"signal {signum}")
        self.calls: list[str] = []
        self.events: list[dict[str, Any]] = []
        self.node_rank = 0  # (``NodeControl.node_rank``: the node rank this slot holds)
        store = JobStore(SupervisorConfig(command=["train"], job=local_job(nproc_per_node=4)))
        store.link = link
        ranks = LocalRanks(store, spawn=None, emit=self.emit)
        ranks.children[1] = self.child
        course = CourseTracker()
        course.to(Course.TRAINING)
        self.hangs = HangWatch(
            store, course, self, ranks, set(), workload=None,
            job_restart=SimpleNamespace(pending=None), store_lost=self._store_lost,
            step_times=StepTimes(store, course, self),
        )  # fmt: skip
        self.hangs.start()

    def emit(self, kind: str, **fields: Any) -> None:
        self.calls.append(kind)
        self.events.append({"kind": kind, **fields})

    def _store_lost(self, detail: str) -> bool:
        self.calls.append("lost")
        return True

    def store_unavailable(self, exc: Exception) -> None:
        self.calls.append("unavailable")


def _silent(beat: Beat, silent_s: float = 11.0) -> dict[str, Any]:
    """What the node agent says of a rank whose monitor fell silent."""
    return {"event": "rank_silent", "beat": dataclasses.asdict(beat), "silent_s": silent_s}


def test_a_silent_rank_is_taken_out_then_killed_and_an_ended_child_is_no_silence() -> None:
    left: list[tuple] = []
    sup = _Node(SimpleNamespace(lost=None, leave_silent=lambda *a: left.append(a)))
    try:
        assert sup.hangs.on_message(_silent(_beat(pid=5, attempt=1)))  # not the running attempt's
        assert left == [] and sup.calls == []
        assert sup.hangs.on_message(_silent(_beat(pid=5)))
        assert left == [(1, 4, "no heartbeat for 11.0 s")]
        assert sup.calls == ["fault", f"signal {int(signal.SIGKILL)}"]
        assert sup.hangs.hang_fault(5).fault_kind == "unresponsive"
        assert sup.hangs.on_message({"event": "wrapper_pid", "pid": 77})  # no child's: passed over
        assert sup.hangs.on_message({"event": "wrapper_pid", "pid": 5})
        assert sup.hangs.wrapper_pids == {5} and not sup.hangs.on_message({"event": "key"})
    finally:
        sup.hangs.close()


def test_a_silent_rank_under_a_shell_is_named_by_the_child_its_supervisor_kills() -> None:
    """The rank beats from its own process (pid 6) under the supervisor's child, a shell
    (pid 5): the fault names the child that is killed, whose end the report then explains."""
    sup = _Node(SimpleNamespace(lost=None, leave_silent=lambda *a: None))
    try:
        assert sup.hangs.on_message(_silent(_beat(pid=6)))
        [fault] = [e for e in sup.events if e["kind"] == "fault"]
        assert fault["child_pid"] == 5 and fault["fault_kind"] == "unresponsive"
    finally:
        sup.hangs.close()


def test_a_silent_ranks_fault_says_how_long_it_had_been_silent() -> None:
    """The fault's ``detection_s`` is the rank's silence: the report reads the fault's onset
    from it, not from when the silence was found."""
    sup = _Node(SimpleNamespace(lost=None, leave_silent=lambda *a: None))
    try:
        assert sup.hangs.on_message(_silent(_beat(pid=5), silent_s=12.5))
        [fault] = [e for e in sup.events if e["kind"] == "fault"]
        assert fault["detection_s"] == 12.5 and fault["message"] == "no heartbeat for 12.5 s"
    finally:
        sup.hangs.close()


def test_a_lost_store_link_neither_takes_a_rank_out_nor_schedules_anything() -> None:
    sup = _Node(SimpleNamespace(lost="node agent exited"))
    try:
        assert sup.hangs.on_message(_silent(_beat(pid=5)))
        assert sup.calls == [] and sup.hangs.timeout(None) is None
    finally:
        sup.hangs.close()


def test_a_store_lost_while_a_silent_rank_is_taken_out_is_failed_over() -> None:
    def leave_silent(*args: Any) -> None:
        link.lost = "the store did not answer"
        raise StoreLinkError("lost during leave_silent")

    link = SimpleNamespace(lost=None, leave_silent=leave_silent)
    sup = _Node(link)
    try:
        sup.hangs.on_message(_silent(_beat(pid=5)))
        assert sup.calls == ["lost"]  # a failover, not a stop of the job
    finally:
        sup.hangs.close()


def _watch(tmp_path) -> tuple[NodeDuty, BeatSender, list[dict[str, Any]]]:
    """The node agent's reader of a socket bound as the supervisor binds it."""
    bound = BeatSocket(str(tmp_path / "beats.sock"))
    told: list[dict[str, Any]] = []
    watch = NodeDuty(told.append, BeatSocket("", os.dup(bound.fileno())))
    bound.close(unlink=False)  # the watch's copy keeps the socket
    return watch, BeatSender(str(tmp_path / "beats.sock")), told


def test_beats_cost_the_store_nothing_and_a_new_process_is_told_once(tmp_path) -> None:
    """The agent reads beats without a store: only a silence leads to a request."""
    watch, sender, told = _watch(tmp_path)
    try:
        for _ in range(5):
            assert sender.send(_beat(pid=5))
            watch.loop.look(time.monotonic())
        assert told == [{"event": "wrapper_pid", "pid": 5}, {"event": "rank_in_round", "pid": 5}]
        watch.loop.look(time.monotonic() + 11.0)  # its monitor fell silent beyond 10 s
        [silent] = told[2:]
        assert silent["event"] == "rank_silent" and Beat(**silent["beat"]) == _beat(pid=5)
        watch.loop.look(time.monotonic() + 12.0)
        assert len(told) == 3  # each silence told once
    finally:
        sender.close()
        watch.loop.sock.close(unlink=False)


def test_a_process_is_told_in_a_round_once_from_its_first_beat_in_one(tmp_path) -> None:
    """What the supervisor waits for before it starts a standby: the rank trains."""
    watch, sender, told = _watch(tmp_path)
    try:
        assert sender.send(_beat(pid=6, round=-1))  # its monitor is up, before the first round
        watch.loop.look(time.monotonic())
        assert told == [{"event": "wrapper_pid", "pid": 6}]
        for round_ in (0, 0, 1):
            assert sender.send(_beat(pid=6, round=round_))
            watch.loop.look(time.monotonic())
        assert told[1:] == [{"event": "rank_in_round", "pid": 6}]
        # its monitor ends; a later process with the same pid is told again
        assert sender.send(_beat(pid=6, round=1, bye=True))
        watch.loop.look(time.monotonic())
        assert sender.send(_beat(pid=7, round=1, bye=True))  # a bye alone tells nothing
        watch.loop.look(time.monotonic())
        assert len(told) == 2
        assert sender.send(_beat(pid=6, round=0))
        watch.loop.look(time.monotonic())
        assert [m["event"] for m in told[2:]] == ["wrapper_pid", "rank_in_round"]
        # a bye and the next call's first beat read in one look: the call is told too
        assert sender.send(_beat(pid=6, round=1, bye=True))
        assert sender.send(_beat(pid=6, round=-1))
        watch.loop.look(time.monotonic())
        assert told[4:] == [{"event": "wrapper_pid", "pid": 6}]
        # the barrier relay: a replacement of rank 2 beats, waiting to be admitted (no round
        # yet): it meets no barrier of the round; a first process of rank 3 before its first
        # beat from a round does
        watch.relay = BarrierRelay(f"\0nvrx-test-relay-{os.getpid()}", lambda: None).start()
        assert sender.send(_beat(initial=2, pid=8, local_rank=2, attempt=1, round=-1))
        assert sender.send(_beat(initial=3, pid=9, local_rank=3, attempt=0, round=-1))
        watch.loop.look(time.monotonic())
        assert (watch.relay.local_ranks, watch.relay.round_ranks) == (3, 2)
    finally:
        if watch.relay is not None:
            watch.relay.close()
        sender.close()
        watch.loop.sock.close(unlink=False)


def test_beats_that_came_while_the_agent_was_busy_are_read_before_any_silence(tmp_path) -> None:
    watch, sender, told = _watch(tmp_path)
    try:
        watch.loop.beats.record([_beat(pid=5)], now=time.monotonic() - 11.0)  # read long ago
        assert sender.send(_beat(pid=5))  # it beat while the agent was blocked elsewhere
        watch.loop.look(time.monotonic())
        assert [m["event"] for m in told] == []  # pid 5 was known already
    finally:
        sender.close()
        watch.loop.sock.close(unlink=False)


@pytest.mark.timeout(120)
def test_the_node_agent_reads_the_beats_of_the_socket_it_is_given(tmp_path) -> None:
    """The node agent, a real process, reads the socket its supervisor passes it and
    tells of a rank that stops beating."""
    from nvrx.store.service import StoreService
    from nvrx.supervisor.store_link import StoreLink

    bound = BeatSocket(str(tmp_path / "beats.sock"))
    service = StoreService("127.0.0.1", 0, node=None).launch()
    link = StoreLink(None, None, timeout=30, beats_fd=bound.fileno()).launch()
    sender = BeatSender(bound.path)
    try:
        service.wait_started(60)
        link.aim("127.0.0.1", service.port).wait_ready()
        assert sender.send(_beat(pid=5, timeout=0.5))
        told: list[dict[str, Any]] = []
        while not [m for m in told if m["event"] == "rank_silent"]:
            select.select([link.fileno()], [], [], 30)  # the agent's next message
            told.extend(link.read_events())
            assert link.lost is None, told
        assert [m["event"] for m in told[:2]] == ["wrapper_pid", "rank_in_round"], told
        assert {m["pid"] for m in told[:2]} == {5}
        assert Beat(**told[-1]["beat"]).pid == 5 and told[-1]["silent_s"] >= 0.5
    finally:
        sender.close()
        link.close()
        service.stop()
        bound.close()


def test_a_bye_waits_for_room_in_a_full_queue_where_a_beat_is_dropped(tmp_path) -> None:
    import threading

    sock = BeatSocket(str(tmp_path / "beats.sock"))
    sender = BeatSender(sock.path)
    try:
        sent = 0
        while sender.send(_beat()):  # fill the supervisor's queue (net.unix.max_dgram_qlen)
            sent += 1
            assert sent < 100_000
        assert not sender.send(_beat())  # a beat does not wait
        assert not sender.listener_gone  # a busy supervisor is not a gone one
        got: list = []
        drained = threading.Timer(0.3, lambda: got.extend(sock.receive()))  # a busy supervisor
        drained.start()
        assert sender.send(_beat(bye=True), wait_s=5.0)  # the bye waits for the drain
        drained.join()
        got.extend(sock.receive())
        assert got[-1] == _beat(bye=True) and len(got) == sent + 1
    finally:
        sender.close()
        sock.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="sending as another user needs root")
def test_a_beat_of_another_user_is_dropped_even_when_it_reaches_the_socket() -> None:
    import shutil
    import socket
    import tempfile

    open_dir = tempfile.mkdtemp(prefix="nvrx-beats-", dir="/tmp")
    os.chmod(open_dir, 0o777)  # open the way, as a careless setup would
    sock = BeatSocket(os.path.join(open_dir, "beats.sock"))
    os.chmod(sock.path, 0o777)
    pid = os.fork()
    if pid == 0:  # the other user: sends a beat that would look like rank 1's
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            peer.sendto(_beat().encode(), sock.path)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # it was sent
    mine = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    mine.sendto(_beat(initial=2).encode(), sock.path)
    try:
        assert [b.initial_rank for b in sock.receive()] == [2] and sock.refused == 1
    finally:
        sock.close()
        shutil.rmtree(open_dir)


def test_an_agent_started_ahead_reads_no_beat_before_it_has_an_address(tmp_path, monkeypatch) -> None:
    """An agent started ahead for a failover leaves the beats to the agent it will replace
    until it is given the store's address: while it waits for one it runs no beat reader and
    the socket keeps every beat; given none, it ends without reading any."""
    import threading

    from nvrx.node_agent import supervised

    bound = BeatSocket(str(tmp_path / "beats.sock"))
    sender = BeatSender(bound.path)
    waiting, release = threading.Event(), threading.Event()

    def address_later() -> None:  # the supervisor has not sent the address yet
        waiting.set()
        release.wait(60)
        return None  # ... and never does: the failover did not need this agent

    monkeypatch.setattr(supervised, "_address_from_stdin", address_later)
    ended: list[int] = []
    fd = os.dup(bound.fileno())  # as passed to the agent process
    agent = threading.Thread(target=lambda: ended.append(supervised.main(["-", "-", "5", str(fd)])))
    try:
        assert sender.send(_beat(pid=7))
        agent.start()
        assert waiting.wait(60)
        assert "rank-beats" not in {t.name for t in threading.enumerate()}
        release.set()
        agent.join(60)
        assert ended == [0]
        assert [b.pid for b in bound.receive()] == [7]  # left for the agent that reads them
    finally:
        release.set()
        os.close(fd)
        sender.close()
        bound.close()


class _Told:
    """A duty that notes what its ``BeatLoop`` tells it (the loop is what is tested), ticking
    every ``interval`` once one is given, until ``ticks`` ticks ran."""

    def __init__(self, ticks: int) -> None:
        self.told: list[tuple[str, Any]] = []
        self.every: float | None = None
        self.ticks = ticks

    def received(self, beats: list[Beat], new: NewPids, now: float) -> None:
        self.told.extend(("beat", b.pid) for b in beats)

    def silent(self, silence: Silence, now: float) -> None:
        self.told.append(("silent", silence.beat.pid))

    def interval(self) -> float | None:
        return self.every

    def tick(self, now: float) -> bool:
        self.told.append(("tick", now))
        return len([t for t in self.told if t[0] == "tick"]) < self.ticks


@contextlib.contextmanager
def _running(duty: _Told) -> Iterator[tuple[BeatSender, BeatLoop, threading.Event]]:
    """A beat loop of ``duty`` running in a thread; a sender to it; an event set when it ends."""
    sock = BeatSocket(f"\0nvrx-test-loop-{uuid.uuid4().hex}")
    sender = BeatSender(sock.path)
    ended = threading.Event()
    loop = BeatLoop(sock, duty)
    thread = threading.Thread(target=lambda: (loop.run(), ended.set()), daemon=True)
    try:
        thread.start()
        yield sender, loop, ended
    finally:  # the loop ends (its next tick says so) before its socket closes under it
        duty.ticks, duty.every = 0, 0.01
        sender.send(_beat(pid=99, initial=99))  # wakes a loop that waits for no deadline
        ended.wait(30)
        sender.close()
        sock.close(unlink=False)


def test_the_beat_loop_tells_a_silence_at_its_deadline_and_ticks_until_its_duty_ends() -> None:
    duty = _Told(ticks=3)
    with _running(duty) as (sender, _loop, ended):
        assert sender.send(_beat(pid=5, timeout=0.2))
        # no beat comes after it and no tick is due: the loop wakes for the deadline
        wait_until("the silence told", lambda: ("silent", 5) in duty.told, 30)
        assert duty.told == [("beat", 5), ("silent", 5)] and not ended.is_set()
        duty.every = 0.05
        assert sender.send(_beat(pid=6))  # the loop reads the interval again after a look
        assert ended.wait(30), duty.told  # the third tick ends it
        ticks = [t for kind, t in duty.told if kind == "tick"]
        assert len(ticks) == 3 and ticks[2] - ticks[0] >= 2 * 0.05
        assert ("beat", 6) in duty.told and duty.told.count(("silent", 5)) == 1


class _Stalls(_Told):
    """A duty whose ticks stop the ranks' monitors (``paused``), then, once the loop read
    what they had sent (``DRAIN_S`` later), stall ``stall_s`` (a suspended job: the agent
    and the monitors stopped alike), after which the monitors go on."""

    DRAIN_S = 0.1

    def __init__(self, stall_s: float) -> None:
        super().__init__(ticks=1_000_000)
        self.stall_s, self.stalled = stall_s, threading.Event()
        self.paused, self.resumed = threading.Event(), threading.Event()
        self._paused_at: float | None = None

    def tick(self, now: float) -> bool:
        if self._paused_at is None:
            self._paused_at = now
            self.paused.set()
        elif not self.stalled.is_set() and now - self._paused_at >= self.DRAIN_S:
            self.stalled.set()
            time.sleep(self.stall_s)  # noqa: TID251 - the stall itself is what is tested
            self.paused.clear()
            self.resumed.set()
        return super().tick(now)


def test_a_beat_loop_that_stalled_longer_than_a_timeout_does_not_find_its_ranks_silent() -> None:
    """The loop stalls 3 timeouts while the rank's monitor is stopped with it (a suspended
    job): at the first look after it, the rank, which beats again as soon as it resumes,
    is not found silent (before, it was, and taken out); one that stays silent after the
    stall is, a timeout later."""
    duty = _Stalls(stall_s=3.0)
    with _running(duty) as (sender, _loop, _ended):
        beating = threading.Event()

        def monitor() -> None:  # pid 5's monitor: beats every 0.05 s unless stopped
            while not beating.is_set():
                if not duty.paused.is_set():
                    sender.send(_beat(pid=5, timeout=1.0))
                beating.wait(0.05)

        assert sender.send(_beat(pid=6, initial=2, timeout=1.0))
        thread = threading.Thread(target=monitor, daemon=True)
        thread.start()
        try:
            wait_until("pid 5 beating", lambda: ("beat", 5) in duty.told, 30)
            duty.every = 0.05  # the ticks begin: the pause, then the stall
            after = lambda: duty.resumed.is_set() and ("silent", 6) in duty.told  # noqa: E731
            wait_until("the stall, then pid 6's silence", after, 30)
            assert ("silent", 5) not in duty.told, duty.told
        finally:
            beating.set()
            thread.join()


class _CountsLooks(_Told):
    """A duty that counts the loop's looks (each tells ``received``, beats or none), and how
    many came before the first silence."""

    def __init__(self) -> None:
        super().__init__(ticks=1)
        self.looks, self.looks_before_silence = 0, 0

    def received(self, beats: list[Beat], new: NewPids, now: float) -> None:
        self.looks += 1
        super().received(beats, new, now)

    def silent(self, silence: Silence, now: float) -> None:
        self.looks_before_silence = self.looks_before_silence or self.looks
        super().silent(silence, now)


def test_a_beat_loop_without_ticks_looks_at_least_every_quarter_timeout() -> None:
    """With no tick (an agent under a supervisor, whose ring beats in a thread of its own)
    the loop still looks every quarter of the shortest timeout it watches, not only at the
    deadline: so how late a look comes says how long the agent did not look (before, it
    slept until the deadline, and a suspension shorter than a timeout and a half went
    unnoticed)."""
    duty = _CountsLooks()
    with _running(duty) as (sender, _loop, _ended):
        assert sender.send(_beat(pid=5, timeout=2.0))
        wait_until("pid 5's silence", lambda: ("silent", 5) in duty.told, 30)
        assert duty.looks_before_silence >= 3, duty.looks_before_silence  # its beat's, then every 0.5 s


class _Failing(_Told):
    """A duty whose first ``received`` and every ``silent`` of pid 5 raise."""

    def __init__(self, ticks: int) -> None:
        super().__init__(ticks)
        self.raised: list[str] = []

    def received(self, beats: list[Beat], new: NewPids, now: float) -> None:
        if not self.raised:
            self.raised.append("received")
            raise RuntimeError("a fault in the duty's received")
        super().received(beats, new, now)

    def silent(self, silence: Silence, now: float) -> None:
        if silence.beat.pid == 5:
            self.raised.append("silent")
            raise RuntimeError("a fault in the duty's silent")
        super().silent(silence, now)


def test_a_duty_that_raises_loses_no_silence_and_the_loop_goes_on(caplog) -> None:
    duty = _Failing(ticks=2)
    with _running(duty) as (sender, loop, ended):
        # pid 5's received raises: the table has its beat all the same, and its silence
        # comes (its silent raises too); pid 6's silence after it is told
        assert sender.send(_beat(pid=5, timeout=0.2))
        wait_until("pid 5's silence", lambda: duty.raised == ["received", "silent"], 30)
        assert sender.send(_beat(pid=6, initial=2, timeout=0.2))
        wait_until("pid 6's silence told", lambda: ("silent", 6) in duty.told, 30)
        assert duty.told == [("beat", 6), ("silent", 6)] and loop.failures == 2
        duty.every = 0.05
        assert sender.send(_beat(pid=7, initial=3))
        assert ended.wait(30), duty.told  # the loop ticks on, until its duty ends it
        text = caplog.text
        assert "received failed; its loop goes on" in text and "a fault in the duty's received" in text
        assert "silent failed; its loop goes on" in text


class _TickFails(_Told):
    def tick(self, now: float) -> bool:
        raise RuntimeError("a fault in the duty's tick")


def test_a_tick_that_raises_ends_the_loop_with_it() -> None:
    """The agent ends with it (the node agent's ``main`` logs it): one that went on would
    never ask ``finished``, and kept its host's address for good."""
    sock = BeatSocket(f"\0nvrx-test-loop-{uuid.uuid4().hex}")
    duty = _TickFails(ticks=1)
    duty.every = 0.01
    try:
        with pytest.raises(RuntimeError, match="tick"):
            BeatLoop(sock, duty).run()
    finally:
        sock.close(unlink=False)
