"""A wrapped function called several times in one process leaves nothing of nvrx behind.

One process (a single rank, WORLD_SIZE=1, its own store service) calls the
same wrapped function four times: it returns, it restarts once then returns,
it raises ``RestartAbort``, it returns again. After each call, the process
must hold what it held before the first one: the same threads, no child
process, no monitor process or store service still alive, no store object,
no TCP connection, the same open descriptors, and no log handler but the one
stream handler that ``nvrx.inprocess`` installs once per process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_inprocess import rank_env

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
