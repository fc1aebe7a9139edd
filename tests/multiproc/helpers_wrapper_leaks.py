"""Child process of ``test_wrapper_leaks``: one wrapped function called several times in one process.

Run as ``python helpers_wrapper_leaks.py OUT.json MODE...`` with RANK=0,
WORLD_SIZE=1 and MASTER_ADDR/MASTER_PORT set. Before the first call and after
each call it takes a snapshot of what could be left behind (threads, child
processes, the monitor process and what it started, store objects, TCP
connections, open descriptors, log handlers of the root and ``nvrx`` loggers)
and writes them all to OUT.json. The modes: ``ok`` (returns), ``restart``
(raises in its first round, returns in the second), ``abort`` (raises
``RestartAbort``: the Wrapper re-raises it). The garbage collector is off
during the calls, so objects kept alive by reference cycles count as left behind.
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from helpers_inprocess import FAST  # this file runs as a script: its folder is on sys.path


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


def snapshot(monitor_tree: list[tuple[int, float, str]]) -> dict[str, Any]:
    """What this process holds now."""
    import psutil
    import torch.distributed as dist

    me = psutil.Process()
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "children": sorted(
            f"{c.pid} {' '.join(c.cmdline())[:160]}" for c in me.children(recursive=True)
        ),
        "monitor_tree_alive": sorted(
            f"{pid} {cmd}" for pid, created, cmd in monitor_tree if _alive(pid, created)
        ),
        "stores": sorted(
            type(o).__qualname__ for o in gc.get_objects() if isinstance(o, dist.Store)
        ),
        "tcp": sorted(
            f"{c.laddr.port} -> {c.raddr.port if c.raddr else '-'} {c.status}"
            for c in me.net_connections("tcp")
        ),
        "fds": _fds(),
        "handlers": {
            name: sorted(type(h).__name__ for h in logger.handlers)
            for name, logger in _loggers().items()
            if logger.handlers
        },
    }


def main(out: Path, modes: list[str]) -> int:
    import psutil
    import torch  # noqa: F401 - imported before the baseline, as a training script does

    import nvrx.inprocess as inprocess
    from nvrx.inprocess.exception import RestartAbort

    monitor_tree: list[tuple[int, float, str]] = []
    wrapper = {k: datetime.timedelta(seconds=v) for k, v in FAST.items()}

    @inprocess.Wrapper(**wrapper)
    def train(mode: str, call_wrapper: inprocess.CallWrapper | None = None) -> list[Any]:
        monitor = psutil.Process(call_wrapper.monitor_process.pid)
        for proc in (monitor, *monitor.children(recursive=True)):
            entry = (proc.pid, proc.create_time(), " ".join(proc.cmdline())[:160])
            if entry not in monitor_tree:
                monitor_tree.append(entry)
        if mode == "restart" and call_wrapper.iteration == 0:
            raise RuntimeError("first round fails: the Wrapper restarts")
        if mode == "abort":
            raise RestartAbort("the wrapped function asks to stop")
        return [mode, call_wrapper.iteration]

    # Only reference counting frees objects here: what a call leaves in a reference
    # cycle (alive until some later collection) shows in the snapshots.
    gc.collect()
    gc.disable()
    report: dict[str, Any] = {"baseline": snapshot([]), "calls": []}
    for mode in modes:
        monitor_tree.clear()
        try:
            outcome: Any = train(mode)
        except RestartAbort as exc:
            outcome = f"RestartAbort: {exc}"
        report["calls"].append(
            {
                "mode": mode,
                "outcome": outcome,
                "monitor_tree": [f"{pid} {cmd}" for pid, _, cmd in monitor_tree],
                "after": snapshot(monitor_tree),
            }
        )
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
