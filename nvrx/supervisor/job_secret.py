"""The job's secret, as every supervisor of the job gets it, and the job's private folder.

In this order: ``$NVRX_JOB_SECRET`` (``nvrx-srun`` sets a fresh one for the job step, or
the user sets it for supervisors started by hand), else the file ``secret`` in the job's
folder (``<log dir>/<job id>``, the folder every node writes its events to): slot 0 creates
it (owner-only, once) and the other slots wait for it. Either way the supervisor takes the
variable out of its environment, so that nothing it starts (its node agent, the store,
standbys, training ranks) inherits it; they get ``$NVRX_JOB_SECRET_FILE`` instead, the path
of an owner-only file that holds it (``share``), and read it only to seal and check the
control values (``docs/security.md``). The job's folder is made owner-only: nobody else reads the
secret, the events or the rank logs there.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from pathlib import Path

from nvrx import jobenv
from nvrx.store.seal import new_secret, parse_secret, read_secret_file

from .config import ConfigError, SupervisorConfig

SECRET_FILE = "secret"
#: Seconds between two looks for slot 0's secret file (a file's creation wakes no one here).
LOOK_S = 0.05
#: Longest wait for it: slot 0 writes it before its store starts, so a slot that reached the
#: store and still finds no file sees another folder than slot 0's.
MAX_WAIT_S = 30.0


def private_job_dir(directory: Path) -> None:
    """Make ``directory`` (the job's folder) and keep it to its owner (mode 0700);
    ``ConfigError`` when it cannot be made (a read-only place, a file in its path) or is
    another user's or a link."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        info = os.lstat(directory)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the job folder {directory}: {exc.strerror or exc}; choose another --log-dir"
        ) from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ConfigError(
            f"the job folder {directory} must be a folder of this user (uid {os.getuid()}), "
            f"not a link or another user's (owner uid {info.st_uid}): choose another --log-dir or --job-id"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
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
    try:
        if cfg.node_rank == 0:
            _create(path)
        return _read(path, time.monotonic() + (min(cfg.store_timeout, MAX_WAIT_S) if wait else 0.0))
    except OSError as exc:
        raise ConfigError(f"cannot keep the job's secret in {path}: {exc.strerror or exc}") from None


def share(cfg: SupervisorConfig, given: bytes | None, private_dir: str) -> Path:
    """Tell the processes this supervisor starts where the job's secret is
    (``$NVRX_JOB_SECRET_FILE``, set in this process's environment, which they inherit):
    the job folder's file, or, for a secret ``given`` in the environment, an owner-only
    copy in ``private_dir`` (this supervisor's runtime folder, removed with it)."""
    path = (cfg.events_dir / SECRET_FILE).absolute()  # a rank may change its directory
    if given is not None:
        path = Path(private_dir).absolute() / SECRET_FILE
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(given.hex())
        except OSError as exc:
            raise ConfigError(f"cannot keep the job's secret in {path}: {exc.strerror or exc}") from None
    os.environ[jobenv.JOB_SECRET_FILE] = str(path)
    return path


def _create(path: Path) -> None:
    """Write a new secret to ``path`` unless it exists (a requeued run keeps the job's):
    written whole beside it first, then linked in, so no reader sees half of it."""
    draft = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        draft.unlink()  # left by a process of this pid killed in here: never followed
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(new_secret())
        out.flush()
        os.fsync(out.fileno())
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
    try:
        return read_secret_file(path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


__all__ = ["SECRET_FILE", "private_job_dir", "resolve", "share"]
