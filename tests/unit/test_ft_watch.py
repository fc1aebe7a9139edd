"""The client and the supervisor's ``RankWatch`` over a real socket, in one process:
what each message does to the deadlines, the stack request, computed and restored timeouts."""

from __future__ import annotations

import os
import select
import socket
import time

import pytest

from nvrx import jobenv
from nvrx.fault_tolerance import (
    FaultToleranceConfig,
    RankMonitorClient,
    RankMonitorClientError,
)
from nvrx.fault_tolerance import client as client_module
from nvrx.supervisor.rank_watch import RankWatch


@pytest.fixture
def watch(monkeypatch):
    w = RankWatch()
    monkeypatch.setenv(jobenv.FT_SOCKET, w.path)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv(jobenv.RESTART_COUNT, "2")
    yield w
    w.close()


def _config(monkeypatch, **settings):
    monkeypatch.setenv(jobenv.FT_CONFIG, FaultToleranceConfig(**settings).to_json())


def _connect(watch, client):
    client.init_workload_monitoring()
    fd = watch.accept()
    assert fd is not None
    told = watch.read(fd, now=100.0)
    assert [t[0] for t in told] == ["init"]
    return fd, told[0][1]


def test_outside_a_supervisor_the_client_says_so(monkeypatch):
    monkeypatch.delenv(jobenv.FT_SOCKET, raising=False)
    client = RankMonitorClient()
    with pytest.raises(RankMonitorClientError, match="start the script with nvrx-supervise"):
        client.init_workload_monitoring()
    with pytest.raises(RankMonitorClientError, match="call init_workload_monitoring"):
        client.send_heartbeat()
    monkeypatch.setenv(jobenv.FT_SOCKET, "/nonexistent/nvrx.sock")
    with pytest.raises(RankMonitorClientError, match="cannot reach the supervisor at /nonexistent"):
        client.init_workload_monitoring()


def test_heartbeat_deadlines(watch, monkeypatch):
    _config(monkeypatch, initial_rank_heartbeat_timeout=10, rank_heartbeat_timeout=2)
    client = RankMonitorClient()
    fd, w = _connect(watch, client)
    assert (w.local_rank, w.rank, w.attempt) == (1, 5, 2)
    assert watch.next_deadline() == 110.0  # the initial timeout runs from init
    assert watch.due(109.9) == []
    client.send_heartbeat()
    watch.read(fd, now=103.0)
    assert watch.next_deadline() == 105.0  # then the one between heartbeats
    [hang] = watch.due(105.5)
    assert (hang.local_rank, hang.rank, hang.timeout, hang.limit_s) == (1, 5, "heartbeat", 2)
    assert hang.stale_s == pytest.approx(2.5)
    assert watch.due(200.0) == [] and watch.next_deadline() is None  # declared once
    client.shutdown_workload_monitoring()
    assert [t[0] for t in watch.read(fd)] == ["end"]
    assert watch.connection_fds() == []


def test_the_hello_names_the_local_rank_the_supervisor_knows_the_child_by(watch, monkeypatch):
    """Under ``fork_and_monitor`` ``LOCAL_RANK`` is the launcher's (3) while the monitor has
    one child, 0: the hello says 0, so that the monitor finds the child its hangs are of."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv(jobenv.SUPERVISOR_LOCAL_RANK, "0")
    _config(monkeypatch, initial_rank_heartbeat_timeout=10)
    client = RankMonitorClient()
    fd, w = _connect(watch, client)
    assert (w.local_rank, w.rank, w.attempt) == (0, 5, 2)
    client.shutdown_workload_monitoring()
    watch.read(fd)


def test_section_and_out_of_section_deadlines(watch, monkeypatch):
    _config(monkeypatch, rank_section_timeouts={"step": 3, "io": None}, rank_out_of_section_timeout=20)
    client = RankMonitorClient()
    fd, _ = _connect(watch, client)
    assert watch.next_deadline() == 120.0  # outside every section since init
    client.start_section("step")
    watch.read(fd, now=101.0)
    assert watch.next_deadline() == 104.0
    client.start_section("io")  # no timeout of its own
    watch.read(fd, now=102.0)
    client.end_section("step")
    watch.read(fd, now=103.0)
    assert watch.next_deadline() is None  # inside "io": neither runs
    client.end_all_sections()
    watch.read(fd, now=110.0)
    assert watch.next_deadline() == 130.0
    client.start_section("step")
    watch.read(fd, now=111.0)
    [hang] = watch.due(114.5)
    assert (hang.timeout, hang.section, hang.limit_s) == ("section", "step", 3)
    with pytest.raises(RankMonitorClientError, match="open already"):
        client.start_section("step")
    with pytest.raises(RankMonitorClientError, match="not open"):
        client.end_section("io")
    client.shutdown_workload_monitoring()


def test_the_stack_of_a_monitored_process(watch, monkeypatch):
    _config(monkeypatch, rank_heartbeat_timeout=1)
    client = RankMonitorClient()
    fd, _ = _connect(watch, client)
    client.send_heartbeat()
    watch.read(fd, now=100.0)
    [hang] = watch.due(102.0)
    stack = watch.stack(hang)  # this very process: faulthandler answers from its signal handler
    assert stack is not None and "test_the_stack_of_a_monitored_process" in stack, stack
    client.shutdown_workload_monitoring()


def test_computed_timeouts_reach_the_watch_and_survive_a_restart(watch, monkeypatch):
    _config(monkeypatch, safety_factor=2, rank_section_timeouts={"step": 50})
    client = RankMonitorClient()
    fd, w = _connect(watch, client)
    assert not client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
    with pytest.raises(RankMonitorClientError, match="at least two heartbeats"):
        client.calculate_and_set_hb_timeouts()
    for _ in range(3):
        client.send_heartbeat()
    client.start_section("step")
    client.end_section("step")
    assert client.calculate_and_set_hb_timeouts()
    assert client.calculate_and_set_section_timeouts()
    told = watch.read(fd)
    assert [t[0] for t in told if t[0] == "timeouts"] == ["timeouts", "timeouts"]
    t = client.timeouts
    assert w.timeouts == t  # the supervisor checks what the client computed
    assert t.heartbeat is not None and t.heartbeat < 1  # twice a gap of microseconds
    assert t.sections["step"] < 1 and t.out_of_section is not None
    assert set(t.computed) == {"initial_heartbeat", "heartbeat", "section:step", "out_of_section"}
    saved = client.state_dict()
    # NVRx's checkpoint entry and views of the timeouts in force
    assert set(saved) == {"current_timeouts"} and set(saved["current_timeouts"]) == {"heartbeat", "section"}
    assert saved["current_timeouts"]["section"]["calculated_sections"] == ["step"]
    assert client.is_initialized and client.hb_timeouts.were_calculated
    assert (client.hb_timeouts.initial, client.hb_timeouts.subsequent) == (t.initial_heartbeat, t.heartbeat)
    assert client.section_timeouts.were_calculated and client.section_timeouts.section == {"step": t.sections["step"]}
    client.shutdown_workload_monitoring()
    assert not client.is_initialized
    watch.read(fd)

    # A new process (a restart) loads the checkpoint before init: those timeouts are in force.
    again = RankMonitorClient()
    again.load_state_dict(saved)
    fd2, w2 = _connect(watch, again)
    assert w2.timeouts == t
    assert again.timeouts == t
    # a second computation is averaged with the computed value in force
    again.send_heartbeat()
    again.send_heartbeat()
    before = again.timeouts.heartbeat
    again.calculate_and_set_hb_timeouts()
    gap = again._obs.max_heartbeat_gap_s * 2
    assert again.timeouts.heartbeat == pytest.approx((before + gap) / 2)
    with pytest.raises(RankMonitorClientError, match="expected what state_dict"):
        again.load_state_dict({"nope": 1})
    again.load_state_dict({})  # nothing saved yet: nothing changes
    again.shutdown_workload_monitoring()


def test_a_restart_takes_the_computed_timeouts_from_the_checkpoint_and_the_rest_from_its_config(watch, monkeypatch):
    """Only ``step`` was computed; the job restarts with longer configured timeouts for the
    rest: those are in force (before: the checkpoint's copies of the old configuration)."""
    _config(monkeypatch, rank_section_timeouts={"step": 60, "checkpoint": 600}, rank_out_of_section_timeout=30)
    client = RankMonitorClient()
    _connect(watch, client)
    client.start_section("step")
    client.end_section("step")
    client.calculate_and_set_section_timeouts(selected_sections=["step"], calc_out_of_section=False)
    computed = client.timeouts.sections["step"]
    saved = client.state_dict()
    client.shutdown_workload_monitoring()
    _config(monkeypatch, rank_section_timeouts={"step": 60, "checkpoint": 1200}, rank_out_of_section_timeout=100)
    again = RankMonitorClient()
    again.load_state_dict(saved)
    _, w = _connect(watch, again)
    assert w.timeouts.sections == {"step": computed, "checkpoint": 1200}
    assert (w.timeouts.out_of_section, w.timeouts.computed) == (100, ["section:step"])
    again.shutdown_workload_monitoring()


def test_a_checkpoint_of_an_earlier_nvrx_restores_only_what_was_computed(watch, monkeypatch):
    """nvrx < 0.5 saved every timeout in force (``{"timeouts": ...}``): only the computed ones
    are put back, the restarted process's configuration gives the rest."""
    _config(monkeypatch, rank_section_timeouts={"step": 60, "checkpoint": 1200}, rank_out_of_section_timeout=100)
    client = RankMonitorClient()
    old = {"sections": {"step": 0.5, "checkpoint": 600.0}, "out_of_section": 30.0, "heartbeat": 9.0,
           "computed": ["section:step"]}  # fmt: skip
    client.load_state_dict({"timeouts": old})
    _, w = _connect(watch, client)
    assert (w.timeouts.sections, w.timeouts.out_of_section, w.timeouts.heartbeat) == (
        {"step": 0.5, "checkpoint": 1200}, 100, None,
    )  # fmt: skip
    client.shutdown_workload_monitoring()


def test_an_nvrx_checkpoint_of_heartbeat_timeouts_never_computed_restores_none(watch, monkeypatch):
    """NVRx's entry may hold the heartbeat pair uncomputed (``were_calculated`` false): the
    restarted process's configured ones stay in force."""
    _config(monkeypatch, initial_rank_heartbeat_timeout=120, rank_heartbeat_timeout=60)
    client = RankMonitorClient()
    pair = {"initial": 9.0, "subsequent": 3.0, "were_calculated": False}
    client.load_state_dict({"current_timeouts": {"heartbeat": pair}})
    _, w = _connect(watch, client)
    assert (w.timeouts.initial_heartbeat, w.timeouts.heartbeat) == (120, 60)
    client.shutdown_workload_monitoring()


def test_a_checkpoint_of_an_earlier_nvrx_still_loads():
    client = RankMonitorClient()
    assert client.hb_timeouts is None and client.section_timeouts is None and not client.is_initialized
    assert client.state_dict() == {"current_timeouts": {}}
    client.load_state_dict({"timeouts": {"heartbeat": 3.0, "computed": ["heartbeat"]}})
    assert client.state_dict() == {"current_timeouts": {}}  # a heartbeat timeout alone: not NVRx's pair
    client.load_state_dict({"timeouts": None})
    client.load_state_dict(
        {"timeouts": {"initial_heartbeat": 9.0, "heartbeat": 3.0, "computed": ["initial_heartbeat", "heartbeat"]}}
    )
    saved = client.state_dict()["current_timeouts"]
    assert saved == {"heartbeat": {"initial": 9.0, "subsequent": 3.0, "were_calculated": True}}


def test_a_long_tmpdir_still_gives_a_usable_socket(tmp_path, monkeypatch):
    long_dir = tmp_path / ("d" * 60) / ("e" * 60)
    long_dir.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(long_dir))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read $TMPDIR
    watch = RankWatch()
    try:
        assert len(watch.path) <= 107 and watch.path.startswith("/tmp/nvrx-ft-")
        monkeypatch.setenv(jobenv.FT_SOCKET, watch.path)
        client = RankMonitorClient()
        client.init_workload_monitoring()
        assert watch.accept() is not None
        client.shutdown_workload_monitoring()
    finally:
        watch.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another user needs root")
def test_a_peer_of_another_user_is_refused_even_when_it_reaches_the_socket(watch):
    os.chmod(watch.directory, 0o755)  # open the way, as a careless setup would
    os.chmod(watch.path, 0o777)
    pid = os.fork()
    if pid == 0:  # the other user: connects, then waits until the supervisor closes it
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            peer.connect(watch.path)
            peer.settimeout(30)
            code = 0 if peer.recv(1) == b"" else 2
        finally:
            os._exit(code)
    try:
        assert select.select([watch.fileno()], [], [], 30)[0], "the other user never connected"
        assert watch.accept() is None  # refused, not watched
        assert watch.watched == {}
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # its connection was closed
    mine = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mine.connect(watch.path)
    assert watch.accept() is not None  # this user's own peer is taken
    mine.close()


def test_step_times_reach_the_watch_in_batches_and_a_timed_section_gives_its_durations(
    watch, monkeypatch
):
    from nvrx.fault_tolerance import client as client_module

    client = RankMonitorClient()
    fd, _ = _connect(watch, client)
    monkeypatch.setattr(client_module, "STEP_PACKET_INTERVAL_S", 3600.0)
    client.record_step(0.5)  # the first goes at once, then they wait for the interval
    for seconds in (0.1, 0.2, 0.3):
        client.record_step(seconds)
    with client.timed_step():
        pass
    assert [(t[0], t[2]) for t in watch.read(fd)] == [("steps", [0.5])]
    client.shutdown_workload_monitoring()  # sends what is kept
    told = watch.read(fd)
    assert [t[0] for t in told] == ["steps", "end"]
    assert told[0][2][:3] == [0.1, 0.2, 0.3] and 0 <= told[0][2][3] < 1.0
    with pytest.raises(RankMonitorClientError, match="record_step: call init_workload_monitoring"):
        client.record_step(0.1)



def test_the_straggler_section_is_timed_by_the_rank_itself(watch, monkeypatch):
    import time

    monkeypatch.setenv(jobenv.STRAGGLER_SECTION, "compute")
    client = RankMonitorClient()
    fd, _ = _connect(watch, client)
    before = time.monotonic()
    client.start_section("compute")
    client.end_section("compute")
    after = time.monotonic()
    client.start_section("other")  # not the straggler section: no step time
    client.end_section("other")
    steps = [t[2] for t in watch.read(fd, now=before + 500.0) if t[0] == "steps"]
    assert len(steps) == 1 and len(steps[0]) == 1, steps
    assert 0 <= steps[0][0] <= after - before  # the rank's time, whenever the supervisor reads it


def test_bad_step_times_are_refused_by_the_client_and_ignored_by_the_watch(watch):
    client = RankMonitorClient()
    fd, _ = _connect(watch, client)
    with pytest.raises(ValueError, match="seconds must be a finite number ≥ 0, got -1"):
        client.record_step(-1)
    with pytest.raises(ValueError, match="got inf"):
        client.record_step(float("inf"))
    for bad in (b"T [-1.0]", b'T ["x"]', b'T {"a": 1}', b"T [true]"):
        client._sock.send(bad)  # what a broken rank could send
    assert watch.read(fd) == []


def test_malformed_hellos_and_timeouts_are_ignored_not_fatal(watch):
    """What a broken rank could send: a hello that is no object, timeouts of the wrong types.
    The supervisor's watch logs and ignores each (before: AttributeError or, at the next
    deadline, TypeError, which ended the supervisor); a good hello after them is taken."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(watch.path)
    fd = watch.accept()
    for bad in (b"init 5", b"init null", b'init ["x"]'):
        sock.send(bad)
        assert watch.read(fd, now=100.0) == [] and watch.next_deadline() is None
        r, w = os.pipe()  # as the real client sends its hello: with its stack pipe
        socket.send_fds(sock, [bad], [r])
        os.close(r)
        assert watch.read(fd, now=100.0) == [] and watch.next_deadline() is None
        os.close(w)
    sock.send(b"init " + b"[" * 5000)  # past the JSON parser's depth: RecursionError, not ValueError
    assert watch.read(fd, now=100.0) == [] and watch.next_deadline() is None
    sock.send(b'init {"local_rank": 0, "timeouts": {"heartbeat": 2}}')
    assert [t[0] for t in watch.read(fd, now=100.0)] == ["init"]
    sock.send(b"h")
    for bad in (b't {"timeouts": {"heartbeat": "30"}}', b't {"timeouts": {"sections": [1]}}',
                b't {"timeouts": {"sections": {"step": -1}}}', b't {"timeouts": {"computed": 3}}',
                b"t [1]", b't {"timeouts": 7}'):  # fmt: skip
        sock.send(bad)
        assert watch.read(fd, now=100.0) == [] and watch.next_deadline() == 102.0, bad
    [hang] = watch.due(103.0)
    assert (hang.local_rank, hang.timeout, hang.limit_s) == (0, "heartbeat", 2)
    sock.close()


def test_a_peer_outside_the_supervisors_pid_namespace_has_no_pid_to_signal(watch):
    """SO_PEERCRED gives 0 for a peer whose pid this namespace cannot see: no pid, so no
    stack request (``os.kill(0, ...)`` would signal the supervisor's own group)."""
    import dataclasses

    from nvrx.supervisor.rank_watch import Hang, Watched

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        peer = Watched(sock, peer_pid=0)
        assert watch._init(peer, {"local_rank": 0, "pid": 4321}, [], 1.0) and peer.pid is None
        hang = Hang(0, 0, 0, 0, "heartbeat", None, 1.0, 2.0)
        watch.watched[-1] = dataclasses.replace(peer, pid=0, stack_fd=-1)
        assert watch.stack(hang) is None
        del watch.watched[-1]


def _raw_rank(watch) -> tuple[socket.socket, int]:
    """A rank's connection, packets written by hand: its hello (a heartbeat timeout of 1 s)
    sent, not read yet."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(watch.path)
    fd = watch.accept()
    sock.send(b'init {"local_rank": 0, "pid": 1, "timeouts": {"heartbeat": 1}}')
    return sock, fd


def test_a_rank_whose_heartbeats_wait_unread_is_not_declared_hung(watch):
    """The supervisor was busy past a rank's heartbeat timeout while the rank beat on: its
    beats wait in the socket. It is judged after they are read, not before."""
    sock, fd = _raw_rank(watch)
    watch.read(fd, now=100.0)
    sock.send(b"h")
    watch.read(fd, now=100.0)
    sock.send(b"h")  # sent at 101.5, unread at 102
    assert watch.due(102.0) == []
    watch.read(fd, now=102.0)
    assert watch.due(102.5) == []
    assert [h.timeout for h in watch.due(103.5)] == ["heartbeat"]  # silent since its last beat
    sock.close()


def test_a_rank_that_sends_all_but_heartbeats_is_put_off_once_not_for_ever(watch):
    """A rank past its heartbeat timeout whose other packets (step times, sections) keep
    coming while the supervisor is busy: its deadline is put off once, for the loop to read
    what waits; at the next look it is declared hung, packets waiting or not."""
    sock, fd = _raw_rank(watch)
    sock.send(b"h")
    watch.read(fd, now=100.0)
    sock.send(b"T [0.5]")
    assert watch.due(102.0) == []  # put off: what waits might have been a heartbeat
    watch.read(fd, now=102.0)  # step times, no heartbeat
    sock.send(b"T [0.5]")  # and more, before the next look
    assert [h.timeout for h in watch.due(102.5)] == ["heartbeat"]
    sock.close()


def test_a_hang_names_the_pid_that_connected_not_the_one_a_rank_reports(watch):
    """A rank in another pid namespace reports a pid that means another process here: the
    stack request and the hang go to the process the kernel says connected."""
    sock, fd = _raw_rank(watch)
    watch.read(fd, now=100.0)
    sock.send(b"h")
    watch.read(fd, now=100.0)
    [hang] = watch.due(102.0)
    assert hang.pid == os.getpid()
    sock.close()


def test_a_section_change_waits_for_a_supervisor_that_reads_again_within_the_wait(watch, monkeypatch):
    """The channel is full, and the supervisor reads while the rank waits for room: the
    change goes out then, nothing is held back (held back at once, a change before a long
    quiet stretch would not be seen until the rank sent something else)."""
    client = RankMonitorClient()
    fd, w = _connect(watch, client)
    while True:  # fill the channel
        try:
            client._sock.send(b"h", socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
    real_select = select.select

    def the_supervisor_reads_meanwhile(r, w_, x, timeout):
        watch.read(fd, now=150.0)
        return real_select(r, w_, x, timeout)

    monkeypatch.setattr(client_module.select, "select", the_supervisor_reads_meanwhile)
    client.start_section("ckpt")
    monkeypatch.setattr(client_module.select, "select", real_select)
    watch.read(fd, now=151.0)
    assert not client._behind and w.open == {"ckpt": 151.0}
    client.shutdown_workload_monitoring()


def test_section_changes_wait_a_while_for_a_lagging_supervisor_then_it_learns_the_open_ones(
    watch, monkeypatch
):
    """The supervisor reads nothing (its loop is stuck) until the channel is full: a section
    change waits for room (``SEND_WAIT_S``, shortened here), then changes are held back
    without waiting (before: each waited, then was dropped, a dropped end making a false
    section hang). Once it reads again, the next packet tells it the sections open then."""
    monkeypatch.setattr(client_module, "SEND_WAIT_S", 0.05)
    client = RankMonitorClient()
    fd, w = _connect(watch, client)
    changes = 0
    while not client._behind:
        client.start_section("step")
        client.end_section("step")
        changes += 1
        assert changes < 100_000, "the channel never filled"
    client.start_section("eval")  # held back too
    watch.read(fd, now=200.0)  # the supervisor reads again: "eval" is not among what it got
    assert "eval" not in w.open
    client._next_packet = 0.0  # the next heartbeat goes out at once
    client.send_heartbeat()
    watch.read(fd, now=201.0)
    assert not client._behind and w.open.keys() == {"eval"} and w.last_heartbeat == 201.0
    assert 200.0 < w.open["eval"] <= 201.0  # since it began, not since the catch-up
    client.end_section("eval")
    watch.read(fd, now=202.0)
    assert w.open == {} and w.outside_since == 202.0
    client.shutdown_workload_monitoring()


def test_timeouts_and_requests_sent_while_the_supervisor_lags_reach_it_once_it_reads_again(
    watch, monkeypatch
):
    """The channel is full: computed timeouts and a workload-control request wait for room
    (``SEND_WAIT_S``, shortened here), then are held back, not dropped (before: the client
    said the timeouts were set and the request sent, and the supervisor never heard of
    them). Of two timeouts held back only the last goes out: it holds them all."""
    from nvrx.fault_tolerance.data import WorkloadAction, WorkloadControlRequest

    monkeypatch.setattr(client_module, "SEND_WAIT_S", 0.05)
    client = RankMonitorClient()
    fd, w = _connect(watch, client)
    for _ in range(3):
        client.send_heartbeat()
        client._next_packet = 0.0
    client.start_section("step")
    client.end_section("step")
    watch.read(fd, now=110.0)
    while True:  # fill the channel
        try:
            client._sock.send(b"h", socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
    assert client.calculate_and_set_hb_timeouts()
    assert client._behind
    assert client.calculate_and_set_section_timeouts()
    client.send_workload_control_request(WorkloadControlRequest(WorkloadAction.ExcludeThisNode, "bad disk"))
    watch.read(fd, now=200.0)  # the supervisor reads again: none of the three came yet
    assert w.timeouts != client.timeouts
    client._next_packet = 0.0
    client.send_heartbeat()  # the next packet: the sections, then what was held back
    told = watch.read(fd, now=201.0)
    assert [t[0] for t in told] == ["timeouts", "control"], told
    assert w.timeouts == client.timeouts and told[1][2]["action"] == "ExcludeThisNode"
    assert not client._behind
    client.shutdown_workload_monitoring()


def test_a_request_held_back_at_shutdown_goes_out_if_the_supervisor_reads_or_is_named_lost(
    watch, monkeypatch, caplog
):
    """ShutdownWorkload, then the end of monitoring, while the supervisor lags: the end waits
    (``SEND_WAIT_S``) for the request to go out. When the supervisor reads meanwhile it gets
    it; when it does not, an error names what was lost, and the next session of the client
    sends none of it."""
    from nvrx.fault_tolerance.data import WorkloadAction, WorkloadControlRequest

    monkeypatch.setattr(client_module, "SEND_WAIT_S", 0.05)
    request = WorkloadControlRequest(WorkloadAction.ShutdownWorkload, "done early")
    client = RankMonitorClient()
    fd, _w = _connect(watch, client)
    _fill(client)
    client.send_workload_control_request(request)  # held back
    assert client._behind
    real_select = select.select
    told = []

    def the_supervisor_reads_meanwhile(r, w_, x, timeout):
        told.extend(watch.read(fd))
        return real_select(r, w_, x, timeout)

    monkeypatch.setattr(client_module.select, "select", the_supervisor_reads_meanwhile)
    client.shutdown_workload_monitoring()
    monkeypatch.setattr(client_module.select, "select", real_select)
    told.extend(watch.read(fd))
    assert [t[0] for t in told if t[0] != "end"] == ["control"] and told[-1][0] == "end"

    fd, _w = _connect(watch, client)  # a new session; the supervisor lags again
    _fill(client)
    client.send_workload_control_request(request)
    with caplog.at_level("ERROR", logger="nvrx.fault_tolerance"):
        client.shutdown_workload_monitoring()
    assert "lost" in caplog.text and "ShutdownWorkload" in caplog.text
    watch.read(fd)  # the first session's heartbeats, its end
    client._lost = True  # as if the second session's socket had failed: a new one starts whole
    fd, _w = _connect(watch, client)  # a third session: nothing of the second replayed
    assert not client._lost
    client._next_packet = 0.0
    client.send_heartbeat()
    assert [t[0] for t in watch.read(fd)] == []
    client.shutdown_workload_monitoring()


def test_a_checkpoint_of_heartbeat_timeouts_loaded_after_init_keeps_the_computed_sections(watch, monkeypatch):
    """Section timeouts computed, then a checkpoint holding only heartbeat timeouts loaded:
    the sections stay computed, so ``state_dict`` keeps saving them (before: they stayed in
    force but were no longer saved, and were lost at the next restart)."""
    _config(monkeypatch, safety_factor=2, rank_section_timeouts={"step": 50})
    client = RankMonitorClient()
    fd, _w = _connect(watch, client)
    client.start_section("step")
    client.end_section("step")
    assert client.calculate_and_set_section_timeouts()
    hb_only = {"current_timeouts": {"heartbeat": {"initial": 30.0, "subsequent": 10.0, "were_calculated": True}}}
    client.load_state_dict(hb_only)
    saved = client.state_dict()["current_timeouts"]
    assert saved["section"]["calculated_sections"] == ["step"] and saved["heartbeat"]["subsequent"] == 10.0
    assert set(client.timeouts.computed) == {"section:step", "out_of_section", "initial_heartbeat", "heartbeat"}
    client.shutdown_workload_monitoring()
    watch.read(fd)


@pytest.mark.parametrize("name", ["", None, 7])
def test_a_section_with_no_name_is_refused_not_left_to_look_like_a_hang(watch, name):
    """The supervisor ignores a section with an empty name: the client would count it open
    and the supervisor would find the rank out of every section."""
    client = RankMonitorClient()
    _connect(watch, client)
    with pytest.raises(RankMonitorClientError, match="a section's name must be a non-empty string"):
        client.start_section(name)
    with pytest.raises(RankMonitorClientError, match="must be at most 1024 characters, got 1025"):
        client.start_section("x" * 1025)
    assert client._obs.open == {}
    client.shutdown_workload_monitoring()


def test_a_log_level_without_a_name_reaches_the_ranks_and_a_bad_config_is_the_clients_error(watch, monkeypatch):
    """``--ft-log-level 15``: the supervisor passed "Level 15", which every rank refused with
    a ValueError at its start. A configuration that does not parse is a RankMonitorClientError."""
    _config(monkeypatch, log_level=15)
    client = RankMonitorClient()
    _connect(watch, client)
    assert client.cfg.log_level == 15
    client.shutdown_workload_monitoring()
    monkeypatch.setenv(jobenv.FT_CONFIG, '{"log_level": "LOUD"}')
    with pytest.raises(RankMonitorClientError, match="NVRX_FT_CONFIG is no valid configuration"):
        RankMonitorClient().init_workload_monitoring()


def test_a_catch_up_after_a_lag_keeps_the_timers_the_supervisor_runs(watch, monkeypatch):
    """The supervisor read "step" open; it then lagged while the rank held changes back. The
    catch-up tells how long each open section has been (and how long outside every one):
    the supervisor's timers go on from when they began (before: they started again, and a
    hang was found as much later as the lag lasted)."""
    monkeypatch.setattr(client_module, "SEND_WAIT_S", 0.05)
    client = RankMonitorClient()
    fd, w = _connect(watch, client)
    client.start_section("step")
    watch.read(fd)
    began = client._obs.open["step"] = time.monotonic() - 30.0  # it began 30 s ago
    _fill(client)  # the supervisor lags: a nested section is held back
    client.start_section("inner")
    assert client._behind
    watch.read(fd)
    client._next_packet = 0.0
    client.send_heartbeat()  # the catch-up
    watch.read(fd)
    assert w.open.keys() == {"step", "inner"}
    assert abs(w.open["step"] - began) < 5.0  # not restarted at the catch-up
    client.end_section("inner")
    client.end_section("step")
    client._obs.outside_since = time.monotonic() - 20.0  # outside every section for 20 s
    _fill(client)
    client.start_section("late")
    client.end_section("late")  # held back: the supervisor learns it from the catch-up
    assert client._behind
    client._obs.outside_since = time.monotonic() - 20.0
    watch.read(fd)
    client._next_packet = 0.0
    client.send_heartbeat()
    watch.read(fd)
    assert w.open == {} and time.monotonic() - w.outside_since > 15.0
    client.shutdown_workload_monitoring()


def test_a_catch_up_too_big_for_one_packet_tells_the_sections_one_by_one(watch, monkeypatch):
    """70 sections open, each named with 1024 characters: their ages do not fit one packet
    (64 KiB). The catch-up then tells them one by one, their timers started again, rather
    than send a message the supervisor reads cut short (or a send that fails for good)."""
    monkeypatch.setattr(client_module, "SEND_WAIT_S", 0.05)
    client = RankMonitorClient()
    fd, w = _connect(watch, client)
    names = [f"{i:04d}" + "x" * 1020 for i in range(70)]
    for name in names:
        client.start_section(name)
        watch.read(fd)
    _fill(client)
    client.end_section(names[-1])  # held back
    assert client._behind
    watch.read(fd)
    client._next_packet = 0.0
    client.send_heartbeat()
    watch.read(fd)
    assert not client._behind and not client._lost
    assert set(w.open) == set(names[:-1])
    client.shutdown_workload_monitoring()


def _fill(client) -> None:
    """Fill the channel to its supervisor with heartbeats until it takes no more."""
    while True:
        try:
            client._sock.send(b"h", socket.MSG_DONTWAIT)
        except BlockingIOError:
            return


def test_timing_on_the_gpu_without_cuda_says_what_to_use(watch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: tests/multiproc/test_gpu_paths.py times on it")
    client = RankMonitorClient()
    _connect(watch, client)
    with pytest.raises(RankMonitorClientError, match=r"CUDA is not available here; use timed_step\(\)"):
        with client.timed_step(cuda=True):
            pass


def test_directories_of_killed_supervisors_are_swept_and_live_or_young_ones_kept(tmp_path, monkeypatch):
    """A supervisor killed with SIGKILL leaves its private directory (sockets, a copy of the
    job's secret); the next one on the host removes it once nobody listens there."""
    from nvrx.supervisor import rank_watch

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(rank_watch.tempfile, "tempdir", None)  # TMPDIR read again
    live = RankWatch()  # a running supervisor's
    dead = tmp_path / f"{rank_watch.PREFIX}killed"
    dead.mkdir(mode=0o700)
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    bound.bind(str(dead / "supervisor.sock"))
    bound.close()  # its process is gone: the file stays, nobody listens
    (dead / "secret").write_text("00" * 32)
    young = tmp_path / f"{rank_watch.PREFIX}starting"
    young.mkdir(mode=0o700)  # just made: its supervisor binds next
    other = tmp_path / "not-ours"
    other.mkdir()
    old = rank_watch.time.time() - 2 * rank_watch.SWEEP_AFTER_S
    for d in (dead, os.path.dirname(live.path)):
        os.utime(d, (old, old))
    try:
        assert rank_watch.sweep_abandoned(str(tmp_path)) == [str(dead)]
        assert os.path.exists(live.path) and young.exists() and other.exists()
    finally:
        live.close()


def test_the_stack_of_a_process_that_holds_the_gil(watch, monkeypatch):
    """docs/fault_tolerance.md: the stack comes from ``faulthandler``'s signal handler, which
    needs no GIL: a rank stuck in C code that holds it (a builtin's loop) still tells where."""
    import subprocess
    import sys
    import textwrap

    _config(monkeypatch, rank_heartbeat_timeout=1)
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            from nvrx.fault_tolerance import RankMonitorClient
            client = RankMonitorClient()
            client.init_workload_monitoring()
            client.send_heartbeat()
            def hold_the_gil():
                print("holding", flush=True)
                return sum(range(10**15))  # C code: the GIL is never released
            hold_the_gil()
        """)],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ),
    )  # fmt: skip
    try:
        assert select.select([watch], [], [], 60)[0], "the child never connected"
        fd = watch.accept()
        assert fd is not None
        assert child.stdout is not None and child.stdout.readline() == "holding\n"
        told = watch.read(fd, now=100.0)
        assert [t[0] for t in told][:1] == ["init"], told
        [hang] = watch.due(1000.0)
        stack = watch.stack(hang)
        assert stack is not None and "in hold_the_gil" in stack, stack
    finally:
        child.kill()
        child.wait()


def _heartbeats_received(watch, client, seconds: float) -> tuple[list[tuple[float, float]], float]:
    """``send_heartbeat()`` in a tight loop for ``seconds`` (and 3 packets); for each call whose packet the
    watch received, the monotonic times right before and after the call (the client's own
    reading of the clock lies between), and the loop's duration."""
    import time

    fd, _ = _connect(watch, client)
    watched = watch.watched[fd]
    received = []
    start = time.monotonic()
    while (before := time.monotonic()) - start < seconds or len(received) < 3:  # a stall
        assert before - start < 60, f"{len(received)} heartbeats reached the watch in 60 s"
        client.send_heartbeat()
        after = time.monotonic()
        watch.read(fd, now=before)  # a packet sent by this call is waiting already: stamped `before`
        if watched.last_heartbeat == before:
            received.append((before, after))
    duration = time.monotonic() - start
    client.shutdown_workload_monitoring()
    return received, duration


@pytest.mark.parametrize(
    ("heartbeat_timeout", "interval", "other"),
    [(30.0, 0.1, 30.0 / 50), (1.0, 1.0 / 50, 0.1)],
    ids=["0.1s", "a-50th-of-the-timeout"],
)
def test_heartbeats_reach_the_supervisor_at_most_every_0_1_s_or_a_50th_of_the_heartbeat_timeout(
    watch, monkeypatch, heartbeat_timeout, interval, other
):
    """docs/fault_tolerance.md: heartbeats are counted in the rank and sent at most every 0.1 s,
    or 1/50 of the heartbeat timeout when that is shorter, however often the loop calls."""
    import itertools

    _config(monkeypatch, rank_heartbeat_timeout=heartbeat_timeout)
    client = RankMonitorClient()
    received, duration = _heartbeats_received(watch, client, 0.5)
    assert client.dropped_heartbeats == 0
    assert 2 <= len(received) <= duration / interval + 2, (len(received), duration)
    # from before one sending call to after the next (the client's own gap lies within):
    # never under the interval, and once at least under the other candidate, not in force
    gaps = [after - before for (before, _), (_, after) in itertools.pairwise(received)]
    assert interval - 1e-9 <= min(gaps) < other, sorted(gaps)[:3]
