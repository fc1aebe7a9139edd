"""A real SLURM cluster on this machine, for tests: munge, MariaDB + slurmdbd,
slurmctld and two slurmd "nodes" on loopback addresses.

``LocalSlurmCluster().start()`` installs the Debian packages when missing
(``scripts/install_slurm.sh``), writes its own ``/etc/slurm/slurm.conf`` and
``slurmdbd.conf``, starts every daemon in the foreground in its own session
(stdin ``/dev/null``, output to log files under ``STATE_DIR/log``) and waits,
with deadlines, until both nodes are idle and the cluster is registered in
accounting. ``stop()`` cancels the jobs and ends only the processes it started:
by pidfd, after checking the pid's command name and start time, so a recycled
pid is never signalled. Each slurmd runs in its own freezer cgroup (cgroup v1,
when the machine has one), so every process of that node's jobs can be killed
at once by ``crash_node``; without the freezer the node's processes are found
by ancestry (slurmd and its slurmstepds carry ``NVRX_TEST_SLURM_NODE`` in their
environment; job processes descend from a slurmstepd).

The pids of every daemon started are kept in ``STATE_DIR/pids.json`` (also
after ``stop``), so that ``python -m tests.support.slurm_cluster check-stopped``
can prove that none survives. ``start`` takes an flock on ``STATE_DIR/lock``
until ``stop``, so two test sessions wait for each other instead of sharing or
stopping one cluster. Daemons stopped by another process than the one that
started them (the CLI) are reaped by PID 1, which may leave ``<defunct>``
entries in ``ps`` for some seconds; they count as dead.

Found on this machine (Debian 12, SLURM 22.05.8, PID 1 ``process_api``, cgroup
v1 with a writable freezer): a requeued job launched in the same second as the
end of its previous run fails with "Job credential revoked", so ``requeue``
sets ``StartTime=now+2``; slurmstepd clears its environment, so without the
freezer its node is found by its unix socket in the node's spool directory.

By hand: ``python -m tests.support.slurm_cluster start|stop|status|check-stopped``
and ``crash-node NODE`` / ``revive-node NODE``. Must run as root.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import pwd
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from nvrx.slurm import commands
from nvrx.slurm.commands import TERMINAL_STATES, SlurmCommandError

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO_ROOT / "scripts" / "install_slurm.sh"
STATE_DIR = Path(os.environ.get("NVRX_TEST_SLURM_DIR", "/var/spool/nvrx-test-slurm"))
SLURM_CONF = Path("/etc/slurm/slurm.conf")
SLURMDBD_CONF = Path("/etc/slurm/slurmdbd.conf")
CONF_MARKER = "# written by nvrx tests/support/slurm_cluster.py; rewritten on every start"
HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARKER = "# nvrx-test-slurm"
FREEZER_ROOT = Path("/sys/fs/cgroup/freezer")
CGROUP_NAME = "nvrx-test-slurm"
NODE_ENV_MARKER = "NVRX_TEST_SLURM_NODE"

CLUSTER_NAME = "nvrxtest"
CTLD_PORT = 6817
DBD_PORT = 6819
SLURMD_PORT_BASE = 17000
DB_NAME = "nvrx_test_acct"
DB_USER = "slurm"
DB_PASS = "nvrx-test-loopback-only"  # MariaDB runs with --skip-networking

#: Job states slurmctld never moves a job out of (PREEMPTED and NODE_FAIL may be requeued).
_FINAL_STATES = TERMINAL_STATES - {"PREEMPTED", "NODE_FAIL"}

#: Node states sinfo reports for a node that answers and can take jobs.
_USABLE_NODE_STATES = {"idle", "mixed", "allocated", "completing"}


class ClusterUnavailable(RuntimeError):
    """The cluster cannot run here at all (not root, no apt); tests should skip."""


class ClusterError(RuntimeError):
    """The cluster failed to start, stop or answer; the message says where to look."""


@dataclass
class DaemonRecord:
    """One process we started: enough to recognise it again after a pid is recycled."""

    name: str
    pid: int
    comm: str
    start_ticks: int
    log: str


# -- processes ---------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, str, int] | None:
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
    stat = _proc_stat(pid)
    return stat is not None and stat[1] not in ("Z", "X")


def _is_ours(record: DaemonRecord) -> bool:
    """Whether ``record.pid`` is still the process we started, alive."""
    stat = _proc_stat(record.pid)
    return (
        stat is not None
        and stat[1] not in ("Z", "X")
        and stat[0] == record.comm
        and stat[2] == record.start_ticks
    )


def _wait_pidfds(fds: Sequence[int], timeout: float) -> bool:
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


def _open_if_ours(record: DaemonRecord) -> int | None:
    """A pidfd for the recorded process, or None when it is gone or the pid was reused."""
    try:
        fd = os.pidfd_open(record.pid)
    except ProcessLookupError:
        return None
    # the pidfd pins the process: if it still matches now, signals reach the right one
    if not _is_ours(record):
        os.close(fd)
        return None
    return fd


def _kill_pids(pids: Iterable[int], timeout: float) -> list[int]:
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
        _wait_pidfds([fd for _, fd in fds], timeout)
        return [pid for pid, _ in fds if pid_alive(pid)]
    finally:
        for _, fd in fds:
            os.close(fd)


def _wait_for(
    what: str, condition: Callable[[], bool], timeout: float, interval: float = 0.2
) -> None:
    """Poll an external daemon's state until ``condition()`` holds; raise ClusterError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            if condition():
                return
        except (OSError, SlurmCommandError, subprocess.SubprocessError) as err:
            last_error = err
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise ClusterError(f"timed out after {timeout:g} s waiting for {what}{detail}")
        time.sleep(interval)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as err:
        return f"({path}: {err})"


def _clean_env() -> dict[str, str]:
    """This process's environment without SLURM_* (a test run inside a SLURM job)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


# -- the cluster ---------------------------------------------------------------


class LocalSlurmCluster:
    """Start, use and stop a two-node SLURM cluster on loopback.

    Public attributes: ``nodes`` (names), ``partition`` (default partition),
    ``high_partition`` (preempts ``partition``), ``cpus_per_node``, ``env``
    (environment for subprocesses that use SLURM), ``jobs_dir`` (default cwd
    of ``sbatch``), ``log_dir`` (daemon logs).
    """

    def __init__(
        self,
        nodes: int = 2,
        cpus_per_node: int = 4,
        state_dir: Path = STATE_DIR,
        slurmd_timeout: int = 20,
        kill_wait: int = 10,
        use_freezer: bool | None = None,
        start_timeout: float = 90.0,
        lock_timeout: float = 1800.0,
    ) -> None:
        if not 1 <= nodes <= 9:
            raise ValueError(f"nodes={nodes}: the cluster supports 1 to 9 nodes")
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.partition = "debug"
        self.high_partition = "high"
        self.cpus_per_node = cpus_per_node
        self.state_dir = Path(state_dir)
        self.log_dir = self.state_dir / "log"
        self.run_dir = self.state_dir / "run"
        self.jobs_dir = self.state_dir / "jobs"
        self.pids_file = self.state_dir / "pids.json"
        self.slurmd_timeout = slurmd_timeout
        self.kill_wait = kill_wait
        self.start_timeout = start_timeout
        self.lock_timeout = lock_timeout
        self._lock_fd: int | None = None
        if use_freezer is None:
            use_freezer = (FREEZER_ROOT / "cgroup.procs").exists()
        self.use_freezer = use_freezer
        self.env = _clean_env()
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._records: dict[str, DaemonRecord] = {}
        self._history: list[DaemonRecord] = []
        self._script_counter = 0
        self._load_state()

    # -- state file ----------------------------------------------------------

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

    # -- start ---------------------------------------------------------------

    @staticmethod
    def check_can_run() -> None:
        """Raise ClusterUnavailable, with the reason, when this machine cannot host the cluster."""
        if os.geteuid() != 0:
            raise ClusterUnavailable(f"not root (euid {os.geteuid()})")
        missing = [tool for tool in ("apt-get", "dpkg-query") if shutil.which(tool) is None]
        if missing:
            raise ClusterUnavailable(f"{', '.join(missing)} not found")

    def is_running(self) -> bool:
        """Whether every daemon of a started cluster is alive (ours, by pid file)."""
        wanted = {"slurmctld"} | {f"slurmd-{n}" for n in self.nodes}
        return all(name in self._records and _is_ours(self._records[name]) for name in wanted)

    def start(self) -> float:
        """Start the cluster (installing packages first when missing); return seconds taken.

        A cluster left running by an earlier session is stopped first, so every
        start begins with no jobs, job ids from 1 and an empty accounting DB.
        """
        self.check_can_run()
        t0 = time.monotonic()
        self.acquire(self.lock_timeout)
        logger.info("cluster lock taken after %.1f s", time.monotonic() - t0)
        if self._records:
            logger.info("stopping the cluster left by an earlier start")
            self.stop(release_lock=False)
        self._history = []
        self._install()
        logger.info("packages ready after %.1f s", time.monotonic() - t0)
        shutil.rmtree(self.log_dir, ignore_errors=True)  # logs of this start only
        for d in (self.log_dir, self.run_dir, self.jobs_dir):
            d.mkdir(parents=True, exist_ok=True)
        try:
            self._write_config()
            self._reset_state_dirs()
            self._add_hosts()
            self._start_munge()
            self._start_mariadb()
            self._start_slurmdbd()
            self._start_slurmctld()
            for node in self.nodes:
                self._start_slurmd(node)
            self.wait_nodes_usable(self.nodes, timeout=self.start_timeout)
            self._wait_registered()
            logger.info("cluster up after %.1f s: %s", time.monotonic() - t0, self.nodes)
        except BaseException:
            logger.error("cluster start failed; stopping what was started (logs: %s)", self.log_dir)
            self.stop()
            raise
        return time.monotonic() - t0

    def _install(self) -> None:
        done = subprocess.run(
            [str(INSTALL_SCRIPT)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            start_new_session=True,
            timeout=900,
        )
        if done.returncode == 2:
            raise ClusterUnavailable(done.stderr.strip())
        if done.returncode != 0:
            raise ClusterError(f"{INSTALL_SCRIPT} exited {done.returncode}: {done.stderr.strip()}")

    def _write_config(self) -> None:
        for path in (SLURM_CONF, SLURMDBD_CONF):
            if path.exists() and CONF_MARKER not in path.read_text(errors="replace"):
                if os.environ.get("NVRX_SLURM_FORCE") != "1":
                    raise ClusterError(
                        f"{path} exists and was not written by this module; move it away "
                        "or set NVRX_SLURM_FORCE=1 to overwrite it"
                    )
        SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
        tmp = SLURM_CONF.with_suffix(".nvrx-tmp")
        tmp.write_text(self._slurm_conf())
        tmp.chmod(0o644)
        tmp.replace(SLURM_CONF)
        fd = os.open(
            SLURMDBD_CONF.with_suffix(".nvrx-tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600
        )
        with os.fdopen(fd, "w") as f:
            f.write(self._slurmdbd_conf())
        os.chmod(SLURMDBD_CONF.with_suffix(".nvrx-tmp"), 0o600)
        SLURMDBD_CONF.with_suffix(".nvrx-tmp").replace(SLURMDBD_CONF)
        # every client parses slurm.conf; a key this SLURM lacks would fail them all later
        try:
            commands.run_command(["scontrol", "show", "hostnames", self.nodes[0]], env=self.env)
        except SlurmCommandError as err:
            raise ClusterError(f"SLURM rejects the {SLURM_CONF} written: {err}") from None

    def _slurm_conf(self) -> str:
        s, log, run = self.state_dir, self.log_dir, self.run_dir
        lines = [
            CONF_MARKER,
            f"ClusterName={CLUSTER_NAME}",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={CTLD_PORT}",
            "AuthType=auth/munge",
            "CryptoType=crypto/munge",
            "# a requeued job may start again cred_expire+1 s after it ended (default 120)",
            "AuthInfo=cred_expire=10",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={s}/ctld",
            f"SlurmdSpoolDir={s}/spool-%n",
            f"SlurmctldPidFile={run}/slurmctld.pid",
            f"SlurmdPidFile={run}/slurmd-%n.pid",
            f"SlurmctldLogFile={log}/slurmctld.log",
            f"SlurmdLogFile={log}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "MailProg=/bin/true",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1,sched_interval=2",
            "# 22.05 spelling: preempted jobs get their --signal at once",
            "SlurmctldParameters=preempt_send_user_signal",
            "AccountingStorageType=accounting_storage/slurmdbd",
            "AccountingStorageHost=localhost",
            f"AccountingStoragePort={DBD_PORT}",
            "JobAcctGatherType=jobacct_gather/linux",
            "JobAcctGatherFrequency=30",
            "JobCompType=jobcomp/none",
            "# a node DOWN for not responding comes back when its slurmd registers again",
            "ReturnToService=1",
            "# advertise more CPUs than this machine has",
            "SlurmdParameters=config_overrides",
            "SlurmctldTimeout=30",
            f"SlurmdTimeout={self.slurmd_timeout}",
            "MessageTimeout=10",
            "InactiveLimit=0",
            f"KillWait={self.kill_wait}",
            "MinJobAge=300",
            "Waittime=0",
            f"NodeName=DEFAULT CPUs={self.cpus_per_node} Sockets=1 "
            f"CoresPerSocket={self.cpus_per_node} ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN",
        ]
        for i, node in enumerate(self.nodes, start=1):
            lines.append(
                f"NodeName={node} NodeAddr={self._node_addr(node)} NodeHostname={node} "
                f"Port={SLURMD_PORT_BASE + i}"
            )
        lines += [
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
            f"PriorityTier=1 PreemptMode=REQUEUE GraceTime={self.kill_wait}",
            f"PartitionName={self.high_partition} Nodes=ALL Default=NO MaxTime=INFINITE State=UP "
            "PriorityTier=2 PreemptMode=OFF",
        ]
        return "\n".join(lines) + "\n"

    def _slurmdbd_conf(self) -> str:
        lines = [
            CONF_MARKER,
            "AuthType=auth/munge",
            "DbdHost=localhost",
            "DbdAddr=127.0.0.1",
            f"DbdPort={DBD_PORT}",
            "SlurmUser=root",
            "DebugLevel=info",
            f"LogFile={self.log_dir}/slurmdbd.log",
            f"PidFile={self.run_dir}/slurmdbd.pid",
            "StorageType=accounting_storage/mysql",
            "StorageHost=localhost",
            f"StorageUser={DB_USER}",
            f"StoragePass={DB_PASS}",
            f"StorageLoc={DB_NAME}",
        ]
        return "\n".join(lines) + "\n"

    def _node_addr(self, node: str) -> str:
        return f"127.0.2.{self.nodes.index(node) + 1}"

    def _reset_state_dirs(self) -> None:
        shutil.rmtree(self.state_dir / "ctld", ignore_errors=True)
        for spool in self.state_dir.glob("spool-*"):
            shutil.rmtree(spool, ignore_errors=True)
        (self.state_dir / "ctld").mkdir()
        for node in self.nodes:
            (self.state_dir / f"spool-{node}").mkdir()

    def _add_hosts(self) -> None:
        self._remove_hosts()
        lines = "".join(f"{self._node_addr(n)} {n} {HOSTS_MARKER}\n" for n in self.nodes)
        text = HOSTS_FILE.read_text()
        if text and not text.endswith("\n"):
            text += "\n"
        # rewritten in place: /etc/hosts may be a bind mount that a rename would break
        HOSTS_FILE.write_text(text + lines)

    def _remove_hosts(self) -> None:
        try:
            text = HOSTS_FILE.read_text()
        except FileNotFoundError:
            return
        kept = [line for line in text.splitlines(True) if not line.rstrip().endswith(HOSTS_MARKER)]
        if len(kept) != len(text.splitlines(True)):
            HOSTS_FILE.write_text("".join(kept))

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
        env = _clean_env()
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
        stat = _proc_stat(proc.pid)
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
                    f"{_tail(Path(record.log))}"
                )
            return condition()

        try:
            _wait_for(what, ready, timeout)
        except ClusterError as err:
            logs = [Path(record.log), self.log_dir / f"{name}.log"]
            tails = "".join(f"\n--- {p}:\n{_tail(p)}" for p in logs if p.exists())
            raise ClusterError(f"{err}{tails}") from None

    def _answers(self, argv: Sequence[str], timeout: float = 10) -> bool:
        """True when the command succeeds; its error otherwise surfaces in a wait's message."""
        commands.run_command(argv, timeout=timeout, env=self.env)
        return True

    def _ok(self, argv: Sequence[str], timeout: float = 10) -> bool:
        return (
            commands.run_command(argv, timeout=timeout, env=self.env, check=False).returncode == 0
        )

    def _start_munge(self) -> None:
        if self._ok(["bash", "-c", "munge -n </dev/null | unmunge >/dev/null"]):
            logger.info("munged already answers; using it (not ours, left running)")
            return
        key = Path("/etc/munge/munge.key")
        munge_user = pwd.getpwnam("munge")
        if not key.exists() or key.stat().st_size == 0:
            commands.run_command(["/usr/sbin/mungekey", "-c", "-f", "-k", str(key)])
        os.chown(key, munge_user.pw_uid, munge_user.pw_gid)
        key.chmod(0o400)
        for d, mode in (
            (Path("/run/munge"), 0o755),
            (Path("/var/lib/munge"), 0o700),
            (Path("/var/log/munge"), 0o700),
        ):
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, munge_user.pw_uid, munge_user.pw_gid)
            d.chmod(mode)
        with contextlib.suppress(FileNotFoundError):
            Path("/run/munge/munged.pid").unlink()
        self._spawn("munged", ["/usr/sbin/munged", "--foreground"], user="munge")
        self._wait_daemon(
            "munged",
            "munged to answer",
            lambda: self._answers(["bash", "-c", "munge -n </dev/null | unmunge >/dev/null"]),
            15,
        )

    def _mariadb(self, sql: str) -> bool:
        return self._ok(["mariadb", "--protocol=socket", "-uroot", "-e", sql], timeout=20)

    def _start_mariadb(self) -> None:
        if self._mariadb("select 1"):
            logger.info("MariaDB already answers; using it (not ours, left running)")
        else:
            mysql = pwd.getpwnam("mysql")
            run_dir = Path("/run/mysqld")
            run_dir.mkdir(parents=True, exist_ok=True)
            os.chown(run_dir, mysql.pw_uid, mysql.pw_gid)
            data_dir = self.state_dir / "mariadb"
            data_dir.mkdir(exist_ok=True)
            os.chown(data_dir, mysql.pw_uid, mysql.pw_gid)
            if not Path("/var/lib/mysql/mysql").is_dir():
                commands.run_command(
                    [
                        "mariadb-install-db",
                        "--user=mysql",
                        "--datadir=/var/lib/mysql",
                        "--skip-test-db",
                    ],
                    timeout=120,
                )
            self._spawn(
                "mariadbd",
                [
                    "/usr/sbin/mariadbd",
                    "--user=mysql",
                    "--skip-networking",
                    "--datadir=/var/lib/mysql",
                    "--socket=/run/mysqld/mysqld.sock",
                    f"--pid-file={data_dir}/mariadbd.pid",
                    f"--log-error={data_dir}/mariadbd.log",
                    "--innodb-buffer-pool-size=64M",
                ],
            )
            self._wait_daemon(
                "mariadbd",
                "MariaDB to answer",
                lambda: self._answers(["mariadb", "--protocol=socket", "-uroot", "-e", "select 1"]),
                60,
            )
        ok = self._mariadb(
            f"DROP DATABASE IF EXISTS {DB_NAME};"
            f"CREATE USER IF NOT EXISTS '{DB_USER}'@'localhost' IDENTIFIED BY '{DB_PASS}';"
            f"ALTER USER '{DB_USER}'@'localhost' IDENTIFIED BY '{DB_PASS}';"
            f"GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'localhost'; FLUSH PRIVILEGES;"
        )
        if not ok:
            raise ClusterError(f"could not set up database {DB_NAME} for user {DB_USER} in MariaDB")

    def _start_slurmdbd(self) -> None:
        self._spawn("slurmdbd", ["/usr/sbin/slurmdbd", "-D"])
        self._wait_daemon(
            "slurmdbd",
            "slurmdbd to answer",
            lambda: self._answers(["sacctmgr", "-n", "-P", "list", "cluster"]),
            60,
        )

    def _start_slurmctld(self) -> None:
        self._spawn("slurmctld", ["/usr/sbin/slurmctld", "-D"])

        def up() -> bool:
            done = commands.run_command(["scontrol", "ping"], env=self.env, check=False, timeout=10)
            return "UP" in done.stdout

        self._wait_daemon("slurmctld", "slurmctld to answer", up, 60)

    def _cgroup(self, node: str) -> Path:
        return FREEZER_ROOT / CGROUP_NAME / node

    def _start_slurmd(self, node: str) -> None:
        cgroup = None
        if self.use_freezer:
            cgroup = self._cgroup(node)
            cgroup.mkdir(parents=True, exist_ok=True)
            (cgroup / "freezer.state").write_text("THAWED")
        self._spawn(
            f"slurmd-{node}",
            ["/usr/sbin/slurmd", "-D", "-N", node],
            cgroup=cgroup,
            extra_env={NODE_ENV_MARKER: node},
        )

    def node_states(self) -> dict[str, str]:
        """State of each node as sinfo prints it (``idle``, ``down*``, ``alloc``...)."""
        done = commands.run_command(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env)
        states: dict[str, str] = {}
        for line in done.stdout.splitlines():
            name, _, state = line.strip().partition(" ")
            if name:
                states[name] = state.strip()  # one line per partition; they agree
        return states

    def wait_nodes_usable(self, nodes: Iterable[str], timeout: float = 60) -> None:
        """Wait until the nodes answer and take jobs (idle, mixed, allocated, completing)."""
        wanted = list(nodes)

        def usable() -> bool:
            for node in wanted:
                name = f"slurmd-{node}"
                proc = (
                    self._children.get(self._records[name].pid) if name in self._records else None
                )
                if proc is not None and proc.poll() is not None:
                    raise ClusterError(
                        f"slurmd of {node} exited {proc.returncode}; see "
                        f"{self.log_dir}/slurmd-{node}.log:\n"
                        f"{_tail(self.log_dir / f'slurmd-{node}.log')}"
                    )
            states = self.node_states()
            return all(states.get(n) in _USABLE_NODE_STATES for n in wanted)

        _wait_for(f"nodes {wanted} to be usable", usable, timeout)

    def _wait_registered(self) -> None:
        def registered() -> bool:
            done = commands.run_command(
                ["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster,controlport"],
                env=self.env,
                check=False,
            )
            return f"{CLUSTER_NAME}|{CTLD_PORT}" in done.stdout.split()

        _wait_for("slurmctld to register the cluster in slurmdbd", registered, 30)

    # -- stop ----------------------------------------------------------------

    def stop(self, job_timeout: float | None = None, release_lock: bool = True) -> float:
        """Cancel jobs, end every process this cluster started, undo /etc/hosts; return seconds.

        Safe to call twice and after a failed start. Never signals a process
        that it did not start (checked by pid, command name and start time).
        """
        t0 = time.monotonic()
        if job_timeout is None:
            job_timeout = self.kill_wait + 15.0
        ctld = self._records.get("slurmctld")
        if ctld is not None and _is_ours(ctld):
            try:
                self.cancel_all(timeout=job_timeout)
            except (ClusterError, SlurmCommandError) as err:
                logger.warning("could not cancel every job before stopping: %s", err)
        for node in self.nodes:
            self._stop_daemon(f"slurmd-{node}", grace=10)
            self._kill_node_processes(node)
            if self.use_freezer:
                with contextlib.suppress(OSError):
                    self._cgroup(node).rmdir()
        if self.use_freezer:
            with contextlib.suppress(OSError):
                (FREEZER_ROOT / CGROUP_NAME).rmdir()
        for name in ("slurmctld", "slurmdbd", "mariadbd", "munged"):
            self._stop_daemon(name, grace=20)
        for name in list(self._records):  # anything else we recorded
            self._stop_daemon(name, grace=10)
        self._remove_hosts()
        if self.state_dir.exists():
            self._save_state()
        if release_lock:
            self.release()
        return time.monotonic() - t0

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
        fd = _open_if_ours(record)
        if fd is not None:
            try:
                signal.pidfd_send_signal(fd, signal.SIGTERM)
                if not _wait_pidfds([fd], grace):
                    logger.warning(
                        "%s (pid %d) ignored SIGTERM for %g s; SIGKILL", name, record.pid, grace
                    )
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    if not _wait_pidfds([fd], 10):
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

    def _node_pids(self, node: str) -> list[int]:
        """Pids of a node's slurmd, slurmstepds and job processes, found without a cgroup.

        slurmd carries ``NVRX_TEST_SLURM_NODE`` in its environment; a slurmstepd
        (whose environment is empty) listens on a unix socket in the node's
        spool directory; job processes descend from a slurmstepd.
        """
        spool = f"{self.state_dir}/spool-{node}/"
        inodes = set()
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[7].startswith(spool):
                inodes.add(f"socket:[{fields[6]}]")
        marker = f"{NODE_ENV_MARKER}={node}".encode()
        children: dict[int, list[int]] = {}
        roots = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(pid)
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    roots.append(pid)
                elif (entry / "comm").read_text().strip() == "slurmstepd" and any(
                    os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()
                ):
                    roots.append(pid)
            except (OSError, IndexError, ValueError):
                continue
        found, todo = set(), list(roots)
        while todo:
            pid = todo.pop()
            if pid not in found:
                found.add(pid)
                todo.extend(children.get(pid, []))
        return sorted(found)

    def _kill_node_processes(self, node: str) -> list[int]:
        """SIGKILL everything running on a node (slurmd included); return the pids killed."""
        if self.use_freezer:
            cgroup = self._cgroup(node)
            if not cgroup.is_dir():
                return []
            state = cgroup / "freezer.state"
            # frozen, the set of processes cannot change under us, and no pid is recycled
            state.write_text("FROZEN")
            _wait_for(
                f"{cgroup} to freeze",
                lambda: state.read_text().strip() == "FROZEN",
                10,
                interval=0.02,
            )
            pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
            fds = []
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    fds.append(os.pidfd_open(pid))
            for fd in fds:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            state.write_text("THAWED")  # SIGKILL takes effect on thaw
            try:
                _wait_pidfds(fds, 10)
            finally:
                for fd in fds:
                    os.close(fd)
        else:
            pids = self._node_pids(node)
            _kill_pids(pids, 10)
        survivors = [p for p in pids if pid_alive(p)]
        if survivors:
            raise ClusterError(f"processes of {node} survived SIGKILL: {survivors}")
        return pids

    def check_stopped(self) -> list[str]:
        """Every process this cluster ever started that still runs, as 'name pid' strings."""
        alive = [f"{r.name} pid {r.pid}" for r in self._history if _is_ours(r)]
        if self.use_freezer:
            for node in self.nodes:
                procs = self._cgroup(node) / "cgroup.procs"
                if procs.exists() and procs.read_text().split():
                    alive.append(f"job processes of {node}: {procs.read_text().split()}")
        return alive

    # -- node faults -----------------------------------------------------------

    def crash_node(self, node: str) -> list[int]:
        """Kill a node like a power loss: its slurmd and every process of its jobs.

        slurmctld notices after about ``slurmd_timeout`` + 15 s and marks it
        ``down*``; batch jobs on it are requeued. Returns the pids killed.
        """
        self._check_node(node)
        name = f"slurmd-{node}"
        record = self._records.get(name)
        if self.use_freezer:
            pids = self._kill_node_processes(node)
        else:
            if record is not None and (fd := _open_if_ours(record)) is not None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                os.close(fd)
            pids = self._kill_node_processes(node)
        if record is not None:
            self._records.pop(name)
            proc = self._children.pop(record.pid, None)
            if proc is not None:
                proc.wait(timeout=10)
            self._save_state()
        return pids

    def revive_node(self, node: str, timeout: float = 60) -> None:
        """Start a crashed node's slurmd again and wait until the node takes jobs."""
        self._check_node(node)
        name = f"slurmd-{node}"
        if name in self._records and _is_ours(self._records[name]):
            raise ClusterError(f"{node} is running (slurmd pid {self._records[name].pid})")
        self._start_slurmd(node)
        self.wait_nodes_usable([node], timeout=timeout)

    def freeze_node(self, node: str) -> None:
        """Hang a node: freeze its slurmd and job processes (needs the cgroup freezer)."""
        self._freezer_state(node, "FROZEN")

    def thaw_node(self, node: str) -> None:
        """Undo ``freeze_node``."""
        self._freezer_state(node, "THAWED")

    def _freezer_state(self, node: str, state: str) -> None:
        self._check_node(node)
        if not self.use_freezer:
            raise ClusterError("no cgroup v1 freezer on this machine; cannot freeze or thaw nodes")
        (self._cgroup(node) / "freezer.state").write_text(state)

    def _check_node(self, node: str) -> None:
        if node not in self.nodes:
            raise ValueError(f"unknown node {node!r}; the cluster has {self.nodes}")

    # -- jobs ----------------------------------------------------------------

    def run(
        self,
        cmd: Sequence[str] | str,
        timeout: float = 60,
        check: bool = True,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command (a str runs under ``bash -c``) with ``self.env``; text output.

        ``check`` raises SlurmCommandError on a non-zero exit; a timeout always raises.
        """
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        return commands.run_command(
            argv, timeout=timeout, env=self.env, check=check, cwd=cwd or self.jobs_dir
        )

    def sbatch(self, script: str | os.PathLike[str], *args: str, cwd: Path | None = None) -> int:
        """Submit a batch job; return its id.

        ``script`` is a path (``pathlib.Path``) or the script's text (a ``str``;
        ``#!/bin/bash`` is added when it has no ``#!`` line). ``args`` go to
        sbatch before the script (``"-N2"``, ``"-o", "out-%j.txt"``...). The
        job's working directory is ``cwd`` (default ``jobs_dir``).
        """
        cwd = Path(cwd or self.jobs_dir)
        if isinstance(script, str):
            text = script if script.startswith("#!") else "#!/bin/bash\n" + script
            self._script_counter += 1
            path = self.jobs_dir / f"script-{os.getpid()}-{self._script_counter}.sh"
            path.write_text(text)
            path.chmod(0o755)
        else:
            path = Path(script)
        done = self.run(["sbatch", "--parsable", *args, str(path)], cwd=cwd, timeout=30)
        job = done.stdout.strip().split(";")[0]
        if not job.isdigit():
            raise ClusterError(f"sbatch printed {done.stdout!r}, not a job id")
        return int(job)

    def job_state(self, job_id: int) -> str | None:
        """Current state of a job (``PENDING``, ``RUNNING``, ``COMPLETED``...)."""
        return commands.job_state(job_id, env=self.env)

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` fields of a job; ClusterError when slurmctld does not know it."""
        info = commands.show_job(job_id, env=self.env)
        if info is None:
            raise ClusterError(f"slurmctld does not know job {job_id}")
        return info

    def wait_job(
        self,
        job_id: int,
        states: Iterable[str] = TERMINAL_STATES,
        timeout: float = 60,
        fail_fast: bool = True,
    ) -> str:
        """Wait until a job reaches one of ``states`` (default: any end state); return it.

        With ``fail_fast``, a job that ends in a state it cannot leave
        (``COMPLETED``, ``FAILED``, ``CANCELLED``...; not ``PREEMPTED`` or
        ``NODE_FAIL``, which a requeue follows) raises at once.
        """
        wanted = set(states)
        seen: list[str | None] = [None]

        def reached() -> bool:
            seen[0] = self.job_state(job_id)
            if fail_fast and seen[0] in _FINAL_STATES and seen[0] not in wanted:
                raise ClusterError(
                    f"job {job_id} ended {seen[0]} while waiting for {sorted(wanted)}; "
                    f"see {self.log_dir}/slurmctld.log"
                )
            return seen[0] in wanted

        try:
            _wait_for(f"job {job_id} to reach {sorted(wanted)}", reached, timeout)
        except ClusterError as err:
            raise ClusterError(f"{err}; its state is {seen[0]}") from None
        return str(seen[0])

    def requeue(self, job_id: int, timeout: float = 30) -> None:
        """``scontrol requeue`` a job, then let it start again within seconds.

        A requeued job may not start for cred_expire (10 s). Starting it earlier
        is allowed, but a launch in the same second as the end of the previous
        run finds the job's credential revoked and the job FAILS; so the new
        start time is 2 s after the job is pending again.
        """
        self.run(["scontrol", "requeue", str(job_id)])
        self.wait_job(job_id, {"PENDING"}, timeout=timeout)
        self.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now+2"])

    def sacct(self, job_id: int, timeout: float = 15, **kwargs) -> list[dict[str, str]]:
        """sacct rows of a job (all runs, steps included), once accounting caught up.

        Accounting lags slurmctld by about a second: this waits until the job's
        own row shows the state slurmctld reports. ``kwargs`` go to
        ``nvrx.slurm.commands.sacct_rows`` (``fields``, ``all_runs``).
        """
        rows: list[dict[str, str]] = []

        def caught_up() -> bool:
            rows[:] = commands.sacct_rows(job_id, env=self.env, **kwargs)
            info = commands.show_job(job_id, env=self.env)
            main = [r for r in rows if r.get("JobID") == str(job_id)]
            if not main:
                return False
            if info is None or "State" not in main[-1]:
                return True
            return main[-1]["State"].split()[0] == info.get("JobState")

        _wait_for(f"accounting of job {job_id}", caught_up, timeout)
        return rows

    def cancel_all(self, timeout: float = 30) -> list[int]:
        """Cancel every job and wait until slurmctld has none left; return their ids."""
        jobs = commands.queued_job_ids(env=self.env)
        if jobs:
            commands.cancel(jobs, env=self.env)
            _wait_for(
                "cancelled jobs to end", lambda: not commands.queued_job_ids(env=self.env), timeout
            )
        return jobs

    def reset(self, timeout: float = 60) -> list[int]:
        """Back to a clean cluster between tests: cancel jobs, revive or resume every node.

        Returns the ids of the jobs that had to be cancelled.
        """
        jobs = self.cancel_all(timeout=timeout)
        for node in self.nodes:
            if self.use_freezer:
                self.thaw_node(node)
            name = f"slurmd-{node}"
            if name not in self._records or not _is_ours(self._records[name]):
                self._start_slurmd(node)
        states = self.node_states()
        bad = [
            n
            for n in self.nodes
            if states.get(n, "").rstrip("*~#") in ("down", "drained", "draining", "fail")
        ]
        if bad:
            self.run(["scontrol", "update", f"nodename={','.join(bad)}", "state=resume"])
        self.wait_nodes_usable(self.nodes, timeout=timeout)
        return jobs

    def status(self) -> str:
        """Human summary: our daemons and what sinfo/squeue say."""
        lines = [
            f"{r.name:<16} pid {r.pid:<7} {'running' if _is_ours(r) else 'DEAD'}"
            for r in self._records.values()
        ]
        for argv in (["sinfo", "-N", "-o", "%N %P %T %c"], ["squeue"]):
            done = commands.run_command(argv, env=self.env, check=False, timeout=10)
            lines.append(done.stdout.rstrip() or done.stderr.strip())
        return "\n".join(lines)


# -- command line --------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.support.slurm_cluster start|stop|status|check-stopped|...``."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.slurm_cluster", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "action", choices=["start", "stop", "status", "check-stopped", "crash-node", "revive-node"]
    )
    parser.add_argument("node", nargs="?", help="node name, for crash-node and revive-node")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[slurm-cluster] %(message)s")
    try:
        cluster = LocalSlurmCluster()
        if args.action == "start":
            cluster.acquire(timeout=0)
            if cluster.is_running():
                print("already running")
            else:
                print(f"cluster up in {cluster.start():.1f} s: nodes {cluster.nodes}")
        elif args.action == "stop":
            cluster.acquire(timeout=0)
            print(f"stopped in {cluster.stop():.1f} s")
        elif args.action == "status":
            print(cluster.status())
        elif args.action == "check-stopped":
            alive = cluster.check_stopped()
            for line in alive:
                print(f"still running: {line}")
            return 1 if alive else 0
        elif args.node is None:
            parser.error(f"{args.action} needs a node name")
        elif args.action == "crash-node":
            print(f"crashed {args.node}: killed {cluster.crash_node(args.node)}")
        else:
            cluster.revive_node(args.node)
            print(f"revived {args.node}")
    except ClusterUnavailable as err:
        print(f"cannot run a SLURM cluster here: {err}", file=sys.stderr)
        return 2
    except (ClusterError, SlurmCommandError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
