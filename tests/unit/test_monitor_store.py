"""The monitor process's link to the store (``monitor_store.StoreLink``), and what lets the
monitor program run without torch until then: ``nvrx.inprocess`` imports its submodules only
when asked for them."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pickle
import subprocess
import sys
import threading

import pytest

from nvrx import jobenv
from nvrx.inprocess import fault_recording, monitor_store
from nvrx.inprocess import store as rstore
from nvrx.inprocess.monitor_process import ENTRY_POINT, MonitorConfig
from nvrx.inprocess.progress_watchdog import ProgressBoard


def _imports_torch(code: str) -> bool:
    check = f"{code}\nimport sys\nsys.exit(3 if 'torch' in sys.modules else 0)"
    done = subprocess.run([sys.executable, "-c", check], check=False, timeout=120)
    assert done.returncode in (0, 3), done
    return done.returncode == 3


def test_the_monitor_program_and_the_package_import_no_torch():
    assert not _imports_torch("import nvrx.inprocess")
    assert not _imports_torch("import nvrx.inprocess.monitor_main")
    assert not _imports_torch("import nvrx.inprocess.monitor_store, nvrx.inprocess.fault_events")
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
    assert link.rounds is rstore and link.recording is fault_recording


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
        cfg = MonitorConfig(
            target_pid=rank.pid,
            board_path=board.path,
            initial_rank=0,
            monitor_process_interval=0.1,
            heartbeat_interval=0.5,
            heartbeat_timeout=30.0,
            soft_timeout=30.0,
            hard_timeout=60.0,
            termination_grace_time=1.0,
            logfile=str(tmp_path / "monitor.log"),
            store_factory=base64.b64encode(pickle.dumps((int, {"x": "bad"}))).decode(),
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
