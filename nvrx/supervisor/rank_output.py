"""The output of one training process: its streams, routed as ``rank_logs.RankLogs`` says.

A redirected or tee'd stream reaches the supervisor through a pipe; a thread
per stream copies it to the stream's log file and, when tee'd, to the
supervisor's console with each line prefixed (a line ends at ``\\n`` or ``\\r``, so
progress bars show as they move). The process may be started before it is known
which rank it becomes (a warm standby): the thread then reads nothing until
``attach`` names the directory and the rank, so what the process printed before
waits in the pipe and is written with the rest. A standby for restarts does not
even know its local rank: a stream whose route differs between the local ranks
it may become is piped, and routed at ``attach`` (one routed to the console is
then copied there as it comes, unprefixed).

The threads take no lock that a process forked by the supervisor needs: they
read, write and, once, log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .rank_logs import STREAM_FILES, RankLogs, Route

log = logging.getLogger(__name__)

_CHUNK = 1 << 16
#: A console line longer than this is shown in pieces (output that never ends a line).
MAX_LINE_BYTES = 1 << 16
#: How long closing waits, for all streams together, for their last bytes (a process's
#: leftovers may hold a pipe open).
DRAIN_TIMEOUT_S = 5.0
_LINE_END = re.compile(rb"(?<=[\r\n])")


class StreamPump:
    """Copies one stream from a pipe to its file and, tee'd, to ``console_fd`` with a prefix
    (``route``: FILE or TEE; None until ``attach`` says)."""

    def __init__(self, name: str, route: Route | None, console_fd: int) -> None:
        self.name = name
        self.route = route
        self._console_fd = console_fd
        self._read_fd, self.write_fd = os.pipe()
        self._file_fd: int | None = None
        self._path: Path | None = None
        self._prefix = b""
        self._attached = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nvrx-{name}-pump", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            os.close(self._read_fd)
            os.close(self.write_fd)
            raise

    def attach(self, path: Path | None, prefix: bytes, route: Route | None = None) -> None:
        """Start copying: to ``path`` (appended to; None: no file) and, tee'd, to the console;
        ``route``: the stream's route, when it was not known at the start."""
        if self._attached.is_set():
            return
        if route is not None:
            self.route = route
        if path is not None:
            try:
                self._file_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
                self._path = path
            except OSError as exc:
                log.warning("cannot write %s: %s; the %s of this process is not kept", path, exc, self.name)
        self._prefix = prefix
        self._attached.set()

    def close_write_end(self) -> None:
        """The parent's copy of the write end: closed once the process holds its own."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def done(self) -> bool:
        """Whether the stream ended and all of it was copied."""
        return not self._thread.is_alive()

    def close(self, deadline: float) -> None:
        """Wait until ``deadline`` (``time.monotonic()``) for the stream's end and last lines."""
        self.close_write_end()
        if not self._attached.is_set():  # never attached (a standby not needed): drain to nowhere
            self.route = None
            self._attached.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("the %s pipe of a process stays open (a leftover holds it?): not waited for", self.name)

    def _run(self) -> None:
        self._attached.wait()
        route = self.route  # None: never attached (a standby not needed), drained to nowhere
        partial = bytearray()
        try:
            while data := os.read(self._read_fd, _CHUNK):
                self._to_file(data)
                if route is Route.CONSOLE:  # a standby's stream that turned out unrouted
                    self._show(data)
                elif route is Route.TEE:
                    partial += data
                    *lines, rest = _LINE_END.split(bytes(partial))
                    if len(rest) > MAX_LINE_BYTES:  # shown in pieces, each a line of its own
                        lines, rest = [*lines, rest + b"\n"], b""
                    partial = bytearray(rest)
                    if lines:
                        self._show(b"".join(self._prefix + line for line in lines))
            if partial:
                self._show(self._prefix + bytes(partial) + b"\n")
        except OSError as exc:  # the pipe itself failed: nothing more can come
            log.warning("reading the %s of a process stopped: %s", self.name, exc)
        finally:
            os.close(self._read_fd)
            if self._file_fd is not None:
                os.close(self._file_fd)

    def _to_file(self, data: bytes) -> None:
        """Append to the file; on an error (disk full), say so once and go on without it, so
        that the process never meets a broken pipe."""
        if self._file_fd is None:
            return
        try:
            write_all(self._file_fd, data)
        except OSError as exc:
            log.warning("writing %s failed: %s; the rest of this %s is not kept", self._path, exc, self.name)
            os.close(self._file_fd)
            self._file_fd = None

    def _show(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # a console gone must not stop the file copy
            write_all(self._console_fd, data)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``: one ``os.write`` may take only part of it."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class RankOutput:
    """The two streams of one process of ``local_rank``, as ``logs`` routes them.

    ``local_rank`` None: a standby that becomes one of ``local_ranks``, told at ``attach``.
    """

    def __init__(
        self, logs: RankLogs, local_rank: int | None, local_ranks: Sequence[int] = ()
    ) -> None:
        self.logs = logs
        self.local_rank = local_rank
        candidates = [logs.routes(r) for r in ([local_rank] if local_rank is not None else local_ranks)]
        # a stream routed alike for every candidate is set up so at once; else piped (None)
        self.routes: dict[str, Route | None] = {
            name: routes.pop() if len(routes := {c[i] for c in candidates}) == 1 else None
            for i, name in enumerate(STREAM_FILES)
        }
        self.pumps: dict[str, StreamPump] = {}
        try:
            for name, route in self.routes.items():
                if route in (None, Route.FILE, Route.TEE):
                    self.pumps[name] = StreamPump(name, route, 1 if name == "stdout" else 2)
        except BaseException:
            self.close(time.monotonic() + DRAIN_TIMEOUT_S)
            raise

    def popen_args(self) -> dict[str, Any]:
        """``stdout``/``stderr`` for ``processes.start``: a pipe, /dev/null, or inherited."""
        args: dict[str, Any] = {}
        for name, route in self.routes.items():
            if name in self.pumps:
                args[name] = self.pumps[name].write_fd
            elif route is Route.NULL:
                args[name] = subprocess.DEVNULL
        return args

    def started(self) -> None:
        """The process holds its ends of the pipes now."""
        for pump in self.pumps.values():
            pump.close_write_end()

    def attach(self, directory: Path | None, rank: int, local_rank: int | None = None) -> None:
        """The process is ``rank``'s (of ``local_rank``, when not known at the start) and its
        files go to ``directory`` (None: no files)."""
        if local_rank is not None:
            self.local_rank = local_rank
        if self.local_rank is None:
            raise ValueError("attach needs the local rank of a process started without one")
        routes = dict(zip(STREAM_FILES, self.logs.routes(self.local_rank), strict=True))
        prefix = self.logs.prefix(self.local_rank, rank)
        for name, pump in self.pumps.items():
            filed = directory is not None and routes[name] in (Route.FILE, Route.TEE)
            pump.attach(directory / STREAM_FILES[name] if filed else None, prefix, routes[name])

    def show(self, prefix: bytes) -> None:
        """The process ended without becoming a rank (a standby for restarts that died): what
        its piped streams hold goes to the console, each line after ``prefix``, and to no file
        (no rank's files are its own); a stream already routed stays as it was."""
        for pump in self.pumps.values():
            pump.attach(None, prefix, Route.TEE)

    def done(self) -> bool:
        return all(pump.done() for pump in self.pumps.values())

    def close(self, deadline: float) -> None:
        """Wait until ``deadline`` (``time.monotonic()``) for both streams' last lines."""
        for pump in self.pumps.values():
            pump.close(deadline)
