"""Training children: start each in its own process group, signal and kill the group, reap it.

A child is the user's command exec'd by ``subprocess.Popen`` (fork+exec in C),
so no Python or torch state of the supervisor leaks into it; ``fork_and_monitor``
forks its children instead. Either way ``nvrx.processes`` starts, signals and
reaps them.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nvrx import processes
from nvrx.events import writer
from nvrx.events.reader import ProcessKey

from .rank_output import RankOutput


@dataclass(frozen=True)
class ExitStatus:
    """How a child ended: an exit code, or the signal that killed it."""

    code: int | None
    signal: int | None

    @classmethod
    def from_returncode(cls, returncode: int) -> ExitStatus:
        if returncode < 0:
            return cls(None, -returncode)
        return cls(returncode, None)

    @property
    def signal_name(self) -> str | None:
        if self.signal is None:
            return None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"SIG{self.signal}"

    @property
    def ok(self) -> bool:
        return self.code == 0

    def __str__(self) -> str:
        return (
            f"killed by {self.signal_name}" if self.signal is not None else f"exit code {self.code}"
        )


class Child:
    """One training process of a local rank and its process group."""

    def __init__(self, local_rank: int, attempt: int, proc: processes.Process) -> None:
        self.local_rank = local_rank
        self.attempt = attempt
        self.proc = proc
        self.pid = proc.pid
        self.started = time.monotonic()
        #: Where its events are (``key``): the node rank it was started as (``NVRX_NODE_RANK``,
        #: which names its event files) and a wall time from before its start (``LocalRanks``
        #: sets both).
        self.node: int | None = None
        self.since = time.time()
        self.status: ExitStatus | None = None
        self.warm = False  # a standby became this child (``standby``)
        #: It tells how far it is: its Wrapper monitor beat (``restart_standby`` waits for
        #: such a child until it trains).
        self.tells = False
        #: It told it trains: its Wrapper monitor beat from a round, or a fault-tolerance
        #: client connected.
        self.training = False
        self.output: RankOutput | None = None  # its streams, when routed (``rank_output``)
        self.directory: Path | None = None  # its error file and log files (``rank_logs``)

    @classmethod
    def spawn(
        cls,
        command: Sequence[str],
        env: Mapping[str, str],
        local_rank: int,
        attempt: int,
        cwd: str | None = None,
        output: RankOutput | None = None,
    ) -> Child:
        """Start ``command`` leading its own process group. Raises OSError when it cannot start.

        The child dies with the supervisor: a supervisor killed by SIGKILL (how a
        lost node looks from inside) leaves no training process running on.
        ``output`` routes its streams; inherited when None.
        """
        stdio = output.popen_args() if output is not None else {}
        try:
            proc = processes.start(command, env=env, cwd=cwd, die_with_parent=True, **stdio)
        finally:
            if output is not None:
                output.started()
        child = cls(local_rank, attempt, proc)
        child.output = output
        return child

    @classmethod
    def forked(cls, local_rank: int, attempt: int, pid: int) -> Child:
        """A child this process made with ``processes.fork`` (it leads its own process group)."""
        return cls(local_rank, attempt, processes.ForkedProcess(pid))

    @property
    def key(self) -> ProcessKey:
        """Which events are this child's: its pid's, of its node, written since it started, on
        this host (its pid may be another node's process's, or an earlier run's, or that of
        a cut-off host's process of the node rank this one took over)."""
        return ProcessKey(self.pid, self.node, self.since, writer.this_boot())

    @property
    def running(self) -> bool:
        return self.status is None

    @property
    def runtime_s(self) -> float:
        return time.monotonic() - self.started

    def poll(self) -> ExitStatus | None:
        """Reap the child if it has ended (non-blocking); its status, or None while running."""
        if self.status is None:
            rc = self.proc.poll()
            if rc is not None:
                self.status = ExitStatus.from_returncode(rc)
        return self.status

    def signal_group(self, signum: int) -> bool:
        """Send ``signum`` to the child's whole process group; False when the group is gone."""
        return processes.signal_group(self.pid, signum)

    def kill_group(self) -> None:
        """SIGKILL the whole process group, including grandchildren the command left behind."""
        self.signal_group(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> ExitStatus | None:
        """Block until the child ends, at most ``timeout`` seconds; None on timeout."""
        if self.status is None:
            rc = processes.wait(self.proc, timeout)
            if rc is not None:
                self.status = ExitStatus.from_returncode(rc)
        return self.status


def stop_children(
    children: Sequence[Child],
    grace_s: float,
    exit_by: float | None = None,
    ask: int = signal.SIGTERM,
) -> None:
    """The supervisor's one way to stop children: every group at once, ``ask`` (SIGTERM), SIGKILL
    after ``grace_s``, reaped (``poll`` then tells each status, to be recorded as usual).

    ``exit_by`` (``time.monotonic()``) first lets them exit by themselves until
    then: after SLURM's warning they checkpoint and return on their own.
    Already ended children lose their leftover group members too.
    """
    running = [c for c in children if c.running]
    processes.stop_all([c.proc for c in running], ask=ask, grace_s=grace_s, exit_by=exit_by)
