"""This node's children, one per local rank: their starts and restarts, and their ends.

Each local rank has one child at a time (its latest) and a restart count
(``NVRX_RESTART_COUNT``). A start prepares the rank's log directory
(``rank_logs``) and records ``child_start`` (and ``rejoin`` for a restart:
how long the rank was gone); an end records ``child_exit``. What follows an
end (restart, stop) is the supervisor's decision.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from nvrx import events
from nvrx.events.reader import ProcessKey

from . import rank_logs
from .children import Child, ExitStatus
from .job_store import JobStore

log = logging.getLogger(__name__)

#: Starts the child of a local rank: ``spawn(local_rank, attempt, env, directory) -> Child``
#: (``directory``: where its log files go, ``rank_logs``; None: nowhere).
Spawner = Callable[[int, int, dict, Path | None], Child]


class CannotSpawn(Exception):
    """A child could not be started (its command is missing, or no process can be made)."""


def why_not_started(program: str, exc: OSError) -> str:
    """Why ``program`` could not be started, for one line. ENOENT for a file that exists is
    the kernel not finding what runs it: for a script, the interpreter its ``#!`` line names,
    which is named here (the bare "No such file or directory" points at the script)."""
    reason = exc.strerror or str(exc)
    path = program if os.sep in program else shutil.which(program)
    if exc.errno != errno.ENOENT or path is None or not os.path.isfile(path):
        return reason
    try:
        with open(path, "rb") as script:
            first = script.readline(512)
    except OSError:
        return reason
    words = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    if not words:
        return f"{reason} (the file exists: the program loader it needs is missing)"
    if not os.path.exists(words[0]):
        return f"its interpreter {words[0]!r} (the #! line of {path}) does not exist"
    return f"{reason} (the #! line of {path} names {words[0]!r}, which cannot be run)"


class LocalRanks:
    """The children of this node's local ranks, and their restart counts."""

    def __init__(self, store: JobStore, spawn: Spawner, emit: Callable[..., None]) -> None:
        self.store, self._spawn, self._emit = store, spawn, emit
        self.children: dict[int, Child] = {}  # local rank -> its latest child
        self.restarts: dict[int, int] = dict.fromkeys(range(store.config.nproc_per_node), 0)
        self._exit_seen: dict[int, float] = {}  # local rank -> when its last child's end was seen

    def start(self, local_rank: int, node_rank: int | None, extra_env: dict[str, str]) -> None:
        """Start the child of ``local_rank`` (its restart count is its attempt), with
        ``extra_env`` over the job's environment; raises ``CannotSpawn``."""
        cfg = self.store.config
        attempt = self.restarts[local_rank]
        env = cfg.child_env(local_rank, attempt, node_rank=node_rank)
        env.update(extra_env)
        rank = cfg.rank(local_rank, node_rank)
        job_dir = cfg.events_dir
        directory = rank_logs.prepare_dir(job_dir, rank, attempt, cfg.node_rank)
        if directory is not None:
            env[rank_logs.ERROR_FILE_ENV] = str(directory / rank_logs.ERROR_FILE)
        since = time.time()  # before it runs: what its pid wrote earlier is another process's
        try:
            child = self._spawn(local_rank, attempt, env, directory)
        except OSError as exc:
            raise CannotSpawn(f"cannot start {cfg.command[0]!r}: {why_not_started(cfg.command[0], exc)}") from exc
        self.children[local_rank] = child
        child.directory = directory
        child.node, child.since = events.context_from_env(env)["node"], since
        ids = {"local_rank": local_rank, "child_pid": child.pid, "global_rank": rank}
        files = None if directory is None else str(directory.relative_to(job_dir))
        self._emit("child_start", **ids, attempt=attempt, warm=child.warm, files=files)
        if attempt > 0:
            exited = self._exit_seen.pop(local_rank, None)
            wait_s = None if exited is None else round(time.monotonic() - exited, 6)
            self._emit("rejoin", **ids, phase="replacement_started", wait_s=wait_s)

    def key(self, local_rank: int, pid: int) -> ProcessKey:
        """Which events are those of child ``pid`` of ``local_rank`` (``Child.key``); a pid
        that is no longer the rank's child: that pid's on any node, at any time."""
        child = self.children.get(local_rank)
        return child.key if child is not None and child.pid == pid else ProcessKey(pid)

    def running(self) -> list[Child]:
        """The children still running."""
        return [c for c in self.children.values() if c.running]

    def told(self, pid: int, training: bool) -> None:
        """The running child ``pid`` told of itself (``Child.tells``): that it trains or,
        with ``training`` False, only that it will tell when it does."""
        for child in self.running():
            if child.pid == pid:
                child.tells = True
                child.training = child.training or training

    def reap(self, node_rank: int | None, ended: Callable[[int, ExitStatus, int], None]) -> None:
        """Record each child that ended, then call ``ended(local_rank, status, pid)`` for it
        (before the next one is looked at: what it decides may start a child)."""
        cfg = self.store.config
        for local_rank, child in list(self.children.items()):
            if not child.running or child.poll() is None:
                continue
            status = child.status
            assert status is not None
            self._exit_seen[local_rank] = time.monotonic()
            child.kill_group()  # whatever the command left behind in its group
            self._emit(
                "child_exit", local_rank=local_rank, child_pid=child.pid, exit_code=status.code,
                signal=status.signal_name, runtime_s=round(child.runtime_s, 6), attempt=child.attempt,
                global_rank=cfg.rank(local_rank, node_rank),
                error_file=rank_logs.error_file(child.directory, cfg.events_dir),
            )  # fmt: skip
            log.info("local rank %d (pid %d) ended: %s", local_rank, child.pid, status)
            ended(local_rank, status, child.pid)
