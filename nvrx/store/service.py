"""The external store: a torch ``TCPStore`` server in a process of its own.

The node-0 supervisor (or a standalone Wrapper) starts it before any training
process, so no fault of training code can take the coordination state down.
The service exits when asked (SIGTERM/SIGINT) or when the process that started
it dies, so it never outlives its job.

Run as ``python -m nvrx.store.service --host H --port P`` it serves until
stopped; ``StoreService`` manages such a process from Python.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time

from nvrx import jobenv, processes

from .server_process import store_port_is_free
from .snapshot import SnapshotSpec

log = logging.getLogger(__name__)

_READY_TIMEOUT_S = 60.0


class StorePortInUse(RuntimeError):
    """The store's port is taken by another process."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(
            f"store port {host}:{port} is already in use: pick a free port (e.g. --store-port) "
            f"or stop the process that holds it"
        )
        self.host, self.port = host, port


class StoreUnavailable(RuntimeError):
    """The store never answered at host:port."""

    def __init__(self, host: str, port: int, timeout: float, detail: str = "") -> None:
        msg = f"no nvrx store answered at {host}:{port} within {timeout:g} s"
        if detail:
            msg += f" ({detail})"
        msg += ": check that node 0's supervisor runs and that host and port are right"
        super().__init__(msg)
        self.host, self.port = host, port


#: Seconds between "still waiting" lines while a store does not answer.
PROGRESS_EVERY_S = 5.0


def wait_for_store(
    host: str,
    port: int,
    timeout: float,
    progress: bool = False,
    interrupt_fd: int | None = None,
    since: float | None = None,
) -> bool:
    """Block until a TCP server accepts at ``host:port`` (True); raise ``StoreUnavailable``
    after ``timeout``.

    Attempts are spaced by a growing back-off: there is no event to wait on for a
    server on another host. ``progress`` (a supervisor): a log line every
    ``PROGRESS_EVERY_S`` says how long it has waited, and why. ``interrupt_fd``: the
    wait returns False as soon as it is readable (the caller reads it, then waits again
    ``since`` the first wait's ``time.monotonic()``, so the timeout still counts from there).
    """
    start = time.monotonic() if since is None else since
    deadline, next_note = start + timeout, start + PROGRESS_EVERY_S
    delay = 0.02
    last_error = ""
    while True:
        now = time.monotonic()
        remaining = deadline - now
        if remaining <= 0:
            raise StoreUnavailable(host, port, timeout, last_error)
        if progress and now >= next_note:
            log.warning(
                "still waiting for the store at %s:%s after %.0f s of %.0f s (%s)",
                host, port, now - start, timeout, last_error or "no answer yet",
            )  # fmt: skip
            next_note = now + PROGRESS_EVERY_S
        try:
            with socket.create_connection((host, port), timeout=min(remaining, 2.0)):
                return True
        except OSError as exc:
            last_error = exc.strerror or str(exc)
        pause = min(delay, max(0.0, deadline - time.monotonic()))
        if interrupt_fd is None:
            time.sleep(pause)
        elif select.select([interrupt_fd], [], [], pause)[0]:
            return False
        delay = min(delay * 2, 0.5)


class StoreService:
    """Starts, watches and stops a store server process (own process group)."""

    def __init__(
        self,
        host: str,
        port: int,
        job_id: str | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        node: int | None = 0,
        snapshot: SnapshotSpec | None = None,
        held: bool = False,
    ) -> None:
        """``held``: the launched process imports torch, then waits for ``release`` before it
        binds, restores the snapshot and serves (a store kept ready for a failover)."""
        if not 0 <= int(port) <= 65535:
            raise ValueError(f"store port must be in 0..65535, got {port}")
        self.host = host
        self._requested_port = int(port)
        self.port = int(port)
        self.job_id = job_id
        self.log_dir = log_dir
        self.node = node
        self.snapshot = snapshot
        self.held = held
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready_fd: int | None = None
        self._release_fd: int | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = _READY_TIMEOUT_S) -> StoreService:
        """Start the server and return once it accepts connections."""
        return self.launch().wait_started(timeout)

    def launch(self) -> StoreService:
        """Start the server process; ``wait_started`` waits until it accepts connections.

        Apart, so that a caller can do other work while the server imports torch.
        """
        if self._proc is not None:
            raise RuntimeError("store service already started")
        if self._requested_port and not store_port_is_free(self.host, self._requested_port):
            raise StorePortInUse(self.host, self._requested_port)
        read_fd, write_fd = os.pipe()
        cmd = [
            sys.executable,
            "-m",
            "nvrx.store.service",
            "--host",
            self.host,
            "--port",
            str(self._requested_port),
            "--ready-fd",
            str(write_fd),
            "--parent-pid",
            str(os.getpid()),
            *(self.snapshot.argv() if self.snapshot is not None else ()),
            *(["--held"] if self.held else []),
        ]
        env = dict(os.environ)
        if self.job_id is not None:
            env[jobenv.JOB_ID] = str(self.job_id)
        if self.log_dir is not None:
            env[jobenv.LOG_DIR] = str(self.log_dir)
        if self.node is not None:
            env[jobenv.NODE_RANK] = str(self.node)
        env.pop("RANK", None)
        hold_r, hold_w = os.pipe() if self.held else (subprocess.DEVNULL, None)
        try:
            self._proc = processes.start(cmd, env=env, pass_fds=(write_fd,), stdin=hold_r)
        except BaseException:
            os.close(read_fd)
            if hold_w is not None:
                os.close(hold_w)
            raise
        finally:
            os.close(write_fd)
            if hold_w is not None:
                os.close(hold_r)
        self._ready_fd, self._release_fd = read_fd, hold_w
        return self

    def release(self) -> StoreService:
        """Let a ``held`` service bind and serve now; ``wait_started`` then waits for it."""
        fd, self._release_fd = self._release_fd, None
        if fd is None:
            raise RuntimeError("store service not held, or released already")
        try:
            os.write(fd, b"serve\n")
        except OSError as exc:  # it died: wait_started reports how
            log.warning("held store service pid %s is gone: %s", self.pid, exc)
        finally:
            os.close(fd)
        return self

    @property
    def starting(self) -> bool:
        """Launched, and ``wait_started`` not called yet."""
        return self._ready_fd is not None

    def wait_started(self, timeout: float = _READY_TIMEOUT_S) -> StoreService:
        """Return once the launched server accepts connections; RuntimeError when it cannot."""
        read_fd, self._ready_fd = self._ready_fd, None
        if read_fd is None:
            raise RuntimeError("store service not launched, or waited for already")
        try:
            message = self._read_ready(read_fd, timeout)
        finally:
            os.close(read_fd)
        if message.get("error") == "in_use":
            self._reap()
            raise StorePortInUse(self.host, self._requested_port)
        if "port" not in message:
            self.stop()
            raise RuntimeError(
                f"store service at {self.host}:{self._requested_port} failed to start: "
                f"{message.get('error', 'no answer')}"
            )
        self.port = int(message["port"])
        log.info("store service pid %s serving %s:%s", self.pid, self.host, self.port)
        return self

    def _read_ready(self, fd: int, timeout: float) -> dict:
        """Read the child's one-line JSON status, or report its early exit."""
        result: dict = {}
        done = threading.Event()

        def reader() -> None:
            chunks = []
            with contextlib.suppress(OSError):
                while True:
                    chunk = os.read(fd, 4096)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    if b"\n" in chunk:
                        break
            raw = b"".join(chunks).decode(errors="replace").strip()
            if raw:
                with contextlib.suppress(ValueError):
                    result.update(json.loads(raw.splitlines()[0]))
            done.set()

        thread = threading.Thread(target=reader, name="nvrx-store-ready", daemon=True)
        thread.start()
        if not done.wait(timeout):
            return {"error": f"not ready after {timeout:g} s"}
        if not result and self._proc is not None:
            code = self._proc.wait(timeout=5)
            return {"error": f"exited with code {code} before it was ready"}
        return result

    def _reap(self) -> None:
        if self._proc is not None:
            processes.wait(self._proc, 5)

    def stop(self, timeout: float = 5.0) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL of its group) and return its exit code."""
        proc, self._proc = self._proc, None
        if self._ready_fd is not None:
            os.close(self._ready_fd)
            self._ready_fd = None
        if self._release_fd is not None:  # a held service reads the end of its stdin and exits
            os.close(self._release_fd)
            self._release_fd = None
        return None if proc is None else processes.stop(proc, grace_s=timeout)

    def __enter__(self) -> StoreService:
        return self.start() if self._proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    from .server_process import main

    processes.exit_now(main())
