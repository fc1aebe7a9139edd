"""Warm standbys: training processes started ahead of need, with torch already imported.

A spare node has nothing to do until it takes over a lost node, and then its
children's first seconds go to starting Python and importing torch while the
whole job waits for them. So a spare's supervisor starts one standby per local
rank at once (``standby_process``): each imports torch (and starts the
Wrapper's monitor process ahead) and waits. So does every supervisor when a
store failover begins, while the new store comes up. At takeover the
supervisor hands each standby the rank's environment and command, and the
standby runs the script as ``__main__``, as a fresh interpreter would.

A process restart waits the same way: once its children train, every
training supervisor keeps one more standby, for whichever local rank it restarts
next (``Standbys.keep_ready``; when and why: ``restart_standby``).

What must hold for a script to run in a standby:

* the command is ``<python> script.py ...`` or ``<python> -m module ...`` (the
  first word's file name starts with ``python``; no interpreter options): any
  other command starts cold, as does a rank whose standby has died;
* what is read at interpreter start and at ``import torch`` (``PYTHON*``,
  ``OMP_NUM_THREADS``, ``MKL_*``, ``TORCH_*`` variables) comes from the
  environment the supervisor gave the standby (local rank 0's), not from the
  rank's own;
* the script does not rely on a fresh interpreter: the modules imported ahead
  (``standby_process.WARM_IMPORTS``: torch, torch.distributed, torch._dynamo,
  nvrx.inprocess, and what they import) are not imported again, so their
  module-level code does not run for the rank, and a traceback shows the
  standby's frames above the script's.

``--no-warm-standby`` (``NVRX_WARM_STANDBY=0``) starts every process cold.

A standby's streams are routed from its start as its local rank's are
(``--redirects``/``--tee``): what it prints before it becomes a rank waits in the
pipe and goes to that rank's files (for a standby for restarts, once it knows
which rank: ``rank_output``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import selectors
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import psutil

from nvrx import processes

from .children import Child
from .rank_logs import RankLogs
from .rank_output import DRAIN_TIMEOUT_S, RankOutput, write_all
from .standby_process import FD_ENV, READY_FD_ENV

log = logging.getLogger(__name__)

MODULE = "nvrx.supervisor.standby_process"
#: Pipe size asked for (Linux allows up to /proc/sys/fs/pipe-max-size, 1 MiB by default).
PIPE_BYTES = 1 << 20
#: Deaths of a restart standby before it was needed after which restarts start cold.
MAX_DEATHS = 3
#: The selector key of the restart standby's "warm" descriptor (``Standbys.register``).
READY_KEY = "standby_ready"


def can_run(command: Sequence[str]) -> bool:
    """Whether ``command`` runs a Python script or module that a standby can take over."""
    if len(command) < 2 or not os.path.basename(command[0]).startswith("python"):
        return False
    if command[1] == "-m":
        return len(command) >= 3 and not command[2].startswith("-")
    return not command[1].startswith("-")


class Standby:
    """One waiting process: started with ``start``, made a rank's child with ``activate``.

    It says when it is warm (its imports and its monitor's are done) by one byte on
    ``ready_fd`` (``poll_ready``)."""

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
        self.ready_fd, ready_write = os.pipe()
        os.set_blocking(self.ready_fd, False)
        self._warm: bool | None = None  # True: it said so; False: it ended without saying it
        self.started = time.monotonic()
        try:
            self.proc = processes.start(
                [python, "-m", MODULE],
                env={**env, FD_ENV: str(read_end), READY_FD_ENV: str(ready_write)},
                pass_fds=(read_end, ready_write),
                die_with_parent=True,
                **(output.popen_args() if output is not None else {}),
            )
        except BaseException:
            self._close()
            if output is not None:
                output.close(time.monotonic() + DRAIN_TIMEOUT_S)
            raise
        finally:
            os.close(read_end)
            os.close(ready_write)
            if output is not None:
                output.started()
        self.pid = self.proc.pid

    @property
    def warm(self) -> bool | None:
        """What ``poll_ready`` last found, without looking again."""
        return self._warm

    def poll_ready(self) -> bool | None:
        """Whether it is warm: True once it said so, False when it ended without saying
        it, None while its imports go on (never blocks)."""
        if self._warm is None and self.ready_fd >= 0:
            try:
                self._warm = os.read(self.ready_fd, 1) == b"1"
            except BlockingIOError:
                pass
        return self._warm

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
            self.output.attach(directory, int(env.get("RANK", local_rank)), local_rank)
        if self.proc.poll() is not None:
            log.warning(
                "standby pid %d ended (exit %s) before it was needed: starting cold",
                self.pid, self.proc.returncode,
            )  # fmt: skip
            self.discard()
            return None
        message = json.dumps({"argv": list(argv), "env": dict(env)}).encode()
        try:
            write_all(self._write_end, message)
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
        """Not needed after all: end it and its group, reaped, and what it started ahead (the
        Wrapper's monitor process, in a group of its own); its streams drained until
        ``deadline`` (``time.monotonic()``; default: ``DRAIN_TIMEOUT_S`` from now)."""
        self._close()
        if self.proc.returncode is None:  # not reaped yet: the pid, and its children, are its own
            _end_helpers(self.pid)
        processes.stop_all([self.proc], ask=signal.SIGKILL, grace_s=0.0)
        if self.output is not None:
            self.output.close(deadline or time.monotonic() + DRAIN_TIMEOUT_S)

    def _close(self) -> None:
        if self._write_end >= 0:
            os.close(self._write_end)
            self._write_end = -1
        if self.ready_fd >= 0:
            os.close(self.ready_fd)
            self.ready_fd = -1


def _end_helpers(pid: int) -> None:
    """SIGKILL the groups led by the children of live standby ``pid`` (the monitor it started
    ahead: no pid reuse before it reaps them); init reaps them once the standby is gone."""
    try:
        helpers = psutil.Process(pid).children()
    except psutil.Error:
        return
    for helper in helpers:
        with contextlib.suppress(OSError):
            if os.getpgid(helper.pid) == helper.pid:
                processes.signal_group(helper.pid, signal.SIGKILL)


class Standbys:
    """The standbys of one supervisor, each used at most once: one per local rank (``start``)
    and one for the next restart of any local rank (``keep_ready``)."""

    def __init__(self, enabled: bool = True, logs: RankLogs | None = None) -> None:
        self.enabled = enabled  # off: every child starts cold (``--no-warm-standby``)
        self.logs = RankLogs() if logs is None else logs
        self._waiting: dict[int, Standby] = {}
        self._for_restart: Standby | None = None
        self._deaths = 0  # restart standbys that died (or could not start) before they were needed
        self._selector: selectors.BaseSelector | None = None  # watches it until it is warm
        #: Told once for each standby for restarts that became warm: its pid and the seconds
        #: it took, by whichever look saw it first (``on_ready``, or a restart that takes it).
        self.on_warm: Callable[[int, float], None] | None = None
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

    def keep_ready(
        self, command: Sequence[str], env: Callable[[], Mapping[str, str]], local_ranks: range
    ) -> int | None:
        """Have a standby wait for the next restart of any of ``local_ranks`` (started with
        ``env()``): the pid of one started now, None when one waits already or none can."""
        if not self.enabled or self._deaths >= MAX_DEATHS:
            return None
        if not can_run(command):
            log.info("no warm standby for restarts: %r is not 'python script.py' or "
                     "'python -m module'", command[:2])  # fmt: skip
            self._deaths = MAX_DEATHS  # said once
            return None
        standby = self._for_restart
        if standby is not None and standby.proc.poll() is None:
            return None
        if standby is not None:
            if standby.output is not None:  # why it ended, on a stream that had no rank's files
                standby.output.show(f"[standby {standby.pid}]:".encode())
            self._drop_restart_standby()
            self._died(f"ended (exit {standby.proc.returncode}) before it was needed")
            if self._deaths >= MAX_DEATHS:
                return None
        try:  # either cleans up what it made when it fails
            self._for_restart = Standby(command[0], env(), RankOutput(self.logs, None, local_ranks))
        except OSError as exc:
            self._died(f"cannot be started: {exc}")
            return None
        self._watch_ready()
        return self._for_restart.pid

    def _died(self, what: str) -> None:
        self._deaths += 1
        final = self._deaths >= MAX_DEATHS
        log.warning(
            "the warm standby for restarts %s (%d of %d)%s", what, self._deaths, MAX_DEATHS,
            ": restarts start cold from now on" if final else ": starting another",
        )  # fmt: skip

    def register(self, selector: selectors.BaseSelector) -> None:
        """Have ``selector`` (each new one of the supervisor's loop) report when the restart
        standby, this one or the next ones, is warm (key ``READY_KEY``)."""
        self._selector = selector
        self._watch_ready()

    def _watch_ready(self) -> None:
        standby = self._for_restart
        if self._selector is None or standby is None or standby.warm is not None:
            return
        if standby.ready_fd >= 0:
            self._selector.register(standby.ready_fd, selectors.EVENT_READ, READY_KEY)

    def on_ready(self) -> None:
        """The restart standby's descriptor is readable: it is warm (``on_warm`` is told), or
        it ended without (``keep_ready`` replaces it)."""
        standby = self._for_restart
        if standby is not None:
            self._unwatch(standby)
            self._is_warm(standby)

    def _is_warm(self, standby: Standby) -> bool:
        """Whether the restart standby is warm; the look that finds it first tells ``on_warm``."""
        seen = standby.warm is not None
        if standby.poll_ready() and not seen and self.on_warm is not None:
            self.on_warm(standby.pid, time.monotonic() - standby.started)
        return bool(standby.warm)

    def _unwatch(self, standby: Standby) -> None:
        if self._selector is not None and standby.ready_fd >= 0:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(standby.ready_fd)

    def _drop_restart_standby(self, deadline: float | None = None) -> None:
        standby, self._for_restart = self._for_restart, None
        if standby is not None:
            self._unwatch(standby)
            standby.discard(deadline)

    def _take_warm(self, local_rank: int) -> Standby | None:
        """The restart standby, if it is warm: one still importing stays for a later restart
        (the rank starts cold: a standby is never slower than a fresh interpreter)."""
        standby = self._for_restart
        if standby is None:
            return None
        if not self._is_warm(standby):
            why = "is not warm yet" if standby.warm is None else "ended before it was warm"
            log.info("the standby for restarts (pid %d) %s: local rank %d starts cold",
                     standby.pid, why, local_rank)  # fmt: skip
            return None
        self._unwatch(standby)
        self._for_restart = None
        return standby

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
        standby = self._take_warm(local_rank) if child is None else None
        if standby is not None:
            try:
                child = standby.activate(command, env, local_rank, attempt, directory)
            except BaseException:
                standby.discard()
                raise
            self._deaths += child is None  # it had died: counts towards going cold
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
        spare = [] if self._for_restart is None else [self._for_restart.pid]
        return [s.pid for s in self._waiting.values()] + spare

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
        self._drop_restart_standby(deadline)
        for standby in self._waiting.values():
            standby.discard(deadline)
        self._waiting.clear()
