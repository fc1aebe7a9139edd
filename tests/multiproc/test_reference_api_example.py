"""``examples/reference_api.py``, a script using only the reference's API names, on 2 real ranks.

Each rank is a process with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set as a
launcher sets them (gloo on loopback, the Wrapper's own store service). The
script injects a CPU fault (``Fault.WORKLOAD_EXC``, raised by the training
loop, or ``Fault.ASYNC_EXC``, raised asynchronously in the main thread) with
``tools.inject_fault`` on rank 1 in the first iteration; the run must restart
exactly once and finish on both ranks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_inprocess import free_port_pair, rank_env

from nvrx.events import read_dir

pytestmark = pytest.mark.timeout(120)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reference_api.py"
WORLD_SIZE = 2
DONE = re.compile(
    r"^reference_api: done rank=(\d+) world_size=(\d+) iteration=(\d+) steps=(\d+)$", re.M
)
NESTED = re.compile(r"\[NestedRestarter\] name=\[InProcess\] state=(\w+)(?: stage=(\w+))?")


def _start(tmp: Path, rank: int, port: int, args: list[str]) -> subprocess.Popen[bytes]:
    env = rank_env(tmp / "logs", rank, WORLD_SIZE, port, job_id="reference-api")
    with open(tmp / f"rank-{rank}.out", "wb") as out, open(tmp / f"rank-{rank}.err", "wb") as err:
        return subprocess.Popen(
            [sys.executable, str(EXAMPLE), *args],
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )


def _output(tmp: Path) -> str:
    parts = []
    for rank in range(WORLD_SIZE):
        for stream in ("out", "err"):
            path = tmp / f"rank-{rank}.{stream}"
            text = path.read_text(errors="replace") if path.exists() else ""
            parts.append(f"--- rank {rank} std{stream} ---\n{text[-4000:]}")
    return "\n".join(parts)


@pytest.mark.parametrize("fault", ["WORKLOAD_EXC", "ASYNC_EXC"])
def test_reference_api_example_restarts_once_after_the_injected_fault(tmp_path, fault):
    markers = tmp_path / "store-markers"
    markers.mkdir()
    port = free_port_pair()
    args = ["--steps", "40", "--fault", fault, "--store-marker", str(markers)]
    procs = [_start(tmp_path, rank, port, args) for rank in range(WORLD_SIZE)]
    try:
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=90))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    output = _output(tmp_path)
    assert codes == [0, 0], output

    # One restart: both ranks finish in iteration 1 at full size.
    for rank in range(WORLD_SIZE):
        stdout = (tmp_path / f"rank-{rank}.out").read_text()
        done = DONE.findall(stdout)
        assert done == [(str(rank), str(WORLD_SIZE), "1", "40")], output
    events, _ = read_dir(tmp_path / "logs")
    starts = {(e["rank"], e["round"]) for e in events if e["kind"] == "round_start"}
    assert starts == {(r, k) for r in range(WORLD_SIZE) for k in (0, 1)}, starts

    # The fault was the injected one, on rank 1 only, in the first round.
    injected = [
        e
        for e in events
        if e["kind"] == "fault" and "InjectedException" in (e.get("exc_type") or "")
    ]
    assert [(e["rank"], e["round"]) for e in injected] == [(1, 0)], injected
    assert f"injecting Fault.{fault}" in (tmp_path / "rank-1.err").read_text(), output

    # The nested-restarter callbacks, in the order of the restart, on rank 0 only.
    nested = NESTED.findall((tmp_path / "rank-0.out").read_text())
    assert nested == [
        ("initialize", ""),
        ("handling", "starting"),
        ("handling", "completed"),
        ("finalized", ""),
    ], output
    assert not NESTED.findall((tmp_path / "rank-1.out").read_text()), output

    # The Wrapper built its store with the custom store_factory and store_kwargs, on every rank.
    made = sorted(p.name for p in markers.iterdir())
    for rank in range(WORLD_SIZE):
        assert any(name.startswith(f"store-MarkedTCPStore-rank{rank}-") for name in made), made
