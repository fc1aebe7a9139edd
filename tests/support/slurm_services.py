"""Bringing up each service of the local test cluster: munged, MariaDB,
slurmdbd, slurmctld and one slurmd per node; then waiting until the nodes
take jobs and the cluster is registered in accounting.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
from collections.abc import Iterable, Sequence
from pathlib import Path

from nvrx.slurm import commands
from tests.support.slurm_config import (
    CLUSTER_NAME,
    CTLD_PORT,
    DB_NAME,
    DB_PASS,
    DB_USER,
    NODE_ENV_MARKER,
)
from tests.support.slurm_errors import ClusterError, tail, wait_for

logger = logging.getLogger(__name__)


#: Node states sinfo reports for a node that answers and can take jobs.
_USABLE_NODE_STATES = {"idle", "mixed", "allocated", "completing"}


class ServiceStarts:
    """Mixin of ``LocalSlurmCluster``: starting its services and waiting for them.

    Uses ``nodes``, ``state_dir``, ``log_dir``, ``env``, ``use_freezer``,
    ``_children``, ``_records``, ``_spawn``, ``_wait_daemon`` and ``_cgroup``.
    """

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
                        f"{tail(self.log_dir / f'slurmd-{node}.log')}"
                    )
            states = self.node_states()
            return all(states.get(n) in _USABLE_NODE_STATES for n in wanted)

        wait_for(f"nodes {wanted} to be usable", usable, timeout)

    def _wait_registered(self) -> None:
        def registered() -> bool:
            done = commands.run_command(
                ["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster,controlport"],
                env=self.env,
                check=False,
            )
            return f"{CLUSTER_NAME}|{CTLD_PORT}" in done.stdout.split()

        wait_for("slurmctld to register the cluster in slurmdbd", registered, 30)
