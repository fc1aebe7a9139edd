"""How the local test cluster fails: its two exceptions and the bounded wait.

``wait_for`` polls a daemon's state until a condition holds and turns a
timeout into ``ClusterError``; ``tail`` quotes a log in such a message.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from nvrx.slurm.commands import SlurmCommandError


class ClusterUnavailable(RuntimeError):
    """The cluster cannot run here at all (not root, no apt); tests should skip."""


class ClusterError(RuntimeError):
    """The cluster failed to start, stop or answer; the message says where to look."""


def wait_for(
    what: str, condition: Callable[[], bool], timeout: float, interval: float = 0.2
) -> None:
    """Poll an external daemon's state until ``condition()`` holds; raise ClusterError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            if condition():
                return
        except (OSError, SlurmCommandError, subprocess.SubprocessError) as err:
            last_error = err
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise ClusterError(f"timed out after {timeout:g} s waiting for {what}{detail}")
        time.sleep(interval)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as err:
        return f"({path}: {err})"
