"""Wrapper-side handle of a rank's monitor process: start it, wait until it watches, stop and reap it.

The monitor process runs ``nvrx.inprocess.monitor_main`` (what it watches and
how it acts is described there), started by ``nvrx.monitor_boot``, in a
fresh interpreter, never a fork of the threaded training process. It is
started through ``nvrx.processes``, in a process group of its own, without a
``preexec_fn`` (with one, CPython would fork() the threaded rank and run
Python in the copy before exec, instead of vfork/posix_spawn): the program
ignores SLURM's warning signal itself, as the first thing it does.

The protocol between the two: the handle writes the ``MonitorConfig`` as one
JSON line on the program's stdin; the program answers one JSON line on its
stdout once it watches (``{"ready": true, "pid": ..., "port": ...}``, the port
of the store it hosts, if any). The Wrapper asks it to exit by setting the
board's shutdown flag and closing its stdin. A program started ahead of its
rank (``prestart``, by a warm standby) writes ``{"imported": true}`` first, once
past its imports, before it reads its configuration.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from nvrx import processes

log = logging.getLogger(__name__)

#: Signal on which the rank's faulthandler dumps every thread's stack into the monitor's pipe.
STACK_SIGNAL = signal.SIGRTMIN + 6
#: The program's entry point, as started by ``MonitorProcess.start`` (``nvrx.monitor_boot``:
#: SLURM's warning signal is ignored, and a store it hosts launched, before the rest is imported).
ENTRY_POINT = "from nvrx.monitor_boot import main; main()"
#: A program started ahead (``prestart``) says when its imports are done: one line, before
#: its ready message, which ``wait_prestarted`` reads (``MonitorProcess.wait_ready`` skips it).
IMPORTED = {"imported": True}
PRESTART_ENTRY_POINT = "from nvrx.monitor_boot import main_prestarted; main_prestarted()"


@dataclass
class MonitorConfig:
    """What the monitor process needs to know (sent as JSON on its stdin)."""

    target_pid: int
    board_path: str
    initial_rank: int
    monitor_process_interval: float
    heartbeat_interval: float
    heartbeat_timeout: float
    soft_timeout: float
    hard_timeout: float
    termination_grace_time: float
    logfile: str | None
    store_host: str | None = None
    store_port: int | None = None
    store_factory: str | None = None  # base64 pickle of (factory, kwargs) for a custom store
    stack_fd: int | None = None
    events_dir: str | None = None
    events_context: dict | None = None
    initial_world_size: int = 1
    host_store: bool = False  # start the store service here, so it outlives the rank
    barrier_timeout: float = 120.0  # the Wrapper's: how long its ranks wait at a barrier
    keeper_timeout: float = 600.0  # a store host whose rank left: the longest the job may stand still
    env: dict[str, str] | None = None  # a program started ahead (``prestart``) takes the rank's


@dataclass
class _Prestarted:
    """A monitor program started ahead, waiting for its configuration."""

    proc: subprocess.Popen[bytes]
    stack_read_fd: int  # the descriptor's number in the program
    stack_write_fd: int


_prestarted: _Prestarted | None = None


def _launch(
    stack_read_fd: int, stderr: int | None, entry: str = ENTRY_POINT
) -> subprocess.Popen[bytes]:
    return processes.start(
        [sys.executable, "-c", entry],
        env=os.environ,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        pass_fds=(stack_read_fd,),
        ignore_warning=False,  # no preexec_fn: the program ignores it (module docstring)
    )


def prestart() -> None:
    """Start a monitor program now, for this process's first ``MonitorProcess.start`` to take.

    A warm standby (``nvrx.supervisor.standby``) calls it while it waits, so that
    the rank it becomes finds its monitor process already past its imports. Not
    taken, the program exits when this process does (end of file on its stdin).
    Its stderr goes nowhere: with ``monitor_process_logfile``, it logs there.
    """
    global _prestarted
    if _prestarted is not None:
        return  # one is waiting already
    read_fd, write_fd = os.pipe()
    try:
        proc = _launch(read_fd, subprocess.DEVNULL, PRESTART_ENTRY_POINT)
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    _prestarted = _Prestarted(proc, read_fd, write_fd)


def wait_prestarted(timeout: float) -> bool:
    """Wait until the program started ahead is past its imports (``IMPORTED``); False when
    there is none, it ended, or ``timeout`` seconds passed."""
    ahead = _prestarted
    if ahead is None or ahead.proc.stdout is None:
        return False
    if not select.select([ahead.proc.stdout.fileno()], [], [], timeout)[0]:
        return False
    line = ahead.proc.stdout.readline()  # the program writes the whole line at once
    return bool(line) and json.loads(line) == IMPORTED


def _take_prestarted() -> _Prestarted | None:
    global _prestarted
    taken, _prestarted = _prestarted, None
    if taken is not None and taken.proc.poll() is not None:
        log.warning(
            "monitor process started ahead ended with %s: starting a new one", taken.proc.returncode
        )
        os.close(taken.stack_write_fd)
        for pipe in (taken.proc.stdin, taken.proc.stdout):
            if pipe is not None:
                pipe.close()
        return None
    return taken


class MonitorProcess:
    """Wrapper-side handle of the monitor process: explicit start, stop, reap."""

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The monitor process's pid while it runs under this handle."""
        return None if self.proc is None else self.proc.pid

    def start(self) -> int:
        """Start the program (or take the one started ahead) and send it its configuration.

        Returns the write end of the stack pipe (non-blocking): the rank's
        faulthandler dumps its threads there, and the program reads them.
        """
        cfg = dict(asdict(self.config))
        prestarted = _take_prestarted()
        if prestarted is not None:
            self.proc, write_fd = prestarted.proc, prestarted.stack_write_fd
            cfg["stack_fd"] = prestarted.stack_read_fd
            cfg["env"] = dict(os.environ)
        else:
            read_fd, write_fd = os.pipe()
            try:
                self.proc = _launch(
                    read_fd, subprocess.DEVNULL if self.config.logfile is None else None
                )
            except BaseException:
                os.close(write_fd)
                raise
            finally:
                os.close(read_fd)
            cfg["stack_fd"] = read_fd
        os.set_blocking(write_fd, False)  # a dump never blocks the rank if nobody reads
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(cfg) + "\n").encode())
            self.proc.stdin.flush()
        except BaseException:
            os.close(write_fd)
            raise
        return write_fd

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Block until the monitor process is connected and watching; returns its ready message."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError(
                    f"monitor process {self.proc.pid} not ready within {timeout:g} s"
                )
            line = self.proc.stdout.readline()
            if not line:
                code = processes.wait(self.proc, 5)
                raise RuntimeError(
                    f"monitor process exited with {code} before it was ready"
                    f" (see monitor_process_logfile {self.config.logfile})"
                )
            message = json.loads(line)
            if message != IMPORTED:  # a program started ahead said so first (``prestart``)
                return message

    def stop(self, timeout: float = 5.0) -> int | None:
        """Ask it to exit (board flag set by the caller, stdin closed), wait ``timeout``, kill its group, reap."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        assert proc.stdin is not None and proc.stdout is not None
        code = processes.stop(proc, ask=proc.stdin.close, grace_s=timeout)
        for pipe in (proc.stdin, proc.stdout):  # closed even when it had exited already
            with contextlib.suppress(OSError):
                pipe.close()
        if code != 0:
            log.warning("monitor process exited with %s", code)
        return code
