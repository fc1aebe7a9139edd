"""The benches' figures count what they say they count (``bench/``)."""

from __future__ import annotations

import io
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.bench_module import load_bench


def _bench(name: str) -> ModuleType:
    return load_bench(name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", [2, 4])
def test_straggler_store_traffic_counts_every_store_request_of_the_sealed_path(hosts: int) -> None:
    """Each node sets its step times and checks the exclusion list (absent here); the store's
    host checks and gets every node's step times: four store requests per node per interval.
    The first interval, where the store's host reads the others before they published, is
    not counted, as it is not in the scoring times."""
    requests, size, _ = _bench("straggler_cost").store_traffic(8, hosts, intervals=10)
    assert requests == pytest.approx(4 * hosts)
    assert size > 0


@pytest.mark.timeout(60)
def test_store_barrier_worker_fails_when_a_barrier_never_releases(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A participant whose barrier timed out has no release time: the worker exits non-zero
    instead of handing the parent a latency computed from a zero."""
    from datetime import timedelta

    import torch.distributed as dist

    bench = _bench("store_barrier")
    monkeypatch.setattr(bench, "BARRIER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    stack_size = threading.stack_size()  # the worker sets its own: put back for later tests
    try:  # one participant of two: the barrier never completes
        with pytest.raises(SystemExit) as ended:
            bench._worker("127.0.0.1", server.port, 0, 1, 2, 2, "nvrx", False)
    finally:
        threading.stack_size(stack_size)
    assert ended.value.code == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "RESULT" not in out


def test_restart_latency_names_a_survivor_that_never_came_back(tmp_path: Path) -> None:
    """No latency is made up from the ranks that did come back: the one that did not is named."""
    bench = _bench("restart_latency")
    (tmp_path / "fault.json").write_text('{"t": 10.0}')
    (tmp_path / "enter-0.jsonl").write_text('{"iteration": 0, "t": 1.0}\n{"iteration": 1, "t": 10.05}\n')
    (tmp_path / "enter-2.jsonl").write_text('{"iteration": 0, "t": 1.0}\n')
    assert bench._latency(tmp_path, 3, [0]) == pytest.approx(0.05)
    with pytest.raises(RuntimeError, match="rank 2 never entered the function again"):
        bench._latency(tmp_path, 3, [0, 2])


@pytest.mark.timeout(120)
def test_store_load_starts_its_store_with_the_snapshot_keeper(tmp_path: Path) -> None:
    """The bench's store is the one node 0's supervisor starts, snapshot keeper included."""
    from nvrx.store import client

    bench = _bench("store_load")
    service = bench._start_store(4, True, str(tmp_path))
    try:
        assert service.snapshot is not None
        store = client.connect(service.host, service.port, timeout=30)
        store.set("nvrx/bench/probe", "x")
        assert store.get("nvrx/bench/probe") == b"x"
    finally:
        service.stop()


@pytest.mark.timeout(60)
def test_standby_cost_fails_when_the_standby_ends_before_it_is_warm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A standby that cannot start (its Python finds no standard library) ends without
    saying it is warm: the bench stops with a message instead of polling it for ever."""
    bench = _bench("standby_cost")
    monkeypatch.setenv("PYTHONHOME", "/nonexistent")
    with pytest.raises(SystemExit, match="ended before it was warm"):
        bench.one(0, baseline_s=0.0)  # no busy process: no baseline to measure



def test_heartbeat_cost_p99_is_the_slowest_of_two_batches() -> None:
    """With two batches the 99th percentile is the slower one, never the faster."""
    bench = _bench("heartbeat_cost")
    calls = [0]

    def call() -> None:  # the second batch spins 20 µs a call, the first returns at once
        calls[0] += 1
        if calls[0] > bench.BATCH:
            end = bench.time.perf_counter() + 20e-6
            while bench.time.perf_counter() < end:
                pass

    median, p99 = bench._per_call_us(call, 2 * bench.BATCH)
    assert p99 >= 20 and p99 > median  # the median of two is their mean, whatever the load


def test_heartbeat_cost_counts_the_packets_the_children_sent_in_the_window() -> None:
    """The CPU per packet divides by the packets sent while the supervisor was measured, not
    by the most the packet interval allows."""
    bench = _bench("heartbeat_cost")
    sent = [[0.5, 1.0, 1.2, 2.0], [0.9, 1.5, 3.0]]  # the window [1, 2) holds three of them
    assert bench.packets_between(sent, 1.0, 2.0) == 3
    assert bench.us_per_packet(0.003, 3) == pytest.approx(1000.0)
    with pytest.raises(SystemExit, match="sent no packet"):
        bench.us_per_packet(0.003, 0)


@pytest.mark.parametrize(
    ("codes", "stragglers", "expected"),
    [([0, 0], [], 0), ([0, 0], [{"kind": "straggler"}], 1), ([0, -9], [], 2),
     ([-9, -9], [{"kind": "straggler"}], 2), ([], [], 2)],
)  # fmt: skip
def test_straggler_healthy_gives_no_verdict_for_a_job_that_failed_or_hung(
    codes: list[int], stragglers: list[dict], expected: int
) -> None:
    """A supervisor killed at the deadline (-9) or failed means no verdict (2), never "named
    someone" (1), whatever straggler events the job wrote before."""
    bench = _bench("straggler_healthy")
    assert bench.verdict({"exit_codes": codes, "straggler_events": stragglers}) == expected


@pytest.mark.timeout(60)
def test_straggler_healthy_kills_a_job_that_hangs_past_its_deadline() -> None:
    """A supervisor still running at the deadline is killed with its group and read as -9,
    instead of the wait raising out of the bench."""
    import os
    import subprocess
    import time

    bench = _bench("straggler_healthy")
    procs = [subprocess.Popen(["true"], start_new_session=True),
             subprocess.Popen(["sleep", "60"], start_new_session=True)]  # fmt: skip
    # the job that ends has ended before the deadline starts (left for wait_all to reap)
    os.waitid(os.P_PID, procs[0].pid, os.WEXITED | os.WNOWAIT)
    assert bench.wait_all(procs, time.monotonic() + 0.5) == [0, -9]


def test_store_load_fails_a_run_with_an_incomplete_barrier(capsys: pytest.CaptureFixture[str]) -> None:
    """The barrier figures leave out the barriers that did not complete: a run that had one
    exits 1 and says how many, instead of passing on the figures of the others."""
    bench = _bench("store_load")
    done = bench.Outcome("per-node", 64, 8, barrier_ms=[1.0, 2.0])
    assert bench.exit_code([done]) == 0
    assert bench.exit_code([done, bench.Outcome("per-node", 64, 8, barriers_failed=2)]) == 1
    assert "2 barriers did not complete" in capsys.readouterr().out
