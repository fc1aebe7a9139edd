"""Where the monitors of one host keep their group (``host_group``), and how a group whose
monitors all died is cleared away.

The directory is private to the user, under ``/dev/shm`` (else the temporary
directory), and named after the job's store and the host. Each member holds a
lock on its member file while it lives; the kernel drops it when the process
dies, however it dies. So a member that was killed is told from a live one: the
last live member to leave removes the directory, and a monitor that joins
removes the directories of groups whose members all died (a job whose
processes were SIGKILLed, say). Only directories marked ``HELD`` by this
machine are judged so: an older nvrx's members hold no lock, and another
machine's locks may not be seen here where the root is on a shared file system.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

SOCKET, LEADER, LOCK, MEMBER = "beats.sock", "leader.json", "elect.lock", "member-"
#: Marks a group whose members each hold a lock on their member file while they live.
HELD = "members-hold-locks"

#: Longest path of the group's socket: Linux takes 107 bytes.
MAX_SOCKET_PATH = 100


def _default_root() -> str:
    """``/dev/shm``, else the temporary directory, else ``/tmp`` where that one's path is
    too long for a socket in it."""
    if os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    root = tempfile.gettempdir()
    return root if len(root) <= MAX_SOCKET_PATH - 50 else "/tmp"


def _private_root(root: str | None) -> Path:
    """``<root>/nvrx-<uid>``, a directory of this user's alone (refused otherwise)."""
    root = _default_root() if root is None else root
    Path(root).mkdir(parents=True, exist_ok=True)
    path = Path(root) / f"nvrx-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise RuntimeError(f"{path} must be a directory of user {os.getuid()}, not a link")
    return path


def group_dir(job_key: str, host: str, root: str | None = None) -> Path:
    """The private directory of ``host``'s monitors in the job named by ``job_key`` (under
    ``/dev/shm``, else the temporary directory, unless ``root`` says where)."""
    digest = hashlib.sha1(f"{job_key}\0{host}".encode()).hexdigest()[:16]
    path = _private_root(root) / digest
    _make(path)
    return path


def _make(directory: Path) -> None:
    """Make the group's ``directory``, and its private root again if the last group of the
    root removed that meanwhile (``remove_group``)."""
    while True:
        try:
            directory.mkdir(mode=0o700, exist_ok=True)
            return
        except FileNotFoundError:
            _private_root(str(directory.parent.parent))


def _held(path: Path) -> bool:
    """Whether a live process holds the lock of member file ``path`` (False: it died)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (releases the lock it took, if any)
    return False


def _node() -> str:
    return os.uname().nodename


def mark_held(directory: Path) -> None:
    """Mark ``directory`` as a group whose members hold their locks, made on this machine
    (call it holding the group's lock)."""
    if not (directory / HELD).exists():
        (directory / HELD).write_text(_node())


def _held_here(directory: Path) -> bool:
    """Whether ``directory`` is marked ``HELD`` by this machine: where the private root is on
    a file system that several machines share, their locks may not be seen here."""
    try:
        return (directory / HELD).read_text() == _node()
    except OSError:
        return False


def members(directory: Path) -> tuple[int, int]:
    """How many members of ``directory`` live, and how many had died (their files are
    removed); call it holding the group's lock. Unmarked (``HELD``), every member lives."""
    held = _held_here(directory)
    live = dead = 0
    for path in directory.iterdir():
        if not path.name.startswith(MEMBER):
            continue
        if not held or _held(path):
            live += 1
        else:
            dead += 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return live, dead


@contextlib.contextmanager
def group_locked(directory: Path, create: bool = False, wait: bool = True) -> Iterator[None]:
    """Hold the lock of the group in ``directory``. ``create``: make the directory again if
    the group's last member removed it meanwhile (a lock taken on the file it removed is no
    lock); else that is a FileNotFoundError. ``wait=False``: BlockingIOError while another
    process holds it."""
    while True:
        if create:
            _make(directory)
        try:
            lock = open(directory / LOCK, "a")  # noqa: SIM115 - closed below, or after the yield
        except FileNotFoundError:
            if create:  # removed again between the two calls: make it once more
                continue
            raise
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(lock.fileno()).st_nlink > 0:
                break
        except BaseException:
            lock.close()
            raise
        lock.close()
        if not create:
            raise FileNotFoundError(f"{directory} was removed")
    try:
        yield
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def remove_group(directory: Path) -> None:
    """Remove ``directory`` and what is in it, the lock last (held by the caller)."""
    for path in directory.iterdir():
        if path.name != LOCK:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(directory / LOCK)
    with contextlib.suppress(OSError):
        directory.rmdir()
    with contextlib.suppress(OSError):  # the private root, when this was its last group
        directory.parent.rmdir()


def remove_abandoned(root: Path, keep: Path) -> list[Path]:
    """Remove the group directories under ``root`` (but ``keep``) whose members all died;
    the ones removed. A group whose lock is held at the moment is left for another time."""
    removed: list[Path] = []
    try:
        directories = [d for d in root.iterdir() if d != keep and _held_here(d)]
    except OSError as exc:  # never a reason to fail the join that asked
        log.debug("could not look for abandoned groups in %s: %r", root, exc)
        return removed
    for directory in directories:
        try:
            with group_locked(directory, wait=False):
                if members(directory)[0]:
                    continue
                remove_group(directory)
                removed.append(directory)
        except OSError as exc:  # busy (BlockingIOError), or removed meanwhile
            log.debug("left %s: %r", directory, exc)
    if removed:
        log.info("removed the directories of %d host groups whose monitors all died", len(removed))
    return removed
