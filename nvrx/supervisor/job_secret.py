"""The job's secret, as every supervisor of the job gets it, and the job's private folder.

In this order: ``$NVRX_JOB_SECRET`` (``nvrx-srun`` sets a fresh one for the job step, or
the user sets it for supervisors started by hand), else the file ``secret`` in the job's
folder (``<log dir>/<job id>``, the folder every node writes its events to): slot 0 creates
it (owner-only, once) and the other slots wait for it. Either way the supervisor takes the
variable out of its environment, so that nothing it starts (its store agent, the store,
standbys, training ranks) inherits it. The job's folder is made owner-only: nobody else
reads the secret, the events or the rank logs there.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from pathlib import Path

from nvrx import jobenv
from nvrx.store.seal import new_secret, parse_secret

from .config import ConfigError, SupervisorConfig

SECRET_FILE = "secret"
#: Seconds between two looks for slot 0's secret file (a file's creation wakes no one here).
LOOK_S = 0.05


def private_job_dir(directory: Path) -> None:
    """Make ``directory`` (the job's folder) and keep it to its owner (mode 0700)."""
    directory.mkdir(parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) != 0o700:
        directory.chmod(0o700)


def resolve(cfg: SupervisorConfig, wait: bool = True) -> bytes:
    """The job's secret (see the module); ``ConfigError`` naming what to fix. ``wait``:
    wait for slot 0's file up to the store timeout, else look once."""
    given = os.environ.pop(jobenv.JOB_SECRET, None)
    if given:
        try:
            return parse_secret(given, f"${jobenv.JOB_SECRET}")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    path = cfg.events_dir / SECRET_FILE
    if cfg.node_rank == 0:
        _create(path)
    return _read(path, time.monotonic() + (cfg.store_timeout if wait else 0.0))


def _create(path: Path) -> None:
    """Write a new secret to ``path`` unless it exists (a requeued run keeps the job's):
    written whole beside it first, then linked in, so no reader sees half of it."""
    draft = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(new_secret())
    try:
        with contextlib.suppress(FileExistsError):
            os.link(draft, path)
    finally:
        draft.unlink()


def _read(path: Path, deadline: float) -> bytes:
    while not path.exists():
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"no job secret: ${jobenv.JOB_SECRET} is not set and slot 0 wrote no {path} "
                "(set the variable alike on every node, or put the log folder on a file "
                "system every node shares)"
            )
        time.sleep(LOOK_S)
    info = path.stat()
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise ConfigError(f"{path} must be this user's and owner-only (mode 0600)")
    try:
        return parse_secret(path.read_text(), str(path))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


__all__ = ["SECRET_FILE", "private_job_dir", "resolve"]
