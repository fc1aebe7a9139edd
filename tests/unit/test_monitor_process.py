"""The monitor process is started without a preexec_fn and ignores SLURM's warning signal itself."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from nvrx import monitor_boot, processes
from nvrx.inprocess import monitor_main
from nvrx.inprocess.monitor_process import (
    ENTRY_POINT,
    IMPORTED,
    PRESTART_ENTRY_POINT,
    MonitorConfig,
    MonitorProcess,
)
from nvrx.store import client


def _config() -> MonitorConfig:
    return MonitorConfig(
        target_pid=1,
        board_path="/nonexistent",
        initial_rank=0,
        monitor_process_interval=1.0,
        heartbeat_interval=1.0,
        heartbeat_timeout=3.0,
        soft_timeout=5.0,
        hard_timeout=10.0,
        termination_grace_time=1.0,
        logfile=None,
    )


def test_the_monitor_is_started_without_a_preexec_fn(monkeypatch):
    """A preexec_fn makes CPython fork() the threaded rank and run Python in the copy."""
    started = {}

    def start(argv, **kwargs):
        started.update(kwargs, argv=argv)
        return SimpleProc()

    class SimpleProc:
        pid = 12345
        stdin = io.BytesIO()

    monkeypatch.setattr(processes, "start", start)
    os.close(MonitorProcess(_config()).start())
    assert started["ignore_warning"] is False
    assert "preexec_fn" not in started
    assert started["argv"] == [sys.executable, "-c", ENTRY_POINT]


def test_the_monitor_program_ignores_the_warning_signal_first(monkeypatch):
    previous = signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    try:
        monkeypatch.delenv("NVRX_PREEMPT_SIGNAL", raising=False)
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
        assert monitor_main.main() == 0  # no configuration: nothing to watch
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR2, previous)


SPY_ON_THE_PROGRAM_IMPORT = """
import builtins, os, signal, sys
real_import = builtins.__import__

def spy(name, *args, **kwargs):
    if name.startswith("nvrx.inprocess"):  # the slow import of the program: how is SIGUSR2 now?
        os._exit(0 if signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN else 3)
    return real_import(name, *args, **kwargs)

builtins.__import__ = spy
"""


@pytest.mark.parametrize("entry", [ENTRY_POINT, PRESTART_ENTRY_POINT])
def test_the_entry_points_ignore_the_warning_signal_before_importing_the_program(entry):
    """Both entry points as the monitor runs them: SIGUSR2 is ignored before the (slow) import."""
    env = {k: v for k, v in os.environ.items() if k != "NVRX_PREEMPT_SIGNAL"}
    code = SPY_ON_THE_PROGRAM_IMPORT + entry
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL, check=False, timeout=60
    )
    assert done.returncode == 0


def test_the_boot_imports_neither_torch_nor_the_wrapper_and_launches_a_hosted_store():
    """What runs before the program's imports stays light; a store it hosts is launched there."""
    code = (
        "import sys, nvrx.monitor_boot, nvrx.store.service; "
        "sys.exit(3 if {'torch', 'nvrx.inprocess'} & set(sys.modules) else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0
    assert monitor_boot.launch_store(b"") is None
    assert monitor_boot.launch_store(b'{"host_store": false}') is None
    service = monitor_boot.launch_store(b'{"host_store": true, "store_host": "127.0.0.1"}')
    try:
        service.wait_started(60)
        client.connect("127.0.0.1", service.port, timeout=10).set("k", "v")
    finally:
        service.stop()
    assert json.loads(monitor_boot.IMPORTED_LINE) == IMPORTED  # the two sides agree


SPY_FOR_THE_STORE_SERVICE = """
import builtins, os, psutil
real_import = builtins.__import__

def spy(name, *args, **kwargs):
    if name.startswith("nvrx.inprocess"):  # the program's import: is its store launched yet?
        launched = any(
            "nvrx.store.service" in " ".join(child.cmdline())
            for child in psutil.Process().children()
        )
        os._exit(0 if launched else 3)
    return real_import(name, *args, **kwargs)

builtins.__import__ = spy
"""


def test_a_monitor_that_hosts_the_store_launches_it_before_importing_the_program():
    line = json.dumps({"host_store": True, "store_host": "127.0.0.1", "store_port": 0}) + "\n"
    done = subprocess.run(
        [sys.executable, "-c", SPY_FOR_THE_STORE_SERVICE + ENTRY_POINT],
        input=line.encode(),
        check=False,
        timeout=60,
    )  # the launched service exits with its parent (its death signal)
    assert done.returncode == 0


def _hosting(tmp_path) -> bytes:
    cfg = dataclasses.asdict(_config())
    cfg.update(host_store=True, store_host="127.0.0.1", logfile=str(tmp_path / "monitor.log"))
    return (json.dumps(cfg) + "\n").encode()


def _in_a_process(code: str, line: bytes) -> int:
    """Run the monitor program's ``main`` in a process of its own: it ignores SLURM's warning
    signal and sets up logging and faulthandler, which must not leak into the test process."""
    done = subprocess.run(
        [sys.executable, "-c", code, line.decode()], check=False, timeout=120
    )
    return done.returncode


def test_a_failed_launch_of_the_hosted_store_is_the_monitors_logged_failure(tmp_path):
    line = _hosting(tmp_path)
    code = (
        "import sys; from nvrx.inprocess import monitor_main; "
        "sys.exit(monitor_main.main(sys.argv[1].encode(), "
        "RuntimeError('store port 127.0.0.1:1 is already in use')))"
    )
    assert _in_a_process(code, line) == 1
    assert "already in use" in (tmp_path / "monitor.log").read_text()


def test_a_launched_store_is_stopped_when_the_monitor_fails_before_it_watches(tmp_path):
    """Here its board does not exist: the service the boot launched must not outlive it."""
    code = (
        "import sys; from nvrx import monitor_boot; from nvrx.inprocess import monitor_main\n"
        "line = sys.argv[1].encode(); service = monitor_boot.launch_store(line)\n"
        "code = monitor_main.main(line, service)\n"
        "sys.exit(code if not service.alive and service.pid is None else 5)\n"
    )
    assert _in_a_process(code, _hosting(tmp_path)) == 1


def test_a_rank_that_keeps_the_store_after_leaving_is_beaten_for_no_more():
    """``FLAG_KEEPING``: its monitor says bye once (its host's agent counts it ended, and the
    job moves only by the others' beats) and beats no more; dying then is no fault."""
    from nvrx.inprocess import monitor_main
    from nvrx.inprocess.progress_watchdog import FLAG_KEEPING

    class Host:
        def __init__(self) -> None:
            self.beats, self.ended = 0, []

        def beat(self, beat) -> None:
            self.beats += 1

        def end(self, failed: bool) -> None:
            self.ended.append(failed)

    monitor = monitor_main._Monitor.__new__(monitor_main._Monitor)
    host = Host()
    monitor.host, monitor.sender, monitor.next_hb = host, None, 0.0
    monitor.cfg = SimpleNamespace(heartbeat_interval=0.0, initial_rank=0, target_pid=1)
    monitor.child, monitor.round = (0, 0), 0
    monitor._beat = lambda rank, world_size, bye=False: (rank, world_size)
    monitor._heartbeat(1.0, {"flags": 0, "rank": 0, "world_size": 2})
    assert host.beats == 1 and host.ended == []
    for now in (2.0, 3.0):
        monitor._heartbeat(now, {"flags": FLAG_KEEPING, "rank": 0, "world_size": 2})
    assert host.beats == 1 and host.ended == [False]  # one bye, on purpose
    kept = []
    monitor._keep_store = lambda: kept.append(True)
    monitor._leave = lambda *a: pytest.fail("a rank that left the job leaves no round")
    monitor.board = SimpleNamespace(read=lambda: {"flags": FLAG_KEEPING, "rank": 0, "world_size": 2})
    monitor._rank_died()
    assert kept == [True]
