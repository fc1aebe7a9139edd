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

The work is split by concern: ``slurm_config`` (slurm.conf, slurmdbd.conf,
/etc/hosts), ``slurm_daemons`` (spawning, waiting for and stopping our
daemons, the pid file, the lock), ``slurm_services`` (munged, MariaDB,
slurmdbd, slurmctld, slurmd), ``slurm_node_faults`` (crash, revive, freeze,
thaw), ``slurm_jobs`` (the job client) and ``slurm_errors``; this module
puts them together in ``LocalSlurmCluster`` and holds the command line.

By hand: ``python -m tests.support.slurm_cluster start|stop|status|check-stopped``
and ``crash-node NODE`` / ``revive-node NODE``. Must run as root.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from nvrx.slurm import commands
from nvrx.slurm.commands import TERMINAL_STATES, SlurmCommandError
from tests.support.slurm_config import CGROUP_NAME, FREEZER_ROOT, ConfigFiles
from tests.support.slurm_daemons import DaemonControl, DaemonRecord, clean_env, is_ours, pid_alive
from tests.support.slurm_errors import ClusterError, ClusterUnavailable
from tests.support.slurm_jobs import JobClient
from tests.support.slurm_node_faults import NodeFaults
from tests.support.slurm_services import ServiceStarts

__all__ = [
    "TERMINAL_STATES",
    "ClusterError",
    "ClusterUnavailable",
    "LocalSlurmCluster",
    "main",
    "pid_alive",
]

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO_ROOT / "scripts" / "install_slurm.sh"
STATE_DIR = Path(os.environ.get("NVRX_TEST_SLURM_DIR", "/var/spool/nvrx-test-slurm"))


class LocalSlurmCluster(ConfigFiles, DaemonControl, ServiceStarts, NodeFaults, JobClient):
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
        self.env = clean_env()
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._records: dict[str, DaemonRecord] = {}
        self._history: list[DaemonRecord] = []
        self._script_counter = 0
        self._load_state()

    # -- start ---------------------------------------------------------------

    @staticmethod
    def check_can_run() -> None:
        """Raise ClusterUnavailable, with the reason, when this machine cannot host the cluster."""
        if os.geteuid() != 0:
            raise ClusterUnavailable(f"not root (euid {os.geteuid()})")
        missing = [tool for tool in ("apt-get", "dpkg-query") if shutil.which(tool) is None]
        if missing:
            raise ClusterUnavailable(f"{', '.join(missing)} not found")

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
        if ctld is not None and is_ours(ctld):
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

    def check_stopped(self) -> list[str]:
        """Every process this cluster ever started that still runs, as 'name pid' strings."""
        alive = [f"{r.name} pid {r.pid}" for r in self._history if is_ours(r)]
        if self.use_freezer:
            for node in self.nodes:
                procs = self._cgroup(node) / "cgroup.procs"
                if procs.exists() and procs.read_text().split():
                    alive.append(f"job processes of {node}: {procs.read_text().split()}")
        return alive

    def status(self) -> str:
        """Human summary: our daemons and what sinfo/squeue say."""
        lines = [
            f"{r.name:<16} pid {r.pid:<7} {'running' if is_ours(r) else 'DEAD'}"
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
        return _act(LocalSlurmCluster(), args, parser)
    except ClusterUnavailable as err:
        print(f"cannot run a SLURM cluster here: {err}", file=sys.stderr)
        return 2
    except (ClusterError, SlurmCommandError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def _act(
    cluster: LocalSlurmCluster, args: argparse.Namespace, parser: argparse.ArgumentParser
) -> int:
    """Do one command-line action; return the exit status."""
    if args.action == "start":
        cluster.acquire(timeout=0)
        if cluster.is_running():
            print("already running")
        else:
            print(f"cluster up in {cluster.start():.1f} s: nodes {cluster.nodes}")
        return 0
    if args.action == "stop":
        cluster.acquire(timeout=0)
        print(f"stopped in {cluster.stop():.1f} s")
        return 0
    if args.action == "status":
        print(cluster.status())
        return 0
    if args.action == "check-stopped":
        alive = cluster.check_stopped()
        for line in alive:
            print(f"still running: {line}")
        return 1 if alive else 0
    if args.node is None:
        parser.error(f"{args.action} needs a node name")
    if args.action == "crash-node":
        print(f"crashed {args.node}: killed {cluster.crash_node(args.node)}")
    else:
        cluster.revive_node(args.node)
        print(f"revived {args.node}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
