"""Replacing a small file so that a reader sees either the old one or the whole new one.

Addresses, ledgers, snapshots, job specs and results are read by other
processes while they are written, and several writers may race (one per node).
Each writer writes a temporary file of its own beside the target, then renames
it over the target: a rename within one directory is atomic on POSIX.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def replace_file(
    path: str | os.PathLike[str],
    data: bytes | str,
    *,
    make_parents: bool = True,
    mode: int | None = None,
) -> Path:
    """Replace ``path`` by ``data`` (text is written as UTF-8) atomically; return the path.

    The temporary file is named after the writer (pid and a random part), so
    racing writers never write into one another's. ``mode``: the new file's permissions
    from its creation on (0o600: nobody else reads it even while it is written); else the
    process's umask decides. On an error (a full disk, a directory that vanished) the
    temporary file is removed, the target is left as it was, and the ``OSError`` is raised.
    """
    target = Path(path)
    if make_parents:
        target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    payload = data.encode() if isinstance(data, str) else data
    try:
        if mode is None:
            tmp.write_bytes(payload)
        else:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as fh:
                fh.write(payload)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target
