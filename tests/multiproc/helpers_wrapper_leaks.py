"""Child process of ``test_wrapper_leaks``: one rank calling the same wrapped function many times.

Run as ``python helpers_wrapper_leaks.py OUT.json MODE...`` with RANK, WORLD_SIZE and
MASTER_ADDR/MASTER_PORT set; every rank of the job runs the same modes. Before the
first call and after each call it takes a snapshot of what could be left behind
(threads, child processes, the monitor process and what it started, store objects,
TCP connections, connections to the Wrapper's store, open descriptors, the
``/dev/shm`` entries the call used, log handlers of the root and ``nvrx`` loggers) and
writes them all to OUT.json. The modes:

* ``ok``: returns;
* ``restart``: the last rank raises in its first round, the others train until the
  Wrapper interrupts them; every rank returns from the second round;
* ``abort``: every rank raises ``RestartAbort`` (the Wrapper re-raises it);
* ``abort1``: the last rank raises ``RestartAbort``, so it leaves; the others train
  until interrupted and return from the second round without it.

The garbage collector is off during the calls and never runs before a snapshot, so
objects kept alive by reference cycles count as left behind.
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from helpers_inprocess import FAST  # this file runs as a script: its folder is on sys.path

from tests.support.waiting import wait_until


def _loggers() -> dict[str, logging.Logger]:
    found = {"<root>": logging.getLogger()}
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (name == "nvrx" or name.startswith("nvrx.")):
            found[name] = logger
    return found


def _fds() -> list[str]:
    """``fd -> target`` of this process's open descriptors."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        found.append(f"{name} -> {target}")
    return sorted(found, key=lambda s: int(s.split()[0]))


def _alive(pid: int, create_time: float) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.create_time() == create_time and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def is_host_agent(cmdline: list[str] | None) -> bool:
    """Whether ``cmdline`` is a host's node agent's (``python -m nvrx.node_agent host FD``)."""
    return (cmdline or [])[-3:-1] == ["nvrx.node_agent", "host"]


def _host_agent_now(pid: int) -> bool:
    """Whether process ``pid`` runs a host's node agent now. A monitor may be starting the
    host's agent as ``CallRecord.see`` looks at its children: caught between its fork and
    its exec, the agent shows the monitor's command line (or, just past its exec, none),
    so only a later look tells it from the call's own processes."""
    import psutil

    try:
        return is_host_agent(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def _job_agents(master_port: str) -> list[tuple[int, float]]:
    """The node agents of this job: started by a monitor of one of its ranks, they keep
    the ranks' environment, whose ``MASTER_PORT`` (as it was before the first call: the
    Wrapper sets its own) no other job on this machine has."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline", "create_time"]):
        try:
            if is_host_agent(proc.info["cmdline"]) and (
                proc.environ().get("MASTER_PORT") == master_port
            ):
                found.append((proc.pid, proc.info["create_time"]))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


class CallRecord:
    """What one call used, seen from inside its function: its monitor process tree, the
    host's node agent and the ``/dev/shm`` entries its processes held open (the progress
    board is not one: it has no name, and ``snapshot`` looks for its mapping)."""

    def __init__(self, master_port: str = "") -> None:  # the job's, read before any call
        self.master_port = master_port
        self.monitor_tree: list[tuple[int, float, str]] = []
        self.agents: list[tuple[int, float]] = []  # the host's, not the call's: end by themselves
        self.shm: set[str] = set()

    def see(self, call_wrapper: Any) -> None:
        import psutil

        monitor = psutil.Process(call_wrapper.monitor_process.pid)
        for proc in (monitor, *monitor.children(recursive=True)):
            entry = (proc.pid, proc.create_time(), " ".join(proc.cmdline())[:160])
            if not is_host_agent(proc.cmdline()) and entry not in self.monitor_tree:
                self.monitor_tree.append(entry)
            for f in proc.open_files():
                if f.path.startswith("/dev/shm/"):
                    self.shm.update({f.path, os.path.dirname(f.path)} - {"/dev/shm"})
        self.agents += [a for a in self._wait_for_agent() if a not in self.agents]

    def _wait_for_agent(self) -> list[tuple[int, float]]:
        """The host's agent: started by whichever monitor of the host beat first, maybe
        after this function began, or still the one of the previous call, ending."""
        agents: list[tuple[int, float]] = []

        def found() -> bool:
            agents[:] = _job_agents(self.master_port)
            return bool(agents)

        wait_until("this host's node agent", found, timeout=30, interval=0.05)
        return agents


def snapshot(record: CallRecord, store_port: int) -> dict[str, Any]:
    """What this process holds now."""
    import psutil
    import torch.distributed as dist

    me = psutil.Process()
    tcp = me.net_connections("tcp")
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "children": sorted(
            f"{c.pid} {' '.join(c.cmdline())[:160]}" for c in me.children(recursive=True)
        ),
        "monitor_tree_alive": sorted(
            f"{pid} {cmd}"
            for pid, created, cmd in record.monitor_tree
            if _alive(pid, created) and not _host_agent_now(pid)
        ),
        "stores": sorted(
            type(o).__qualname__ for o in gc.get_objects() if isinstance(o, dist.Store)
        ),
        "tcp": sorted(
            f"{c.laddr.port} -> {c.raddr.port if c.raddr else '-'} {c.status}" for c in tcp
        ),
        "store_sockets": sorted(
            f"fd {c.fd}: {c.laddr.port} -> {c.raddr.port} {c.status}"
            for c in tcp
            if c.raddr and store_port in (c.raddr.port, c.laddr.port)
        ),
        "fds": _fds(),
        "shm_left": sorted(p for p in record.shm if os.path.exists(p)),
        "board_mapped": sorted(
            line.split(None, 5)[-1]
            for line in Path("/proc/self/maps").read_text().splitlines()
            if "nvrx-progress-" in line
        ),
        "handlers": {
            name: sorted(type(h).__name__ for h in logger.handlers)
            for name, logger in _loggers().items()
            if logger.handlers
        },
    }


def _train_until_interrupted() -> None:
    """Training steps until the Wrapper interrupts this rank (a peer faulted or left)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.01)  # one step
    raise AssertionError("the Wrapper did not interrupt this rank within 60 s")


def main(out: Path, modes: list[str]) -> int:
    import torch  # noqa: F401 - imported before the baseline, as a training script does

    import nvrx.inprocess as inprocess
    from nvrx.inprocess.exception import RestartAbort

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master_port = os.environ["MASTER_PORT"]
    store_port = int(master_port) + 1
    last = rank == world_size - 1
    record = CallRecord(master_port)
    wrapper = {k: datetime.timedelta(seconds=v) for k, v in FAST.items()}

    @inprocess.Wrapper(**wrapper)
    def train(mode: str, call_wrapper: inprocess.CallWrapper | None = None) -> list[Any]:
        record.see(call_wrapper)
        first = call_wrapper.iteration == 0
        if mode == "abort" or (mode == "abort1" and last):
            raise RestartAbort("the wrapped function asks to stop")
        if mode in ("restart", "abort1") and first:
            if last:
                raise RuntimeError("first round fails: the Wrapper restarts")
            _train_until_interrupted()
        return [mode, call_wrapper.iteration]

    # Only reference counting frees objects here: what a call leaves in a reference
    # cycle (alive until some later collection) shows in the snapshots.
    gc.collect()
    gc.disable()
    report: dict[str, Any] = {"baseline": snapshot(CallRecord(), store_port), "calls": []}
    calls: list[CallRecord] = []
    for mode in modes:
        record = CallRecord(master_port)
        calls.append(record)
        try:
            outcome: Any = train(mode)
        except RestartAbort as exc:
            outcome = f"RestartAbort: {exc}"
        report["calls"].append(
            {
                "mode": mode,
                "outcome": outcome,
                "monitor_tree": [f"{pid} {cmd}" for pid, _, cmd in record.monitor_tree],
                "shm_used": sorted(record.shm),
                "after": snapshot(record, store_port),
            }
        )
    import psutil

    agents = {agent for call in calls for agent in call.agents}
    live = []
    for pid, created in agents:  # each one's end, waited on (not a process that reused its pid)
        if _alive(pid, created):
            live.append(psutil.Process(pid))
    psutil.wait_procs(live, timeout=30)
    report["agents_seen"] = len(agents)
    report["agents_left"] = sorted(pid for pid, created in agents if _alive(pid, created))
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
