"""Warm standbys: training processes started ahead of need, with torch already imported.

A spare node has nothing to do until it takes over a lost node, and then its
children's first seconds go to starting Python and importing torch while the
whole job waits for them. So a spare's supervisor starts one standby per local
rank at once (``standby_process``): each imports torch (and starts the
Wrapper's monitor process ahead) and waits. So does every supervisor when a
store failover begins, while the new store comes up. At takeover the
supervisor hands each standby the rank's environment and command, and the
standby runs the script as ``__main__``, as a fresh interpreter would.

Only a command of the form ``<python> script.py ...`` or ``<python> -m module
...`` (the first word's file name starts with ``python``; no interpreter
options) can run in a standby; any other command starts cold, as does a rank
whose standby has died. A standby's streams are routed from its start as its
local rank's are (``--redirects``/``--tee``): what it prints before it becomes a
rank waits in the pipe and goes to that rank's files. What is read at ``import
torch`` (``OMP_NUM_THREADS``, ``TORCH_*`` variables) comes from the supervisor's
environment, not the rank's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from nvrx import processes

from .children import Child
from .rank_logs import RankLogs
from .rank_output import DRAIN_TIMEOUT_S, RankOutput
from .standby_process import FD_ENV

log = logging.getLogger(__name__)

MODULE = "nvrx.supervisor.standby_process"
#: Pipe size asked for (Linux allows up to /proc/sys/fs/pipe-max-size, 1 MiB by default).
PIPE_BYTES = 1 << 20


def can_run(command: Sequence[str]) -> bool:
    """Whether ``command`` runs a Python script or module that a standby can take over."""
    if len(command) < 2 or not os.path.basename(command[0]).startswith("python"):
        return False
    if command[1] == "-m":
        return len(command) >= 3 and not command[2].startswith("-")
    return not command[1].startswith("-")


class Standby:
    """One waiting process: started with ``start``, made a rank's child with ``activate``."""

    def __init__(
        self, python: str, env: Mapping[str, str], output: RankOutput | None = None
    ) -> None:
        self.output = output
        read_end, self._write_end = os.pipe()
        # The standby reads only after its imports: the activation must fit in the pipe,
        # and a write that does not fit fails (cold start) instead of blocking the supervisor.
        with contextlib.suppress(OSError, AttributeError):
            fcntl.fcntl(self._write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        os.set_blocking(self._write_end, False)
        try:
            self.proc = processes.start(
                [python, "-m", MODULE],
                env={**env, FD_ENV: str(read_end)},
                pass_fds=(read_end,),
                die_with_parent=True,
                **(output.popen_args() if output is not None else {}),
            )
        except BaseException:
            os.close(self._write_end)
            if output is not None:
                output.close(time.monotonic() + DRAIN_TIMEOUT_S)
            raise
        finally:
            os.close(read_end)
            if output is not None:
                output.started()
        self.pid = self.proc.pid

    def activate(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        local_rank: int,
        attempt: int,
        directory: Path | None = None,
    ) -> Child | None:
        """Hand over the rank's command and environment; its Child, or None when the standby is
        gone. What it printed so far goes to the rank's files in ``directory`` either way."""
        if self.output is not None:
            self.output.attach(directory, int(env.get("RANK", local_rank)))
        if self.proc.poll() is not None:
            log.warning(
                "standby pid %d ended (exit %s) before it was needed: starting cold",
                self.pid, self.proc.returncode,
            )  # fmt: skip
            self.discard()
            return None
        message = json.dumps({"argv": list(argv), "env": dict(env)}).encode()
        try:
            _write_all(self._write_end, message)
        except OSError as exc:
            log.warning("standby pid %d cannot take the rank (%s): starting cold", self.pid, exc)
            self.discard()
            return None
        self._close()
        child = Child(local_rank, attempt, self.proc)
        child.warm = True
        child.output = self.output
        return child

    def discard(self, deadline: float | None = None) -> None:
        """Not needed after all: end it and its group, reaped; its streams drained until
        ``deadline`` (``time.monotonic()``; default: ``DRAIN_TIMEOUT_S`` from now)."""
        self._close()
        processes.stop_all([self.proc], ask=signal.SIGKILL, grace_s=0.0)
        if self.output is not None:
            self.output.close(deadline or time.monotonic() + DRAIN_TIMEOUT_S)

    def _close(self) -> None:
        if self._write_end >= 0:
            os.close(self._write_end)
            self._write_end = -1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Standbys:
    """The standbys of one supervisor, one per local rank, each used at most once."""

    def __init__(self, enabled: bool = True, logs: RankLogs | None = None) -> None:
        self.enabled = enabled  # off: every child starts cold (``--no-warm-standby``)
        self.logs = RankLogs() if logs is None else logs
        self._waiting: dict[int, Standby] = {}
        self._outputs: list[RankOutput] = []  # routed streams of the children, drained at the end

    def start(
        self, command: Sequence[str], local_ranks: Iterable[int], env: Mapping[str, str]
    ) -> int:
        """Start a standby for each of ``local_ranks`` that has none; how many wait now (0 when
        ``command`` cannot use them)."""
        if not self.enabled:
            return 0
        if not can_run(command):
            log.info(
                "no warm standby: %r is not 'python script.py' or 'python -m module'", command[:2]
            )
            return 0
        for local_rank in local_ranks:
            if local_rank in self._waiting:
                continue
            try:
                output = RankOutput(self.logs, local_rank)
                self._waiting[local_rank] = Standby(command[0], env, output)
            except OSError as exc:
                log.warning("cannot start a standby for local rank %d: %s", local_rank, exc)
        return len(self._waiting)

    def take(
        self,
        local_rank: int,
        argv: Sequence[str],
        env: Mapping[str, str],
        attempt: int,
        directory: Path | None = None,
    ) -> Child | None:
        """The child of ``local_rank`` from its standby; None when there is none to take."""
        standby = self._waiting.pop(local_rank, None)
        if standby is None:
            return None
        try:
            return standby.activate(argv, env, local_rank, attempt, directory)
        except BaseException:
            standby.discard()
            raise

    def spawn(
        self,
        command: Sequence[str],
        local_rank: int,
        attempt: int,
        env: Mapping[str, str],
        directory: Path | None,
    ) -> Child:
        """The child of ``local_rank``: its standby's, else started cold (OSError when it cannot).

        Its routed streams go to files in ``directory`` (``rank_logs``; None: no files)."""
        child = self.take(local_rank, command, env, attempt, directory)
        if child is None:
            output = None
            try:
                output = RankOutput(self.logs, local_rank)
                child = Child.spawn(command, env, local_rank, attempt, output=output)
            except BaseException:
                if output is not None:
                    output.close(time.monotonic() + DRAIN_TIMEOUT_S)
                raise
            output.attach(directory, int(env["RANK"]))
        if child.output is not None and child.output.pumps:
            self._outputs = [o for o in self._outputs if not o.done()] + [child.output]
        return child

    def pids(self) -> list[int]:
        """The pids of the standbys still waiting."""
        return [s.pid for s in self._waiting.values()]

    def close_outputs(self) -> None:
        """Wait, ``DRAIN_TIMEOUT_S`` at most in all, for the last lines of the children's
        routed streams; after the children ended."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        for output in self._outputs:
            output.close(deadline)
        self._outputs.clear()

    def discard(self) -> None:
        """End every standby not taken."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        for standby in self._waiting.values():
            standby.discard(deadline)
        self._waiting.clear()
