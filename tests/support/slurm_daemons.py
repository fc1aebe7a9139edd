"""The daemons the local test cluster starts: spawning, waiting, stopping.

A daemon is recognised by pid, command name and start time (from
``/proc/<pid>/stat``), and signalled through a pidfd, so a recycled pid is
never signalled. The records live in ``STATE_DIR/pids.json``; the flock on
``STATE_DIR/lock`` keeps two test sessions from sharing one cluster.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.support.slurm_errors import ClusterError, tail, wait_for

logger = logging.getLogger(__name__)


@dataclass
class DaemonRecord:
    """One process we started: enough to recognise it again after a pid is recycled."""

    name: str
    pid: int
    comm: str
    start_ticks: int
    log: str


def proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(comm, state, start time in clock ticks) of a pid, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2 :].split()
    return comm, rest[0], int(rest[19])


def pid_alive(pid: int) -> bool:
    """Whether a pid runs (a zombie counts as dead: it waits only to be reaped)."""
    stat = proc_stat(pid)
    return stat is not None and stat[1] not in ("Z", "X")


def is_ours(record: DaemonRecord) -> bool:
    """Whether ``record.pid`` is still the process we started, alive."""
    stat = proc_stat(record.pid)
    return (
        stat is not None
        and stat[1] not in ("Z", "X")
        and stat[0] == record.comm
        and stat[2] == record.start_ticks
    )


def wait_pidfds(fds: Sequence[int], timeout: float) -> bool:
    """Block until every pidfd reports its process ended, or ``timeout`` passes."""
    poller = select.poll()
    pending = set(fds)
    for fd in pending:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        for fd, _ in poller.poll(left * 1000):
            pending.discard(fd)
            poller.unregister(fd)
    return True


def open_if_ours(record: DaemonRecord) -> int | None:
    """A pidfd for the recorded process, or None when it is gone or the pid was reused."""
    try:
        fd = os.pidfd_open(record.pid)
    except ProcessLookupError:
        return None
    # the pidfd pins the process: if it still matches now, signals reach the right one
    if not is_ours(record):
        os.close(fd)
        return None
    return fd


def kill_pids(pids: Iterable[int], timeout: float) -> list[int]:
    """SIGKILL processes (that cannot be recycled: frozen, or our own node's) and wait.

    Returns the pids still alive after ``timeout``.
    """
    fds = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        fds.append((pid, fd))
    try:
        wait_pidfds([fd for _, fd in fds], timeout)
        return [pid for pid, _ in fds if pid_alive(pid)]
    finally:
        for _, fd in fds:
            os.close(fd)


def clean_env() -> dict[str, str]:
    """This process's environment without SLURM_* (a test run inside a SLURM job)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


class DaemonControl:
    """Mixin of ``LocalSlurmCluster``: its pid file, its lock and its daemons' lives.

    Uses ``nodes``, ``state_dir``, ``log_dir``, ``pids_file``, ``use_freezer``,
    ``_children``, ``_records``, ``_history``, ``_lock_fd`` and ``_cgroup``.
    """

    def _load_state(self) -> None:
        try:
            data = json.loads(self.pids_file.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as err:
            raise ClusterError(f"cannot read {self.pids_file}: {err}; remove it by hand") from err
        self._records = {d["name"]: DaemonRecord(**d) for d in data.get("running", [])}
        self._history = [DaemonRecord(**d) for d in data.get("started", [])]

    def _save_state(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        data = {
            "running": [asdict(r) for r in self._records.values()],
            "started": [asdict(r) for r in self._history],
            "cgroups": [str(self._cgroup(n)) for n in self.nodes] if self.use_freezer else [],
        }
        tmp = self.pids_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.pids_file)

    def is_running(self) -> bool:
        """Whether every daemon of a started cluster is alive (ours, by pid file)."""
        wanted = {"slurmctld"} | {f"slurmd-{n}" for n in self.nodes}
        return all(name in self._records and is_ours(self._records[name]) for name in wanted)

    def _spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        user: str | None = None,
        cgroup: Path | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start a daemon in the foreground, in its own session, output to a log file."""
        comm = Path(argv[0]).name[:15]
        log = self.log_dir / f"{name}.out"
        env = clean_env()
        env.update(extra_env or {})
        full = list(argv)
        if cgroup is not None:
            # join the cgroup before exec, so that nothing it forks can escape it
            full = ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup), *argv]
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                full,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                user=user,
                group=user,
                extra_groups=[] if user else None,
            )
        stat = proc_stat(proc.pid)
        record = DaemonRecord(name, proc.pid, comm, stat[2] if stat else -1, str(log))
        self._children[proc.pid] = proc
        self._records[name] = record
        self._history.append(record)
        self._save_state()
        return proc

    def _wait_daemon(
        self, name: str, what: str, condition: Callable[[], bool], timeout: float
    ) -> None:
        """Wait for a started daemon to answer; fail early, with its log, if it dies."""
        record = self._records[name]
        proc = self._children[record.pid]

        def ready() -> bool:
            if proc.poll() is not None:
                raise ClusterError(
                    f"{name} exited {proc.returncode} while starting; {record.log}:\n"
                    f"{tail(Path(record.log))}"
                )
            return condition()

        try:
            wait_for(what, ready, timeout)
        except ClusterError as err:
            logs = [Path(record.log), self.log_dir / f"{name}.log"]
            tails = "".join(f"\n--- {p}:\n{tail(p)}" for p in logs if p.exists())
            raise ClusterError(f"{err}{tails}") from None

    def acquire(self, timeout: float) -> None:
        """Take the cluster lock, so that two test sessions never share or stop one cluster.

        Waits (bounded) while another process holds it; then reloads the pid
        file, which that process may have changed. ``stop`` releases it.
        """
        if self._lock_fd is not None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        lock = self.state_dir / "lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by daemons
        deadline = time.monotonic() + timeout
        waiting_logged = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = lock.read_text().strip() or "?"
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise ClusterError(
                        f"the test cluster is in use by pid {holder} (lock {lock}); "
                        f"waited {timeout:g} s"
                    ) from None
                if not waiting_logged:
                    logger.warning("waiting for the test cluster, in use by pid %s", holder)
                    waiting_logged = True
                time.sleep(0.5)  # flock has no timeout; the holder may take minutes
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        self._load_state()

    def release(self) -> None:
        """Give the cluster lock back (the daemons keep running if not stopped)."""
        if self._lock_fd is not None:
            os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _stop_daemon(self, name: str, grace: float) -> None:
        """SIGTERM, bounded wait, SIGKILL; reap when it is our child; forget the record."""
        record = self._records.pop(name, None)
        if record is None:
            return
        proc = self._children.pop(record.pid, None)
        fd = open_if_ours(record)
        if fd is not None:
            try:
                signal.pidfd_send_signal(fd, signal.SIGTERM)
                if not wait_pidfds([fd], grace):
                    logger.warning(
                        "%s (pid %d) ignored SIGTERM for %g s; SIGKILL", name, record.pid, grace
                    )
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    if not wait_pidfds([fd], 10):
                        raise ClusterError(f"{name} (pid {record.pid}) survived SIGKILL")
            except ProcessLookupError:
                pass
            finally:
                os.close(fd)
        if proc is not None:
            # the leader is dead but unreaped, so its pid (= group id) cannot be reused yet
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(record.pid, signal.SIGKILL)
            try:
                code = proc.wait(timeout=10)
            except subprocess.TimeoutExpired as err:
                raise ClusterError(f"{name} (pid {record.pid}) could not be reaped") from err
            if code not in (0, -signal.SIGTERM, -signal.SIGKILL):
                logger.warning("%s exited %s; see %s", name, code, record.log)
        self._save_state()
