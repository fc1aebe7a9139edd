"""The directories of host groups (``nvrx.inprocess.host_group_dir``): a member that was
killed is told from a live one by the lock it held, so its file keeps no directory alive,
and the directories of groups whose monitors all died are removed by the next monitor
that joins a group on the host. Real processes, killed with real signals."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvrx.inprocess.host_group import HostGroup, Leader
from nvrx.inprocess.host_group_dir import HELD, MEMBER, group_dir, remove_abandoned

MEMBER_PROGRAM = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "from nvrx.inprocess.host_group import HostGroup, Leader\n"
    "group = HostGroup(Path(sys.argv[1]), Leader(os.getpid(), int(sys.argv[2]), 2000), 0.5)\n"
    "group.join()\n"
    "print('joined', flush=True)\n"
    "sys.stdin.read()  # until the test closes it, or kills this process\n"
)


@pytest.fixture
def members() -> Iterator[list[subprocess.Popen[str]]]:
    """Member processes started by ``_start``; each is killed and reaped at the end."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _start(members: list[subprocess.Popen[str]], directory: Path, rank: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", MEMBER_PROGRAM, str(directory), str(rank)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    members.append(proc)
    assert proc.stdout is not None and proc.stdout.readline() == "joined\n"
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _group(root: Path, job: str, rank: int = 0) -> HostGroup:
    return HostGroup(group_dir(job, "h0", root=str(root)), Leader(1000 + rank, rank, 2000), 0.5)


def test_the_last_live_member_removes_the_group_though_a_killed_member_left_its_file(
    sockets_dir, members
) -> None:
    leader = _group(sockets_dir, "job")
    assert leader.join()
    killed = _start(members, leader.dir, rank=1)
    _kill(killed)
    assert (leader.dir / f"{MEMBER}1").exists()  # a SIGKILLed monitor cannot leave
    assert leader.leave() is False  # last, but not every member left on purpose
    assert not leader.dir.exists()


def test_the_last_group_to_go_takes_its_private_root_with_it(sockets_dir) -> None:
    """``nvrx-<uid>`` is left only while a group is in it; a group made after it went makes
    it again (private, 0700)."""
    first, second = _group(sockets_dir, "job-a"), _group(sockets_dir, "job-b")
    root = first.dir.parent
    assert root.name == f"nvrx-{os.getuid()}" and first.join() and second.join()
    assert first.leave() and root.is_dir()  # job-b's group is still in it
    assert second.leave() and not root.exists()
    again = _group(sockets_dir, "job-c")
    assert again.join() and (os.stat(root).st_mode & 0o777) == 0o700
    assert again.leave() and not root.exists()


FD_PROGRAM = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "from nvrx.inprocess.host_group import HostGroup, Leader\n"
    "directory = Path(sys.argv[1])\n"
    "before = sorted(os.listdir('/proc/self/fd'))\n"
    "group = HostGroup(directory, Leader(1000, 0, 2000), 0.5)\n"
    "assert group.join() and group.leave()\n"
    "group.close()\n"
    "follower = HostGroup(directory, Leader(1001, 1, 2001), 0.5)\n"
    "assert follower.join()\n"
    "follower.close()  # without leaving: it counts as killed from now on\n"
    "print(before == sorted(os.listdir('/proc/self/fd')))\n"
)


def test_joining_and_leaving_keep_no_descriptor_open(sockets_dir) -> None:
    directory = group_dir("job", "h0", root=str(sockets_dir))
    done = subprocess.run(  # a process of its own: nothing else opens or closes descriptors
        [sys.executable, "-c", FD_PROGRAM, str(directory)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout == "True\n", done.stderr
    last = _group(sockets_dir, "job", rank=2)
    last.join()
    assert last.leave() is False  # rank 1, closed without leaving, counted as killed
    assert not last.dir.exists()
    last.close()


def test_a_stopped_member_still_counts_and_keeps_the_group(sockets_dir, members) -> None:
    leader = _group(sockets_dir, "job")
    assert leader.join()
    frozen = _start(members, leader.dir, rank=1)
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        assert leader.leave() is False
        assert remove_abandoned(leader.dir.parent, keep=sockets_dir) == []
        assert (leader.dir / f"{MEMBER}1").exists()
    finally:
        os.kill(frozen.pid, signal.SIGCONT)


def test_the_last_monitor_to_leave_removes_the_groups_whose_monitors_all_died(
    sockets_dir, members
) -> None:
    """A crashed node's group (its monitors SIGKILLed) on the same host goes when the last
    live monitor of another group leaves, and the private root with it."""
    leader = _group(sockets_dir, "job")
    assert leader.join()
    dead = group_dir("crashed node", "h1", root=str(sockets_dir))  # after that join
    _kill(_start(members, dead, rank=3))
    assert (dead / f"{MEMBER}3").exists()
    assert leader.leave() is True
    assert not dead.exists() and not leader.dir.parent.exists()


def test_a_joining_monitor_removes_the_groups_whose_monitors_all_died(sockets_dir, members) -> None:
    dead = group_dir("killed job", "h0", root=str(sockets_dir))
    for rank in (0, 1):
        _start(members, dead, rank)
    for proc in members:
        _kill(proc)
    assert (dead / HELD).exists() and (dead / f"{MEMBER}0").exists()
    running_dir = group_dir("running job", "h0", root=str(sockets_dir))
    running = _start(members, running_dir, rank=0)
    old = group_dir("older nvrx", "h0", root=str(sockets_dir))
    (old / f"{MEMBER}0").touch()  # no lock held, but no HELD mark either: not ours to judge

    joining = _group(sockets_dir, "new job")
    assert joining.join()
    assert not dead.exists()
    assert old.exists() and running_dir.exists()
    assert running.poll() is None
    assert joining.leave() is True
    assert not joining.dir.exists()


def test_a_group_busy_or_marked_by_another_machine_is_left_alone(sockets_dir, members) -> None:
    busy = group_dir("busy", "h0", root=str(sockets_dir))
    other = group_dir("other machine", "h0", root=str(sockets_dir))
    for directory in (busy, other):
        _start(members, directory, rank=0)
    for proc in members:
        _kill(proc)
    (other / HELD).write_text("another-node")  # a root on a file system that hosts share
    with open(busy / "elect.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a member of it is joining or leaving right now
        assert remove_abandoned(busy.parent, keep=sockets_dir) == []
    assert busy.exists() and other.exists()
    assert remove_abandoned(busy.parent, keep=sockets_dir) == [busy]
    assert other.exists()
