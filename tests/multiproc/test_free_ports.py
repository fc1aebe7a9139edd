"""Two jobs of one node each, started side by side without ports, both run: each takes a free
pair of ports and says which."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.waiting import wait_until

#: The rank writes the ports it got, then (job A) blocks on a FIFO until the test opens it.
CHILD = """
import json, os, sys
ports = {k: os.environ[k] for k in ("MASTER_PORT", "NVRX_STORE_PORT")}
with open(sys.argv[1] + ".tmp", "w") as fh:
    json.dump(ports, fh)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
if len(sys.argv) > 2:
    with open(sys.argv[2]) as gate:
        gate.read()
"""


def _job(tmp_path: Path, name: str, *child_args: str) -> list[str]:
    return [
        sys.executable, "-m", "nvrx.supervisor", "--nproc-per-node", "1",
        "--log-dir", str(tmp_path / "logs"), "--",
        sys.executable, "-c", CHILD, str(tmp_path / f"{name}.json"), *child_args,
    ]  # fmt: skip


def _stated(ports: dict[str, str]) -> str:
    return (
        f"nvrx-supervise: no --master-port given; using free ports {ports['MASTER_PORT']} "
        f"(ranks' MASTER_PORT) and {ports['NVRX_STORE_PORT']} (nvrx store)"
    )


@pytest.mark.timeout(180)
def test_two_single_node_jobs_side_by_side_take_free_ports(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    err_a = tmp_path / "a.err"
    with err_a.open("w") as sink:
        first = subprocess.Popen(
            _job(tmp_path, "a", str(gate)), stdout=subprocess.DEVNULL, stderr=sink,
            env=dict(os.environ), start_new_session=True,
        )  # fmt: skip
    try:
        wait_until("job A's rank to start", (tmp_path / "a.json").exists, 60, state=err_a.read_text)
        second = subprocess.run(
            _job(tmp_path, "b"), capture_output=True, text=True, env=dict(os.environ), timeout=90
        )
        assert first.poll() is None, "job A ended before job B ran beside it"
        with gate.open("w"):
            pass  # job A's rank reads end-of-file and ends
        assert first.wait(60) == 0, err_a.read_text()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert second.returncode == 0, second.stderr
    ports_a = json.loads((tmp_path / "a.json").read_text())
    ports_b = json.loads((tmp_path / "b.json").read_text())
    assert set(ports_a.values()).isdisjoint(ports_b.values())
    for ports in (ports_a, ports_b):
        assert int(ports["NVRX_STORE_PORT"]) == int(ports["MASTER_PORT"]) + 3
    assert _stated(ports_a) in err_a.read_text().splitlines()
    assert _stated(ports_b) in second.stderr.splitlines()
