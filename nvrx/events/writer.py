"""Append-only JSON-lines event writer, one file per process.

Each event is one ``write(2)`` on an ``O_APPEND`` descriptor, so an event that
``emit`` returned from is in the kernel and survives a crash of the process
right after it. Events never depend on logging levels, and a failure to write
never raises into training code: it is logged and counted instead.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from nvrx import jobenv, processes

from .schema import SCHEMA_VERSION

log = logging.getLogger(__name__)


_BOOT_ID = processes.boot_id() or socket.gethostname()
# Under SLURM several "nodes" may share one kernel (and name); the node name is what users exclude.
_HOST = os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def this_boot() -> str:
    """What this host's events carry as ``boot``: its kernel's boot id, else its name."""
    return _BOOT_ID


def job_id_from_env(env: dict[str, str] | None = None) -> str:
    """The job id events are filed under (``nvrx.jobenv.job_id_from``)."""
    return jobenv.job_id_from(env)


def job_log_dir(job_id: str | None = None, env: dict[str, str] | None = None) -> Path:
    """Directory holding one job's event files, absolute (``nvrx.jobenv.job_dir``)."""
    return jobenv.job_dir(job_id, env).absolute()


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


def context_from_env(env: dict[str, str] | None = None) -> dict[str, Any]:
    """Default event context of this process, read from the variables nvrx and SLURM set."""
    env = os.environ if env is None else env
    node = _int_or_none(env.get(jobenv.NODE_RANK))
    if node is None:
        node = _int_or_none(env.get("SLURM_NODEID"))
    return {
        "job": job_id_from_env(env),
        "node": node,
        "rank": _int_or_none(env.get("RANK")),
        "round": None,
        "slurm_run": jobenv.slurm_run(env),
    }


def file_name(component: str, node: int | str | None, pid: int, token: str) -> str:
    """The name of one writer's file: ``<component>-n<node>-p<pid>-<token>.jsonl`` (node ``x``
    when none is known); ``token`` keeps two writers of one process apart."""
    return f"{component}-n{'x' if node is None else node}-p{pid}-{token}.jsonl"


def file_glob(pid: int, node: int | None = None, component: str = "*") -> str:
    """The glob of the files process ``pid`` wrote as node ``node`` (None: on any node)."""
    return file_name(component, "*" if node is None else node, pid, "*")


class EventWriter:
    """Writes events of one process to ``<dir>/<component>-n<node>-p<pid>-<token>.jsonl``.

    The context (job, node, rank, round, slurm_run, component) is stamped on every event
    and can change over the life of the process (``update``), for example when
    the Wrapper reassigns ranks or starts a new round.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        component: str,
        context: dict[str, Any] | None = None,
        fsync: bool | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.component = component
        self._context: dict[str, Any] = {
            "job": None, "node": None, "rank": None, "round": None, "slurm_run": None,
        }  # fmt: skip
        self._context.update(context or {})
        self._fsync = os.environ.get(jobenv.EVENTS_FSYNC) == "1" if fsync is None else fsync
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = -1
        self.path: Path | None = None
        self.dropped = 0
        self._torn = False  # a write that failed part way left a line with no newline

    # -- context ------------------------------------------------------------
    @property
    def context(self) -> dict[str, Any]:
        return dict(self._context)

    def update(self, **context: Any) -> None:
        """Change context fields stamped on later events (rank, round, node, ...)."""
        with self._lock:
            self._context.update(context)

    # -- writing --------------------------------------------------------------
    def _open(self) -> int:
        pid = os.getpid()
        if self._fd is not None and self._pid == pid:
            return self._fd
        # A forked child must not share the parent's file: one file per process.
        self.directory.mkdir(parents=True, exist_ok=True)
        node = self._context.get("node")
        self.path = self.directory / file_name(self.component, node, pid, uuid.uuid4().hex[:8])
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._pid, self._torn = pid, False
        return self._fd

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Write one event now and return it. Never raises on I/O errors."""
        event: dict[str, Any] = {
            "kind": kind,  # first: a reader that decodes by kind finds it at once
            "v": SCHEMA_VERSION,
            "wall": time.time(),
            "mono": time.monotonic(),
            "boot": _BOOT_ID,
            "host": _HOST,
            "pid": os.getpid(),
            "component": self.component,
        }
        with self._lock:
            event.update(self._context)
            event.update(fields)
            line = (json.dumps(event, default=str, separators=(",", ":")) + "\n").encode()
            # after a torn line, a newline first: else this event would join it, and a reader
            # would drop both as one malformed line
            try:
                fd = self._open()
                view = memoryview(b"\n" + line if self._torn else line)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                    self._torn = bool(view)
                if self._fsync:
                    os.fsync(fd)
            except OSError as exc:
                self.dropped += 1
                log.warning("could not write %s event to %s: %s", kind, self.directory, exc)
        return event

    def close(self) -> None:
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                os.close(self._fd)
            self._fd = None


_default: EventWriter | None = None
_default_lock = threading.Lock()


def _reset_after_fork() -> None:
    global _default_lock
    _default_lock = threading.Lock()
    if _default is not None:
        _default._lock = threading.Lock()
        _default._fd = None  # the child opens its own file on its first event


os.register_at_fork(after_in_child=_reset_after_fork)


def configure(
    component: str, directory: str | os.PathLike[str] | None = None, **context: Any
) -> EventWriter:
    """Set up this process's writer. Context not given is read from the environment."""
    global _default
    ctx = context_from_env()
    ctx.update(context)
    with _default_lock:
        if _default is not None:
            _default.close()
        _default = EventWriter(directory or job_log_dir(ctx["job"]), component, ctx)
        return _default


def get_writer(component: str = "app") -> EventWriter:
    """This process's writer, configured from the environment on first use."""
    with _default_lock:
        writer = _default
    return writer if writer is not None else configure(component)


def emit(kind: str, **fields: Any) -> dict[str, Any]:
    """Write one event through this process's writer."""
    return get_writer().emit(kind, **fields)
