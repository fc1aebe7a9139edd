"""nvrx.processes: every process we start leads its own group, ignores SLURM's warning, and stops for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nvrx import processes
from tests.support.waiting import wait_until

STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "subprocess.Popen(['sleep', '300'])\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(300)\n"
)


def _ignored(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    raise AssertionError("no SigIgn line")


def _group(pgid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return found


def test_started_process_leads_a_group_and_ignores_the_warning_signal() -> None:
    proc = processes.start(
        [sys.executable, "-c", "print('ready', flush=True); import time; time.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        assert os.getpgid(proc.pid) == proc.pid
        assert _ignored(proc.pid) & (1 << (signal.SIGUSR2 - 1))
        os.kill(proc.pid, signal.SIGUSR2)
        assert processes.wait(proc, 0.3) is None  # still running
    finally:
        assert processes.stop(proc, grace_s=5) == -signal.SIGTERM


def test_warning_signal_is_kept_when_asked() -> None:
    proc = processes.start(
        [sys.executable, "-c", "import time; time.sleep(60)"], ignore_warning=False
    )
    wait_until(
        "the child to exec Python",
        lambda: b"python" in Path(f"/proc/{proc.pid}/cmdline").read_bytes(),
        30,
        0.01,
    )
    os.kill(proc.pid, signal.SIGUSR2)
    assert processes.wait(proc, 30) == -signal.SIGUSR2


def test_stop_escalates_to_sigkill_and_takes_the_whole_group() -> None:
    proc = processes.start([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    assert len(_group(proc.pid)) == 2  # the child and its grandchild
    started = time.monotonic()
    assert processes.stop(proc, grace_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - started < 30
    wait_until(
        "the grandchild to die", lambda: not _group(proc.pid), 30, state=lambda: _group(proc.pid)
    )


def test_stop_can_ask_by_closing_a_pipe() -> None:
    proc = processes.start(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    assert proc.stdin is not None
    assert processes.stop(proc, ask=proc.stdin.close, grace_s=30) == 0


def test_stop_all_lets_processes_exit_by_themselves_first() -> None:
    quick = processes.start([sys.executable, "-c", "import time; time.sleep(0.2)"])
    slow = processes.start([sys.executable, "-c", "import time; time.sleep(60)"])
    codes = processes.stop_all([quick, slow], exit_by=time.monotonic() + 10, grace_s=5)
    assert codes == [0, -signal.SIGTERM]


def test_stop_of_an_ended_process_returns_its_code() -> None:
    proc = processes.start([sys.executable, "-c", "raise SystemExit(3)"])
    assert processes.wait(proc, 30) == 3
    assert processes.stop(proc) == 3


class _Reaped:
    """A leader reaped long ago whose pid is ``pid`` now."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = 0

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return 0


def test_stop_of_a_reaped_leader_spares_a_group_that_took_its_pid() -> None:
    other = processes.start([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert processes.stop(_Reaped(other.pid)) == 0
        assert processes.wait(other, 0.3) is None  # the group that reused the pid lives on
    finally:
        assert processes.stop(other, grace_s=5) == -signal.SIGTERM


def test_stop_of_a_reaped_leader_kills_what_is_left_of_its_group() -> None:
    leader = processes.start(
        [
            sys.executable,
            "-c",
            "import subprocess; subprocess.Popen(['sleep', '300']); print('ready', flush=True)",
        ],
        stdout=subprocess.PIPE,
    )
    assert leader.stdout is not None and leader.stdout.readline().strip() == b"ready"
    assert processes.wait(leader, 30) == 0
    assert _group(leader.pid)  # the grandchild outlived its leader
    assert processes.stop(leader) == 0
    wait_until(
        "the grandchild to die",
        lambda: not _group(leader.pid),
        30,
        state=lambda: _group(leader.pid),
    )


def test_forked_child_leads_a_group_and_can_be_waited_for_with_a_bound() -> None:
    pid = processes.fork()
    if pid == 0:  # the child: wait to be killed
        try:
            time.sleep(60)
        finally:
            os._exit(0)
    child = processes.ForkedProcess(pid)
    assert os.getpgid(pid) == pid
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    assert processes.stop(child, grace_s=5) == -signal.SIGTERM
    assert child.poll() == -signal.SIGTERM


_FORKS_AND_WAITS = """
import signal, sys
from nvrx import processes
if processes.fork(die_with_parent=True) == 0:
    print(__import__("os").getpid(), flush=True)
while True:
    signal.pause()
"""


def _ended(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie that its new parent did not reap yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_forked_to_die_with_its_parent_dies_when_the_parent_is_sigkilled() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _FORKS_AND_WAITS], stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    child = None
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not _ended(child)
        parent.kill()
        parent.wait(30)
        wait_until(f"forked child {child} to die with its parent", lambda: _ended(child), 20)
    finally:
        for group in (child, parent.pid):
            if group is not None:
                processes.signal_group(group, signal.SIGKILL)
        parent.wait(30)
        if parent.stdout is not None:
            parent.stdout.close()


@pytest.mark.parametrize(
    ("name", "number"), [("USR2", signal.SIGUSR2), ("SIGTERM", signal.SIGTERM), ("10", 10)]
)
def test_signal_names(name: str, number: int) -> None:
    assert processes.signal_from_name(name) == number


def test_bad_signal_name_names_the_variable() -> None:
    with pytest.raises(ValueError, match="NVRX_PREEMPT_SIGNAL='NOPE' is not a signal name"):
        processes.warning_signal({"NVRX_PREEMPT_SIGNAL": "NOPE"})


def test_a_process_that_outlives_sigkill_does_not_hang_the_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stands in for a process stuck in the kernel: one that is not the leader of the group the
    stop kills, so SIGKILL never reaches it. The stop gives up after KILL_WAIT_S and says so."""
    monkeypatch.setattr(processes, "KILL_WAIT_S", 0.2)
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # our own group
    try:
        started = time.monotonic()
        assert processes.stop(stuck, grace_s=0.1) is None
        assert time.monotonic() - started < 30
        assert stuck.poll() is None
    finally:
        stuck.kill()
        stuck.wait()


def test_stop_foreign_ends_a_process_alone_and_wakes_a_stopped_one() -> None:
    """A monitor ends the rank it watches, which is not its child: the rank alone, SIGCONT first."""
    ignores_term = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    stubborn = subprocess.Popen([sys.executable, "-c", ignores_term], stdout=subprocess.PIPE)
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == b"ready"
        os.kill(stopped.pid, signal.SIGSTOP)
        processes.stop_foreign(stopped.pid, os.pidfd_open(stopped.pid), 30)
        assert not processes.alive(stopped.pid)  # a zombie until its parent reaps it
        assert stopped.wait(5) == -signal.SIGTERM  # SIGCONT let it act on SIGTERM
        processes.stop_foreign(stubborn.pid, None, 0.2)  # no pidfd: it looks instead
        assert stubborn.wait(5) == -signal.SIGKILL
    finally:
        for proc in (stubborn, stopped):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_exit_now_keeps_what_was_written_and_the_exit_code(tmp_path: Path) -> None:
    """A helper program skips the interpreter's teardown, not its output."""
    log_file = tmp_path / "helper.log"
    code = (
        "import logging, sys\n"
        "from nvrx.processes import exit_now\n"
        f"logging.basicConfig(filename={str(log_file)!r}, level=logging.INFO)\n"
        "logging.getLogger('helper').info('logged before the exit')\n"
        "sys.stdout.write('printed before the exit')\n"
        "exit_now(3)\n"
        "print('never')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 3
    assert done.stdout == "printed before the exit"
    assert "logged before the exit" in log_file.read_text()


def test_an_identity_is_gone_once_its_process_ended_and_only_then() -> None:
    """A running process is not gone; killed, it is, as a zombie and once reaped; a name of
    another boot or namespace, or no identity at all, cannot be told gone here."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        name = processes.identity(child.pid)
        assert name is not None and not processes.gone(name)
        assert not processes.gone(processes.identity())  # this process
        boot, namespace, pid, start = name.split("/")
        assert processes.gone(f"{boot}/{namespace}/{pid}/{int(start) + 1}")  # a later process
        assert not processes.gone(f"another-boot/{namespace}/{pid}/{int(start) + 1}")
        assert not processes.gone(f"{boot}/1/{pid}/{int(start) + 1}")  # another namespace
        assert not processes.gone("abcdef") and not processes.gone("")
        assert not processes.gone(f"{boot}/{namespace}/{pid}/x")  # no start time
        child.kill()
        wait_until("a zombie", lambda: processes._stat(child.pid)[0] == "Z", 30)
        assert processes.gone(name)
    finally:
        child.kill()
        child.wait()
    assert processes.gone(name)


def test_a_process_whose_proc_entry_cannot_be_read_is_not_called_gone(monkeypatch) -> None:
    """``/proc`` mounted with ``hidepid`` hides (or refuses) another user's processes: such
    a process still runs, as far as anyone here can tell."""
    name = processes.identity()
    real_open = open

    def refused(path, *args, **kwargs):
        if str(path).endswith("/stat"):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", refused)
    assert not processes.gone(name)


def test_a_process_reads_its_own_identity_once_and_a_forked_child_its_own(monkeypatch) -> None:
    """A barrier's closer names itself at every closing: its own name is read from ``/proc``
    once, and a child forked after that names itself, not its parent."""
    own = processes.identity()
    assert own is not None and own == processes.identity(os.getpid())
    monkeypatch.setattr(processes, "_stat", lambda pid: None)  # /proc is not read again
    assert processes.identity() == own
    monkeypatch.undo()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own name, through the cache its parent filled
        os.close(read)
        os.write(write, (processes.identity() or "").encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child_says = pipe.read()
    try:
        assert child_says and child_says != own
        assert child_says == processes.identity(pid)  # a zombie until reaped: /proc still says
    finally:
        os.waitpid(pid, 0)


def test_a_grace_longer_than_one_poll_takes_is_waited_in_slices(monkeypatch) -> None:
    """``poll(2)`` waits at most about 24.8 days per call: a monitor ending its rank with a
    longer ``termination_grace_time`` (the Wrapper takes up to ten years) raised
    ``OverflowError``. The wait goes in slices, each up to the deadline, none past it."""
    ends_on_term = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pidfd = os.pidfd_open(ends_on_term.pid)
        try:
            processes.stop_foreign(ends_on_term.pid, pidfd, 10 * 365 * 24 * 3600.0)
        finally:
            os.close(pidfd)
        assert ends_on_term.wait(5) == -signal.SIGTERM
    finally:
        if ends_on_term.poll() is None:
            ends_on_term.kill()
            ends_on_term.wait()
    monkeypatch.setattr(processes, "_POLL_MAX_MS", 10)
    read_end, write_end = os.pipe()
    try:
        t0 = time.monotonic()
        assert processes._readable([read_end], 0.2) == []  # nothing to read: the whole wait
        assert time.monotonic() - t0 >= 0.2
        os.write(write_end, b"x")
        assert processes._readable([read_end], 3600.0) == [read_end]
    finally:
        os.close(read_end)
        os.close(write_end)
