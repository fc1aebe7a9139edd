"""A wrapped function called many times in one process leaves nothing of nvrx behind.

Two ranks (each a process, with the store service its rank 0 hosts) call the same
wrapped function 10 times, the same 5 calls twice over: it returns, it restarts once
then returns, every rank raises ``RestartAbort``, one rank raises ``RestartAbort`` and
leaves while the other restarts without it and returns, it returns. After each call, each process must hold what
it held before the first one: the same threads, no child process, no monitor
process or store service still alive (the host's node agent, which outlives a call,
ends by itself after the last one), no store object (counted with the garbage
collector off, so one left in a reference cycle counts), no connection to the
store, the same TCP connections and open descriptors, no ``/dev/shm`` entry the
call used, and the same log handlers.

A rank SIGKILLed with its monitor process and everything else it started leaves
no progress board in ``/dev/shm``: the board is an anonymous memory file, with no name
to leave, from its first moment.
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
from helpers_inprocess import free_port_pair, launch, rank_env

from tests.support.waiting import wait_until

PROBE = Path(__file__).resolve().with_name("helpers_wrapper_leaks.py")
#: On each rank's PYTHONPATH: the probe imports ``tests.support`` as the test process does.
ROOT = PROBE.parents[2]
WORLD = 2
MODES = ["ok", "restart", "abort", "abort1", "ok"] * 2
STOP = "RestartAbort: the wrapped function asks to stop"
#: What each rank's call of each mode ends in.
OUTCOMES = {
    "ok": [["ok", 0], ["ok", 0]],
    "restart": [["restart", 1], ["restart", 1]],
    "abort": [STOP, STOP],
    "abort1": [["abort1", 1], STOP],
}


def _run_probes(tmp: Path) -> list[dict]:
    port = free_port_pair()
    procs = []
    for rank in range(WORLD):
        env = rank_env(tmp / "logs", rank, WORLD, port, job_id="leaks")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        with open(tmp / f"probe-{rank}.log", "wb") as fh:
            procs.append(subprocess.Popen(
                [sys.executable, str(PROBE), str(tmp / f"report-{rank}.json"), *MODES],
                env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
            ))  # fmt: skip
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(timeout=500))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    output = "\n".join((tmp / f"probe-{r}.log").read_text(errors="replace")[-3000:] for r in range(WORLD))
    assert codes == [0] * WORLD, output
    return [json.loads((tmp / f"report-{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.timeout(600)
def test_ten_calls_of_two_ranks_leave_nothing_behind(tmp_path):
    reports = _run_probes(tmp_path)
    for rank, report in enumerate(reports):
        base = report["baseline"]
        assert [c["outcome"] for c in report["calls"]] == [OUTCOMES[m][rank] for m in MODES], rank
        for i, call in enumerate(report["calls"]):
            after, what = call["after"], f"rank {rank} after call {i} ({call['mode']!r})"
            assert call["monitor_tree"], f"{what}: the probe saw no monitor"
            assert after["threads"] == base["threads"], what
            assert after["children"] == [], what
            assert after["monitor_tree_alive"] == [], (what, call["monitor_tree"])
            assert after["stores"] == base["stores"], what
            assert after["store_sockets"] == [], what
            assert after["tcp"] == base["tcp"], what
            assert after["fds"] == base["fds"], what
            assert after["shm_left"] == [] and after["board_mapped"] == [], what
            assert after["handlers"] == base["handlers"], what
        # the host's node agent (each rank sees the one its host's monitors beat to) ends
        # by itself once the last call's ranks said goodbye
        assert report["agents_seen"] >= 1 and report["agents_left"] == [], report["agents_left"]


def _board_mappings(pid: int) -> list[str]:
    """The progress-board lines of process ``pid``'s memory map (none once it ended)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({line.split(None, 5)[-1] for line in maps if "nvrx-progress-" in line})


@pytest.mark.timeout(120)
def test_a_rank_killed_with_its_monitor_leaves_no_progress_board_behind(tmp_path):
    ranks = launch(tmp_path, 1, fault="sleep", fault_ranks=[0], init_pg=False)  # defaults: 60 s
    try:
        wait_until("rank 0 in its function", lambda: ranks.calls(0), timeout=60)
        rank = psutil.Process(ranks.procs[0].pid)
        descendants = rank.children(recursive=True)
        [monitor] = [p for p in descendants if _board_mappings(p.pid)]
        [mapped] = _board_mappings(rank.pid)
        assert _board_mappings(monitor.pid) == [mapped]  # one board, shared by both
        assert mapped == f"/memfd:nvrx-progress-{rank.pid} (deleted)", mapped  # no name
        for proc in [rank, *descendants]:  # as a node's end would: no one left to clean up
            proc.kill()
        psutil.wait_procs([rank, *descendants], timeout=30)
    finally:
        ranks.kill()


def _shm_boards() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("nvrx-progress-*")}


@pytest.mark.timeout(120)
def test_a_rank_killed_with_its_monitor_before_the_monitor_maps_the_board_leaves_nothing(
    tmp_path,
):
    before = _shm_boards()
    ranks = launch(tmp_path, 1, fault="sleep", fault_ranks=[0], init_pg=False)
    try:
        rank = psutil.Process(ranks.procs[0].pid)
        # the rank made its board; its monitor process is not started, or has not mapped it
        wait_until("rank 0's board", lambda: _board_mappings(rank.pid), timeout=60, interval=0.001)
        rank.suspend()  # starts nothing more
        gone = [rank, *rank.children(recursive=True)]
        for proc in gone:
            proc.kill()
        psutil.wait_procs(gone, timeout=30)
        assert _shm_boards() - before == set()
    finally:
        ranks.kill()
