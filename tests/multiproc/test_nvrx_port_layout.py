"""A script in NVRx's port layout runs unchanged under nvrx-supervise.

The application's own store is on ``MASTER_PORT + 1`` and the Wrapper is given
``store_kwargs={'port': MASTER_PORT + 2}`` (``app_nvrx_port_layout.py``). Under a
supervisor the Wrapper uses the supervisor's store instead, and the supervisor's store,
by default, is on neither of those ports. Rank 1 fails in the first round: both ranks end
after one in-process restart, and the supervisor restarts no process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvrx import jobenv
from nvrx.events import read_dir
from tests.support.ports import free_port_run

pytestmark = pytest.mark.timeout(150)

APP = Path(__file__).resolve().parent / "app_nvrx_port_layout.py"
WORLD_SIZE = 2


def free_block() -> int:
    """A port P with P .. P + 2 and the supervisor's default store port for P all free."""
    return free_port_run(3, also=(jobenv.STORE_PORT_OFFSET,))


@pytest.mark.parametrize("store_port", ["default", "elsewhere"])
def test_nvrx_port_layout_restarts_once_in_process_under_the_supervisor(tmp_path, store_port):
    master = free_block()
    options = ["--master-port", str(master)]
    if store_port == "elsewhere":  # the Wrapper must still follow the supervisor, not store_kwargs
        options += ["--store-port", str(free_block())]
    log_dir, out_dir = tmp_path / "logs", tmp_path / "out"
    out_dir.mkdir()
    job_id = f"layout-{master}"
    command = [
        sys.executable, "-m", "nvrx.supervisor.cli", "--nproc-per-node", str(WORLD_SIZE),
        "--job-id", job_id, "--log-dir", str(log_dir), "--max-restarts", "0", *options,
        "--", sys.executable, str(APP), str(out_dir),
    ]  # fmt: skip
    output = tmp_path / "supervisor.out"
    with output.open("w") as sink:
        proc = subprocess.Popen(
            command, cwd=tmp_path, env=dict(os.environ), stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    text = output.read_text(errors="replace")
    assert code == 0, text
    results = [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(WORLD_SIZE)]
    assert [(r["rank"], r["iteration"]) for r in results] == [(0, 1), (1, 1)], text
    assert [r["peers"] for r in results] == ["rank 1", "rank 0"], text
    events, _ = read_dir(log_dir / job_id)
    supervisor_restarts = [
        e for e in events
        if e["component"] == "supervisor" and e["kind"] == "restart_decision"
        and e["decision"] == "restart"
    ]  # fmt: skip
    assert supervisor_restarts == [], text
    assert [e["kind"] for e in events if e["kind"] == "child_start"] == ["child_start"] * 2, text
