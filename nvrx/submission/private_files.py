"""Files that submission unpickles: written owner-only, and read only when they are the user's.

Unpickling a file runs whatever code it names, so a file another user could have written
must never be loaded: the call a job runs (``call_spec``) and each rank's result
(``run_callable``) are written with mode 0o600 into directories of mode 0o700, and before
one is read, it and its directory must belong to the reading user and be writable by
nobody else (``check_private``): a job folder on a shared file system that another user
could write into is refused with what to fix, not trusted.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from nvrx.atomic_file import replace_file

#: Permission bits that let someone other than the owner change a file or a directory.
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
#: POSIX ACLs of a directory (Linux extended attributes): the default ACL, which files created
#: in it inherit in place of the umask, and the access ACL, beyond its mode bits.
_ACLS = ("system.posix_acl_default", "system.posix_acl_access")
#: What removing an ACL that is not there, or from a file system without ACLs, raises.
_NO_ACL = {errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP}


def make_private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` (and its missing parents) created; ``path`` itself owner-only (0o700, without
    ACLs: a default ACL, a team folder's, would give files created in it, submitit's result
    pickle among them, its group's write permission whatever the umask)."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    if directory.stat().st_uid == os.geteuid():
        directory.chmod(0o700)
        _remove_acls(directory)
    return directory


def _remove_acls(directory: Path) -> None:
    """Remove ``directory``'s POSIX ACLs; a file system that refuses (NFSv4 or GPFS ACLs,
    no extended attributes: EPERM, EINVAL, ENOSYS...) is let be where the ACL is not there."""
    remove = getattr(os, "removexattr", None)  # Linux only; elsewhere no POSIX ACLs to remove
    for name in _ACLS if remove is not None else ():
        try:
            remove(directory, name)
        except OSError as exc:
            if exc.errno not in _NO_ACL and _has_attribute(directory, name):
                raise


def _has_attribute(directory: Path, name: str) -> bool:
    """Whether ``directory`` holds extended attribute ``name`` (False where none can be read)."""
    try:
        os.getxattr(directory, name)
    except OSError:
        return False
    return True


def write_private(path: str | os.PathLike[str], data: bytes) -> Path:
    """Replace ``path`` by ``data`` atomically, owner-only, in an owner-only directory."""
    make_private_dir(Path(path).parent)
    return replace_file(path, data, mode=0o600)


def check_private(path: str | os.PathLike[str]) -> None:
    """Raise ``PermissionError`` unless ``path`` and its directory belong to this user and
    nobody else can write them (``FileNotFoundError`` when it does not exist)."""
    target = Path(path)
    for what, place in (("file", target), ("directory", target.parent)):
        info = place.stat()
        if info.st_uid != os.geteuid():
            raise PermissionError(
                f"refusing to unpickle {target}: its {what} {place} belongs to uid "
                f"{info.st_uid}, not to this user (uid {os.geteuid()}); submit from a folder "
                "of your own"
            )
        if info.st_mode & _OTHERS_WRITE:
            raise PermissionError(
                f"refusing to unpickle {target}: its {what} {place} is writable by others "
                f"(mode {stat.filemode(info.st_mode)}); run `chmod go-w {place}`"
            )


__all__ = ["check_private", "make_private_dir", "write_private"]
