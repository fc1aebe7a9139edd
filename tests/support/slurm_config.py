"""What the local test cluster writes on this machine: slurm.conf,
slurmdbd.conf, its /etc/hosts entries and fresh state directories; the
names, ports and paths they use.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from nvrx.slurm import commands
from nvrx.slurm.commands import SlurmCommandError
from tests.support.slurm_errors import ClusterError

SLURM_CONF = Path("/etc/slurm/slurm.conf")
SLURMDBD_CONF = Path("/etc/slurm/slurmdbd.conf")
# the files written before the split carry this marker too: keep it as it is
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


class ConfigFiles:
    """Mixin of ``LocalSlurmCluster``: its configuration files and machine layout.

    Uses ``nodes``, ``partition``, ``high_partition``, ``cpus_per_node``,
    ``state_dir``, ``log_dir``, ``run_dir``, ``slurmd_timeout``, ``kill_wait``, ``env``.
    """

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

    def _cgroup(self, node: str) -> Path:
        return FREEZER_ROOT / CGROUP_NAME / node
