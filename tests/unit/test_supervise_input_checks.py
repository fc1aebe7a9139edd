"""Input to nvrx-supervise that used to end in a traceback, a misleading line or a silent
default: each now gets one line naming what to fix, with its exit code (2: usage)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

PROG = "nvrx-supervise"

#: Runs nvrx-supervise in a child that, started as root (who may write anywhere), first
#: becomes ``nobody``: after the imports, since this Python may live where ``nobody`` may not go.
AS_USER = """
import os, sys
import nvrx.supervisor.cli as cli, nvrx.supervisor.supervisor
uid, gid = int(sys.argv[1]), int(sys.argv[2])
if uid >= 0:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
sys.exit(cli.main(sys.argv[3:]))
"""


def _supervise(*argv: str, user: tuple[int, int] = (-1, -1)) -> subprocess.CompletedProcess[str]:
    """nvrx-supervise run in a child process (as ``user``'s (uid, gid) where not -1)."""
    return subprocess.run(
        [sys.executable, "-c", AS_USER, *map(str, user), *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _one_error_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The one line of stderr, an error of nvrx-supervise, after exit ``code``."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{PROG}: error: "), result.stderr
    return lines[0]


@pytest.fixture
def read_only_base() -> Iterator[tuple[Path, tuple[int, int]]]:
    """A folder no one but root may write in (mode 0o555), and who to run as so that the
    mode stops them: ``nobody`` where this test runs as root, else the user it runs as."""
    user = (-1, -1)
    if os.geteuid() == 0:
        try:
            nobody = pwd.getpwnam("nobody")
        except KeyError:
            pytest.skip("running as root and no user 'nobody' to become: root writes anywhere")
        user = (nobody.pw_uid, nobody.pw_gid)
    folder = Path(tempfile.mkdtemp(prefix="nvrx-read-only-"))
    folder.chmod(0o555)
    try:
        yield folder, user
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


def test_a_read_only_log_dir_is_one_line_and_exit_2(
    read_only_base: tuple[Path, tuple[int, int]],
) -> None:
    """Before: PermissionError's traceback from the job folder's mkdir, exit 1."""
    base, user = read_only_base
    argv = ["--master-port", "29800", "--job-id", "j", "--log-dir", str(base), "--", "true"]
    line = _one_error_line(_supervise(*argv, user=user), 2)
    assert line == (
        f"{PROG}: error: cannot create the job folder {base}/j: Permission denied; "
        "choose another --log-dir"
    )


@pytest.mark.parametrize(
    ("log_dir", "reason"),
    [
        ("{tmp}/afile", "Not a directory"),  # a regular file
        ("{tmp}/afile/logs", "Not a directory"),  # a regular file on the way
        ("/proc/nvrx-no-such", "No such file or directory"),  # a place where none can be made
    ],
)
def test_a_log_dir_that_cannot_hold_the_job_folder_is_one_line_and_exit_2(
    log_dir: str, reason: str, tmp_path: Path
) -> None:
    """Before: NotADirectoryError's or FileNotFoundError's traceback, exit 1; the event
    writer's warnings came first."""
    (tmp_path / "afile").write_text("")
    log_dir = log_dir.format(tmp=tmp_path)
    argv = ["--master-port", "29800", "--job-id", "j", "--log-dir", log_dir, "--", "true"]
    line = _one_error_line(_supervise(*argv), 2)
    assert line == (
        f"{PROG}: error: cannot create the job folder {log_dir}/j: {reason}; choose another --log-dir"
    )
