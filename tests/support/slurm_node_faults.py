"""Node faults for the local test cluster: crash (every process of a node
killed at once), revive, freeze and thaw, through the node's freezer cgroup
when the machine has one, else by finding the node's processes in /proc.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from tests.support.slurm_config import NODE_ENV_MARKER
from tests.support.slurm_daemons import is_ours, kill_pids, open_if_ours, pid_alive, wait_pidfds
from tests.support.slurm_errors import ClusterError, wait_for


class NodeFaults:
    """Mixin of ``LocalSlurmCluster``: crashing, reviving, freezing and thawing nodes.

    Uses ``nodes``, ``state_dir``, ``use_freezer``, ``_children``, ``_records``,
    ``_cgroup``, ``_save_state``, ``_start_slurmd`` and ``wait_nodes_usable``.
    """

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
            wait_for(
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
                wait_pidfds(fds, 10)
            finally:
                for fd in fds:
                    os.close(fd)
        else:
            pids = self._node_pids(node)
            kill_pids(pids, 10)
        survivors = [p for p in pids if pid_alive(p)]
        if survivors:
            raise ClusterError(f"processes of {node} survived SIGKILL: {survivors}")
        return pids

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
            if record is not None and (fd := open_if_ours(record)) is not None:
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
        if name in self._records and is_ours(self._records[name]):
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
