"""The monitor process's link to the store (``monitor_store.StoreLink``), and what lets the
monitor program run without torch until then: ``nvrx.inprocess`` imports its submodules only
when asked for them."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from nvrx import jobenv
from nvrx.events import read_dir
from nvrx.inprocess import monitor_store
from nvrx.inprocess.monitor_process import ENTRY_POINT, PRESTART_ENTRY_POINT, MonitorConfig
from nvrx.inprocess.progress_watchdog import FLAG_RELEASED, ProgressBoard
from nvrx.node_agent.rank_wire import BeatSocket
from nvrx.store import rounds
from nvrx.store.wire import StoreGone
from tests.support.waiting import wait_until


def _unused_port() -> int:
    """A port nothing listens on: the link to a store there keeps being refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _config(target_pid: int, board_path: str, **fields) -> MonitorConfig:
    """A monitor's configuration with this file's defaults, ``fields`` over them."""
    defaults = dict(
        initial_rank=0, monitor_process_interval=0.1, heartbeat_interval=0.5,
        heartbeat_timeout=30.0, soft_timeout=30.0, hard_timeout=60.0,
        termination_grace_time=1.0, logfile=None, store_port=_unused_port(),
    )  # fmt: skip
    return MonitorConfig(target_pid=target_pid, board_path=board_path, **{**defaults, **fields})


def _factory(factory, **kwargs) -> str:
    """A ``store_factory`` as the Wrapper sends it: ``(factory, kwargs)``, pickled, base64."""
    return base64.b64encode(pickle.dumps((factory, kwargs))).decode()


def _imports_torch(code: str) -> bool:
    check = f"{code}\nimport sys\nsys.exit(3 if 'torch' in sys.modules else 0)"
    done = subprocess.run([sys.executable, "-c", check], check=False, timeout=120)
    assert done.returncode in (0, 3), done
    return done.returncode == 3


def test_the_monitor_program_and_the_package_import_no_torch():
    assert not _imports_torch("import nvrx.inprocess")
    assert not _imports_torch("import nvrx.inprocess.monitor_main")
    assert not _imports_torch("import nvrx.inprocess.monitor_store, nvrx.events.failures")
    assert not _imports_torch(
        "import nvrx.store.rounds, nvrx.store.wire, nvrx.node_agent.rank_wire, "
        "nvrx.node_agent.__main__, nvrx.node_agent.supervised, nvrx.node_agent.host"
    )  # what the monitor and the node agent run on the store
    assert _imports_torch("from nvrx.inprocess import Wrapper")  # the Wrapper does


def test_the_package_gives_its_names_and_submodules_when_asked():
    import nvrx.inprocess as inprocess
    from nvrx.inprocess.wrap import Wrapper

    assert inprocess.Wrapper is Wrapper
    assert inprocess.rank_services.RankServices  # a submodule outside __all__ as well
    assert set(inprocess.__all__) <= set(dir(inprocess))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        inprocess.no_such_name  # noqa: B018
    namespace: dict = {}
    exec("from nvrx.inprocess import *", namespace)
    assert {"Wrapper", "CallWrapper", "tools", "store"} <= set(namespace)


def test_a_link_made_here_gives_the_store_and_the_modules_that_act_on_it(base):
    link = monitor_store.StoreLink(lambda: base).make()
    assert link.made and link.error is None
    assert link.get() is base
    assert link.rounds is rounds


def test_a_link_made_beside_is_waited_for(base):
    go = threading.Event()

    def connect():
        go.wait(30)
        return base

    link = monitor_store.StoreLink(connect).start()
    assert not link.made
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(link.get()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # get() waits for the link
    go.set()
    waiter.join(30)
    assert got == [base] and link.made


def test_waiting_for_a_link_made_beside_does_something_meanwhile(base):
    go = threading.Event()
    link = monitor_store.StoreLink(lambda: go.wait(30) and base).start()
    beats: list[int] = []

    def beat():
        beats.append(1)
        if len(beats) == 3:
            go.set()

    link.wait(beat, 0.05)
    assert len(beats) >= 3 and link.get() is base


def test_waiting_for_a_link_gives_up_after_its_bound():
    stuck = threading.Event()
    link = monitor_store.StoreLink(lambda: stuck.wait(30), wait_s=0.3).start()
    try:
        with pytest.raises(monitor_store.StoreUnavailable, match="within 0.3 s"):
            link.wait(lambda: None, 0.05)
    finally:
        stuck.set()


def _unreachable_errors() -> list[type[Exception]]:
    from torch.distributed import DistNetworkError

    return [StoreGone, DistNetworkError]  # nvrx's own client (the monitor's), torch's


@pytest.mark.parametrize("unreachable", _unreachable_errors(), ids=lambda e: e.__name__)
def test_a_store_that_does_not_answer_yet_is_tried_again_within_the_bound(base, unreachable):
    """Node 0's store may come up after this node's monitors: a connection that timed out is
    tried again until ``wait_s`` has passed, then its error stands."""
    tries: list[int] = []

    def late():
        tries.append(1)
        if len(tries) < 3:
            raise unreachable("the client socket has timed out")
        return base

    assert monitor_store.StoreLink(late).make().get() is base and len(tries) == 3
    tries.clear()
    with pytest.raises(unreachable):
        monitor_store.StoreLink(late, wait_s=0.0).make()
    assert len(tries) == 1


@pytest.mark.parametrize("unreachable", _unreachable_errors(), ids=lambda e: e.__name__)
def test_a_client_that_fails_at_once_is_tried_again_after_growing_pauses(unreachable):
    """A store factory that raises at once (not after a client timeout) is not tried in a
    loop: pauses of 0.05, 0.1 and 0.2 s, then the 0.25 s left, make 5 tries in 0.6 s; a
    loop makes hundreds of thousands."""
    tries: list[int] = []

    def refused():
        tries.append(1)
        raise unreachable("connection refused")

    with pytest.raises(unreachable):
        monitor_store.StoreLink(refused, wait_s=0.6).make()
    assert 2 <= len(tries) <= 8


def test_a_failed_link_raises_here_or_at_every_get(caplog):
    def connect():
        raise ConnectionRefusedError("store at 127.0.0.1:1 refused")

    with pytest.raises(ConnectionRefusedError):
        monitor_store.StoreLink(connect).make()
    link = monitor_store.StoreLink(connect).start()
    with pytest.raises(monitor_store.StoreUnavailable, match="refused") as raised:
        link.get()
    assert isinstance(raised.value.__cause__, ConnectionRefusedError)
    assert not link.made and isinstance(link.error, ConnectionRefusedError)
    with pytest.raises(monitor_store.StoreUnavailable):
        link.rounds  # noqa: B018
    assert "no link to the store" in caplog.text


def test_a_supervised_monitor_says_it_watches_first_and_ends_when_its_link_fails(tmp_path):
    """Under a supervisor the link is made beside the watch: the program is ready before it, and
    a link that fails (here a store factory that raises) ends the program, logged."""
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    board = ProgressBoard()
    try:
        cfg = _config(
            rank.pid,
            board.path,
            logfile=str(tmp_path / "monitor.log"),
            store_factory=_factory(int, x="bad"),  # raises TypeError when called
            events_dir=str(tmp_path / "events"),
        )
        env = dict(os.environ, **{jobenv.RANK_BEATS: str(tmp_path / "beats.sock")})
        done = subprocess.run(
            [sys.executable, "-c", ENTRY_POINT],
            input=(json.dumps(dataclasses.asdict(cfg)) + "\n").encode(),
            capture_output=True,
            env=env,
            check=False,
            timeout=120,
        )
    finally:
        rank.kill()
        rank.wait()
        board.close()
    assert done.returncode == 1, done
    assert json.loads(done.stdout.splitlines()[0])["ready"] is True
    log = (tmp_path / "monitor.log").read_text()
    assert "no link to the store" in log and "monitor process failed" in log
    found, _ = read_dir(tmp_path / "events")
    ends = [e for e in found if e["kind"] == "process_end"]
    assert [(e["component"], e["exit_code"]) for e in ends] == [("monitor", 1)]
    assert "no link to the store" in ends[0]["reason"] and "TypeError" in ends[0]["reason"]


# Run in the monitor program: exits 0 when ``import torch`` begins before the program waits
# for the store service it launched (the two imports overlap), 3 when it begins after.
SPY_ON_THE_LINK = """
import os, sys
from nvrx.inprocess import monitor_store
real_make = monitor_store.StoreLink.make

def make(self):
    link = real_make(self)
    os._exit(3 if "torch" in sys.modules else 0)

monitor_store.StoreLink.make = make
"""


def test_a_monitor_that_hosts_the_store_links_to_it_without_importing_torch(tmp_path):
    """The store service it starts imports torch; the monitor, which talks to that store
    through nvrx's own client, does not."""
    board = ProgressBoard()
    cfg = dataclasses.asdict(
        _config(os.getpid(), board.path, host_store=True, store_host="127.0.0.1", store_port=0)
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", SPY_ON_THE_LINK + ENTRY_POINT],
            input=(json.dumps(cfg) + "\n").encode(),
            check=False,
            timeout=120,
        )  # the launched service exits with its parent (its death signal)
    finally:
        board.close()
    assert done.returncode == 0  # 3: torch was imported by the time the link was made


def test_the_monitor_program_leaves_the_store_modules_to_its_link():
    """The monitor writes a fault's event before its link is made: the program imports the
    event's builder (``nvrx.events.failures``), and its link the round protocol
    (``nvrx.store.rounds``), beside the watch under a supervisor; the node agent's modules,
    for a rank without a supervisor, are imported only then."""
    check = (
        "import sys, nvrx.inprocess.monitor_main\n"
        "loaded = {'nvrx.store.rounds', 'nvrx.inprocess.agent_link', 'nvrx.node_agent.host'} & set(sys.modules)\n"
        "sys.exit(3 if loaded else 0 if 'nvrx.events.failures' in sys.modules else 4)"
    )
    done = subprocess.run([sys.executable, "-c", check], check=False, timeout=120)
    assert done.returncode == 0


def test_a_monitor_started_ahead_has_imported_its_store_modules_when_it_says_so():
    """A warm standby's monitor: its link's imports are done before ``{"imported": true}``,
    and none of them is torch."""
    spy = (
        "import os, sys\n"
        "real_write = sys.stdout.write\n"
        "def write(text):\n"
        "    if 'imported' in text:\n"
        "        loaded = 'nvrx.store.rounds' in sys.modules\n"
        "        os._exit(4 if 'torch' in sys.modules else 5 if loaded else 3)\n"
        "    return real_write(text)\n"
        "sys.stdout.write = write\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", spy + PRESTART_ENTRY_POINT],
        stdin=subprocess.DEVNULL,
        check=False,
        timeout=120,
    )
    assert done.returncode == 5  # 3: said too early; 4: imported torch; 0: never said it


@contextlib.contextmanager
def _supervised_monitor(tmp_path, before=None, **fields):
    """A monitor program beating to a supervisor's socket, watching a sleeping rank;
    ``before(board)`` runs before it starts. Yields (monitor, beats); all ended after."""
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    board = ProgressBoard()
    beats = BeatSocket(str(tmp_path / "beats.sock"))
    monitor = None
    try:
        if before is not None:
            before(board)
        cfg = _config(rank.pid, board.path, **fields)
        env = dict(os.environ, **{jobenv.RANK_BEATS: beats.path})
        monitor = subprocess.Popen(
            [sys.executable, "-c", ENTRY_POINT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, start_new_session=True,  # with a factory's ``sleep``: one group to kill
        )  # fmt: skip
        monitor.stdin.write((json.dumps(dataclasses.asdict(cfg)) + "\n").encode())
        monitor.stdin.flush()
        yield monitor, beats
    finally:
        if monitor is not None:
            with contextlib.suppress(ProcessLookupError):  # a test may have seen it end
                os.killpg(monitor.pid, signal.SIGKILL)
            monitor.wait()
        rank.kill()
        rank.wait()
        beats.close()
        board.close()


def _hung_in_round_0(board) -> None:
    board.set_round(0, 0, 1, 0)
    board.enter_user()  # and no progress from now on


def test_a_monitor_waiting_for_its_link_keeps_beating_to_its_supervisor(tmp_path):
    """A soft hang found while the link is still being made (a store factory that takes 20 s):
    the fault waits for the link, and the beats go on meanwhile, so that the supervisor does
    not take the waiting monitor's rank for a silent one."""
    with _supervised_monitor(
        tmp_path,
        _hung_in_round_0,  # a soft hang after 0.5 s
        heartbeat_interval=0.2,
        soft_timeout=0.5,
        store_factory=_factory(subprocess.run, args=["sleep", "20"]),  # a link held 20 s
        events_dir=str(tmp_path / "events"),
    ) as (_monitor, beats):

        def hang_seen() -> bool:
            found, _ = read_dir(tmp_path / "events")
            return any(e["kind"] == "hang" for e in found)

        wait_until("the soft hang's event", hang_seen, 60)
        beats.receive()  # those of the watch loop so far
        got: list = []
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # the loop waits for the link all this time
            select.select([beats], [], [], 0.1)
            got += beats.receive()
        assert len(got) >= 4, got  # one every 0.2 s
        assert {(b.rank, b.round, b.bye) for b in got} == {(0, 0, False)}
        found, _ = read_dir(tmp_path / "events")
        assert not [e for e in found if e["kind"] == "fault"]  # its record waits for the link


def test_a_supervised_monitor_beats_once_before_it_says_it_watches(tmp_path):
    """The supervisor knows of a monitor before its rank goes on: one frozen before its first
    look (a node that trains at once) is found silent too, not ignored for never beating."""
    # no look for 30 s: only the beat before the ready line can be there
    with _supervised_monitor(tmp_path, monitor_process_interval=30.0) as (monitor, beats):
        assert json.loads(monitor.stdout.readline())["ready"]
        got = beats.receive()  # sent before the ready line, so here already
        assert [(b.initial_rank, b.round, b.bye) for b in got] == [(0, -1, False)], got


def test_a_supervised_monitor_beats_while_its_rank_waits_for_its_first_round(tmp_path):
    """The Wrapper marks round -1 while its rank waits to be admitted (the initial barrier,
    a rejoin): its monitor beats to the supervisor all the same, or the supervisor, which
    knows of it from its first beat, would take the waiting rank for a silent one."""

    def waiting(board) -> None:
        board.set_round(-1, 3, 4, 3)

    with _supervised_monitor(tmp_path, waiting, heartbeat_interval=0.2) as (monitor, beats):
        assert json.loads(monitor.stdout.readline())["ready"]
        got: list = []

        def beaten() -> bool:
            select.select([beats], [], [], 0.1)
            got.extend(beats.receive())
            return len(got) >= 4

        wait_until("beats while the rank waits", beaten, 60)
        assert {(b.round, b.bye) for b in got} == {(-1, False)}, got


@pytest.mark.parametrize("released", [False, True], ids=["in_its_round", "between_rounds"])
def test_a_monitor_waiting_for_its_link_for_a_dead_rank_ends_when_its_supervisor_is_gone(
    tmp_path, released
):
    """A rank dies while its monitor's link is still being made (a store factory that takes
    60 s), then its supervisor ends: no socket is bound where it beat any more. The monitor
    writes the rank's death (where it died between rounds, once it knows which round: here,
    when its wait ends), and ends when a beat finds the supervisor gone (its
    ranks died with it), instead of waiting minutes for a link that would serve nobody
    (a job's end left such monitors behind)."""

    def in_round_0(board) -> None:
        board.set_round(0, 0, 1, 0)
        board.set_flag(FLAG_RELEASED, released)  # released into round 1: a store look first

    log = tmp_path / "monitor.log"

    with _supervised_monitor(
        tmp_path,
        in_round_0,
        heartbeat_interval=0.2,
        store_factory=_factory(subprocess.run, args=["sleep", "60"]),
        events_dir=str(tmp_path / "events"),
        logfile=str(log),
    ) as (monitor, beats):
        assert json.loads(monitor.stdout.readline())["ready"]
        first = beats.receive()[0]  # the watch may have beaten since
        os.kill(first.pid, signal.SIGKILL)
        seen = f"rank process {first.pid} died"
        wait_until("the monitor to see the death", lambda: seen in log.read_text(), 30)
        assert monitor.poll() is None  # it waits for its link, beating
        beats.close()  # the supervisor ends
        assert monitor.wait(timeout=45) == 1  # before the factory's 60 s
    found, _ = read_dir(tmp_path / "events")
    faults = [e for e in found if e["kind"] == "fault"]
    assert [(e["fault_kind"], e["round"]) for e in faults] == [("dead", 0)]
    (end,) = [e for e in found if e["kind"] == "process_end"]
    assert end["exit_code"] == 1 and "SupervisorGone" in end["reason"], end
    assert "Traceback" not in log.read_text()  # an end foreseen, said in one line
