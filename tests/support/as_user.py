"""Run one of nvrx's command lines as a user whom file modes stop.

Root reads and writes anywhere, so a test of a permission error run as root needs another
user: the child imports the command's modules first (this Python may live where that user
may not go), then becomes ``nobody``, then runs the command's ``main``.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys

import pytest

_AS_USER = """
import importlib, os, sys
modules = [importlib.import_module(name) for name in sys.argv[1].split(",")]
uid, gid = int(sys.argv[2]), int(sys.argv[3])
if uid >= 0:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
sys.exit(modules[0].main(sys.argv[4:]))
"""


def unprivileged_ids(why: str) -> tuple[int, int]:
    """(uid, gid) of ``nobody`` where this test runs as root; (-1, -1) (stay) for another user,
    whom the modes already stop. Skips, naming ``why`` root is no test, where root has no one
    to become."""
    if os.geteuid() != 0:
        return -1, -1
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip(f"running as root and no user 'nobody' to become: {why}")
    return nobody.pw_uid, nobody.pw_gid


def run_as(
    modules: list[str], user: tuple[int, int], argv: list[str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``modules[0].main(argv)`` in a child as ``user``'s (uid, gid) (-1: stay), after importing
    every one of ``modules``."""
    return subprocess.run(
        [sys.executable, "-c", _AS_USER, ",".join(modules), *map(str, user), *argv],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
