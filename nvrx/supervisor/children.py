"""Training children: start each in its own process group, signal and kill the group, reap it.

A child is the user's command exec'd by ``subprocess.Popen`` (fork+exec in C),
so no Python or torch state of the supervisor leaks into it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nvrx.checkpoint_flag import ignore_warning_signal

log = logging.getLogger(__name__)


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

    @classmethod
    def from_wait_status(cls, status: int) -> ExitStatus:
        if os.WIFSIGNALED(status):
            return cls(None, os.WTERMSIG(status))
        return cls(os.WEXITSTATUS(status), None)

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

    def __init__(
        self, local_rank: int, attempt: int, pid: int, popen: subprocess.Popen[bytes] | None = None
    ) -> None:
        self.local_rank = local_rank
        self.attempt = attempt
        self.popen = popen
        self.pid = pid
        self.started = time.monotonic()
        self.status: ExitStatus | None = None

    @classmethod
    def spawn(
        cls,
        command: Sequence[str],
        env: Mapping[str, str],
        local_rank: int,
        attempt: int,
        cwd: str | None = None,
    ) -> Child:
        """Start ``command`` in a new session (its own process group). Raises OSError when it cannot start."""
        popen = subprocess.Popen(
            list(command),
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
            preexec_fn=ignore_warning_signal,  # SLURM signals every process of the step
        )
        return cls(local_rank, attempt, popen.pid, popen)

    @property
    def running(self) -> bool:
        return self.status is None

    @property
    def runtime_s(self) -> float:
        return time.monotonic() - self.started

    def poll(self) -> ExitStatus | None:
        """Reap the child if it has ended (non-blocking); its status, or None while running."""
        if self.status is None:
            if self.popen is not None:
                rc = self.popen.poll()
                if rc is not None:
                    self.status = ExitStatus.from_returncode(rc)
            else:
                pid, wait_status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    self.status = ExitStatus.from_wait_status(wait_status)
        return self.status

    def signal_group(self, signum: int) -> bool:
        """Send ``signum`` to the child's whole process group; False when the group is gone."""
        try:
            os.killpg(self.pid, signum)
            return True
        except ProcessLookupError:
            return False
        except PermissionError as exc:
            log.warning(
                "cannot signal process group %d of local rank %d: %s",
                self.pid,
                self.local_rank,
                exc,
            )
            return False

    def kill_group(self) -> None:
        """SIGKILL the whole process group, including grandchildren the command left behind."""
        self.signal_group(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> ExitStatus | None:
        """Block until the child ends (bounded by ``timeout`` for exec'd children); None on timeout."""
        if self.status is None and self.popen is not None:
            try:
                rc = self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
            self.status = ExitStatus.from_returncode(rc)
        elif self.status is None:
            # A forked child: only waited for after SIGKILL of its group, so no timeout is needed.
            _, wait_status = os.waitpid(self.pid, 0)
            self.status = ExitStatus.from_wait_status(wait_status)
        return self.status


def group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` still exists (zombies excluded where visible)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
