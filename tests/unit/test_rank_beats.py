"""Heartbeats of a node's Wrapper ranks to their supervisor (``nvrx.rank_beats``,
``RankBeats``): the wire, and who is declared silent when."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

import pytest

from nvrx.rank_beats import Beat, BeatSender, BeatSocket, RankBeats
from nvrx.supervisor.config import SupervisorConfig, local_job
from nvrx.supervisor.course import Course, CourseTracker
from nvrx.supervisor.hang_watch import HangWatch
from nvrx.supervisor.job_store import JobStore
from nvrx.supervisor.local_ranks import LocalRanks
from nvrx.supervisor.step_times import StepTimes
from nvrx.supervisor.store_link import StoreLinkError


def _beat(initial: int = 1, pid: int = 100, *, local_rank: int = 1, attempt: int = 0, **kw) -> Beat:
    fields = dict(rank=initial, world_size=4, round=3, interval=0.5, timeout=10.0)
    fields.update(kw)
    return Beat(initial, pid, local_rank, attempt, **fields)


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


def test_a_rank_is_declared_once_when_its_timeout_passes() -> None:
    beats = RankBeats()
    beats.record([_beat()], now=100.0)
    assert beats.next_deadline() == 110.0  # its heartbeat timeout (10 s)
    assert beats.due(109.0) == []
    beats.record([_beat()], now=105.0)  # a beat pushes the deadline
    assert beats.due(114.0) == []
    (silence,) = beats.due(115.5)
    assert silence.beat == _beat() and silence.silent_s == pytest.approx(10.5)
    assert beats.due(200.0) == []  # named once
    beats.record([_beat(round=4)], now=201.0)  # it beats again in a new round: watched again
    assert [s.beat.round for s in beats.due(212.0)] == [4]


def test_a_bye_or_an_ended_child_is_no_silence() -> None:
    beats = RankBeats()
    beats.record([_beat(1, 100, local_rank=1), _beat(2, 200, local_rank=2)], now=0.0)
    beats.record([_beat(1, 100, local_rank=1, bye=True)], now=1.0)
    beats.sync({2: 1})  # local rank 2 runs its attempt 1 now: attempt 0 ended
    assert beats.due(100.0) == []
    beats.record([_beat(2, 200, local_rank=2)], now=2.0)  # queued before attempt 0 ended
    assert beats.due(100.0) == []
    beats.record([_beat(2, 300, local_rank=2, attempt=1)], now=3.0)  # its replacement
    assert [s.beat.pid for s in beats.due(100.0)] == [300]


class _Node:
    """The supervisor as ``HangWatch`` sees it (its ``NodeControl``), with one running child."""

    def __init__(self, link: Any) -> None:
        child = SimpleNamespace(local_rank=1, attempt=0, running=True, pid=5)
        child.signal_group = lambda signum: None
        self.calls: list[str] = []
        store = JobStore(SupervisorConfig(command=["train"], job=local_job(nproc_per_node=4)))
        store.link = link
        ranks = LocalRanks(store, spawn=None, emit=self.emit)
        ranks.children[1] = child
        course = CourseTracker()
        course.to(Course.TRAINING)
        self.hangs = HangWatch(
            store, course, self, ranks, RankBeats(), workload=None,
            job_restart=SimpleNamespace(pending=None), store_lost=self._store_lost,
            step_times=StepTimes(store, course, self),
        )  # fmt: skip
        self.hangs.start()
        self.beats, self.beat_socket = self.hangs.beats, self.hangs.beat_socket

    def emit(self, kind: str, **fields: Any) -> None:
        pass

    def _store_lost(self, detail: str) -> bool:
        self.calls.append("lost")
        return True

    def store_unavailable(self, exc: Exception) -> None:
        self.calls.append("unavailable")


def test_a_lost_store_link_does_not_spin_the_supervisor_loop() -> None:
    sup = _Node(SimpleNamespace(lost="store agent exited"))
    try:
        sup.beats.record([_beat()], now=time.monotonic() - 1.0)
        sup.hangs.check()
        assert sup.hangs.timeout(None) > 1.0  # the next deadline is the rank's timeout
    finally:
        sup.hangs.close()


def test_a_store_lost_while_a_silent_rank_is_taken_out_is_failed_over() -> None:
    def leave_silent(*args: Any) -> None:
        link.lost = "the store did not answer"
        raise StoreLinkError("lost during leave_silent")

    link = SimpleNamespace(lost=None, leave_silent=leave_silent)
    sup = _Node(link)
    try:
        sup.beats.record([_beat(pid=5)], now=time.monotonic() - 11.0)  # silent beyond 10 s
        sup.hangs.check()
        assert sup.calls == ["lost"]  # a failover, not a stop of the job
    finally:
        sup.hangs.close()


def test_beats_cost_the_store_nothing() -> None:
    """Only a silence reaches the store: a node of beating ranks adds no request to it."""
    requests: list[str] = []
    link = SimpleNamespace(
        lost=None,
        add=lambda *a: requests.append("add"),
        leave_silent=lambda *a: requests.append("leave_silent"),
    )
    sup = _Node(link)
    try:
        for _ in range(5):
            sup.beats.record([_beat(pid=5)], now=time.monotonic())
            sup.hangs.check()
        assert requests == []
    finally:
        sup.hangs.close()


def test_beats_that_came_while_the_loop_was_busy_are_read_before_any_silence() -> None:
    left = []
    link = SimpleNamespace(lost=None, leave_silent=lambda *a: left.append(a))
    sup = _Node(link)
    sender = BeatSender(sup.beat_socket.path)
    try:
        sup.beats.record([_beat(pid=5)], now=time.monotonic() - 11.0)  # read long ago
        assert sender.send(_beat(pid=5))  # it beat while the supervisor was blocked elsewhere
        sup.hangs.check()
        assert left == [] and sup.calls == []
    finally:
        sender.close()
        sup.hangs.close()


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
