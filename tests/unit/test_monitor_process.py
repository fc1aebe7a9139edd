"""The monitor process is started without a preexec_fn and ignores SLURM's warning signal itself."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

from nvrx import processes
from nvrx.inprocess import monitor_main
from nvrx.inprocess.monitor_process import ENTRY_POINT, MonitorConfig, MonitorProcess


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


def test_the_entry_point_ignores_the_warning_signal_before_importing_the_program():
    """The entry point as the monitor runs it: SIGUSR2 is ignored before the (slow) import."""
    before_import, found, _ = ENTRY_POINT.partition("from nvrx.inprocess")
    assert found
    code = before_import + (
        "import signal, sys; "
        "sys.exit(0 if signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN else 3)"
    )
    env = {k: v for k, v in os.environ.items() if k != "NVRX_PREEMPT_SIGNAL"}
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0
