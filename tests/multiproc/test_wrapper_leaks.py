"""A wrapped function called several times in one process leaves nothing of nvrx behind.

One process (a single rank, WORLD_SIZE=1, its own store service) calls the
same wrapped function four times: it returns, it restarts once then returns,
it raises ``RestartAbort``, it returns again. After each call, the process
must hold what it held before the first one: the same threads, no child
process, no monitor process or store service still alive, no store object,
no TCP connection, the same open descriptors, and no log handler but the one
stream handler that ``nvrx.inprocess`` installs once per process.

A rank SIGKILLed with its monitor process and everything else it started leaves
no progress board in ``/dev/shm``: the monitor removed its name when it mapped it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers_inprocess import launch, rank_env

from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

PROBE = Path(__file__).resolve().with_name("helpers_wrapper_leaks.py")
MODES = ["ok", "restart", "abort", "ok"]
OUTCOMES = [["ok", 0], ["restart", 1], "RestartAbort: the wrapped function asks to stop", ["ok", 0]]


def _run_probe(tmp: Path) -> dict:
    env = rank_env(tmp / "logs", job_id="leaks")
    out = tmp / "report.json"
    log = tmp / "probe.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, str(PROBE), str(out), *MODES],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        code = proc.wait(timeout=100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text(errors="replace")
    assert code == 0, output
    return json.loads(out.read_text())


def test_repeated_calls_leave_no_threads_processes_stores_or_handlers(tmp_path):
    report = _run_probe(tmp_path)
    base = report["baseline"]
    # the one documented, once-per-process handler (docs/inprocess.md, Logging)
    expected_handlers = dict(base["handlers"])
    expected_handlers["nvrx.inprocess"] = ["StreamHandler"]
    assert [c["outcome"] for c in report["calls"]] == OUTCOMES
    for call in report["calls"]:
        after, what = call["after"], f"after the {call['mode']!r} call"
        assert call["monitor_tree"], f"{what}: the probe saw no monitor process"
        assert after["threads"] == base["threads"], what
        assert after["children"] == [], what
        assert after["monitor_tree_alive"] == [], (what, call["monitor_tree"])
        assert after["stores"] == base["stores"], what
        assert after["tcp"] == base["tcp"], what
        assert after["fds"] == base["fds"], what
        assert after["handlers"] == expected_handlers, what


def _board_mappings(pid: int) -> list[str]:
    """The progress-board lines of process ``pid``'s memory map (none once it ended)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({line.split(None, 5)[-1] for line in maps if "nvrx-progress-" in line})


def test_a_rank_killed_with_its_monitor_leaves_no_progress_board_behind(tmp_path):
    ranks = launch(tmp_path, 1, fault="sleep", fault_ranks=[0], init_pg=False)  # defaults: 60 s
    try:
        wait_until("rank 0 in its function", lambda: ranks.calls(0), timeout=60)
        rank = psutil.Process(ranks.procs[0].pid)
        descendants = rank.children(recursive=True)
        [monitor] = [p for p in descendants if _board_mappings(p.pid)]
        [mapped] = _board_mappings(rank.pid)
        assert _board_mappings(monitor.pid) == [mapped]  # one board, shared by both
        path = mapped.removesuffix(" (deleted)")
        assert mapped.endswith(" (deleted)") and not Path(path).exists(), mapped
        for proc in [rank, *descendants]:  # as a node's end would: no one left to clean up
            proc.kill()
        psutil.wait_procs([rank, *descendants], timeout=30)
        assert not Path(path).exists()
    finally:
        ranks.kill()
