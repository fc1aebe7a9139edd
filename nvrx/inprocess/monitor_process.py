"""Wrapper-side handle of a rank's monitor process: start it, wait until it watches, stop and reap it.

The monitor process runs ``nvrx.inprocess.monitor_main`` (what it watches and
how it acts is described there) in a fresh interpreter, never a fork of the
threaded training process. It is started through ``nvrx.processes``, in a
process group of its own, without a ``preexec_fn`` (with one, CPython would
fork() the threaded rank and run Python in the copy before exec, instead of
vfork/posix_spawn): the program ignores SLURM's warning signal itself, as
the first thing it does.

The protocol between the two: the handle writes the ``MonitorConfig`` as one
JSON line on the program's stdin; the program answers one JSON line on its
stdout once it watches (``{"ready": true, "pid": ..., "port": ...}``, the port
of the store it hosts, if any). The Wrapper asks it to exit by setting the
board's shutdown flag and closing its stdin.
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
from dataclasses import asdict, dataclass
from typing import Any

from nvrx import processes

log = logging.getLogger(__name__)

#: Signal on which the rank's faulthandler dumps every thread's stack into the monitor's pipe.
STACK_SIGNAL = signal.SIGRTMIN + 6
#: The program's entry point, as started by ``MonitorProcess.start``: SLURM's warning signal is
#: ignored before the (slower) import of the program, which ignores it again in ``main``.
ENTRY_POINT = (
    "import sys; from nvrx.processes import ignore_warning_signal; ignore_warning_signal(); "
    "from nvrx.inprocess.monitor_main import main; sys.exit(main())"
)


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
    keeper_timeout: float = 600.0  # how long a store host waits for the others after its rank died


class MonitorProcess:
    """Wrapper-side handle of the monitor process: explicit start, stop, reap."""

    def __init__(self, config: MonitorConfig, stack_read_fd: int | None) -> None:
        self.config = config
        self._stack_read_fd = stack_read_fd
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The monitor process's pid while it runs under this handle."""
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        """Start the program and send it its configuration (the stack pipe's read end goes with it)."""
        cfg = dict(asdict(self.config))
        fds: tuple[int, ...] = ()
        if self._stack_read_fd is not None:
            cfg["stack_fd"] = self._stack_read_fd
            fds = (self._stack_read_fd,)
        self.proc = processes.start(
            [sys.executable, "-c", ENTRY_POINT],
            env=os.environ,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if self.config.logfile is None else None,
            pass_fds=fds,
            ignore_warning=False,  # no preexec_fn: the program ignores it (module docstring)
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cfg) + "\n").encode())
        self.proc.stdin.flush()
        if self._stack_read_fd is not None:
            os.close(self._stack_read_fd)
            self._stack_read_fd = None

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Block until the monitor process is connected and watching; returns its ready message."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            raise TimeoutError(f"monitor process {self.proc.pid} not ready within {timeout:g} s")
        line = self.proc.stdout.readline()
        if not line:
            code = processes.wait(self.proc, 5)
            raise RuntimeError(
                f"monitor process exited with {code} before it was ready"
                f" (see monitor_process_logfile {self.config.logfile})"
            )
        return json.loads(line)

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
