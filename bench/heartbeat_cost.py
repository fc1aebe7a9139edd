"""What launcher-side monitoring costs: a heartbeat and a section in the training loop, and the
supervisor's CPU time while 8 ranks send 100 heartbeats a second each.

1. In one process, a ``RankMonitorClient`` connected to a real ``RankWatch`` (drained by a
   thread, as the supervisor's loop would): the time of ``send_heartbeat()`` and of a
   ``start_section`` + ``end_section`` pair, median and p99 over batches.
2. ``nvrx-supervise --nproc-per-node 8`` with children that call ``send_heartbeat()`` 100
   times a second for ``--seconds`` (the client sends them as one packet per 0.1 s at most):
   the supervisor's CPU seconds per wall second over ``--seconds``/2, counted from when the
   last child began monitoring, and its CPU time per packet the children sent in that window
   (each child records when its packets left). A supervisor that exits non-zero (a child
   failed) fails the run.

Targets: a heartbeat costs a few microseconds; the supervisor stays below 5 % of one core.

    python bench/heartbeat_cost.py [--calls 200000] [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from nvrx import jobenv
from nvrx.fault_tolerance import FaultToleranceConfig, RankMonitorClient
from nvrx.fault_tolerance.client import HEARTBEAT_PACKET_INTERVAL_S
from nvrx.supervisor.rank_watch import RankWatch

BATCH = 1000
HEARTBEAT_TIMEOUT_S = 30
CHILD = """
import json, os, time
from nvrx.fault_tolerance import RankMonitorClient
c = RankMonitorClient()
c.init_workload_monitoring()
sent = []
end = time.monotonic() + {seconds}
nxt = time.monotonic()
while nxt < end:
    due, dropped = c._next_packet, c.dropped_heartbeats
    c.send_heartbeat()
    if c._next_packet != due and c.dropped_heartbeats == dropped:  # this call sent a packet
        sent.append(time.monotonic())
    nxt += 0.01
    time.sleep(max(0.0, nxt - time.monotonic()))
c.shutdown_workload_monitoring()
with open(os.path.join({out!r}, f"packets-{{os.getpid()}}.json"), "w") as f:
    json.dump(sent, f)
"""


def _drain(watch: RankWatch, stop: threading.Event) -> None:
    while not stop.is_set():
        fds = [watch.fileno(), *watch.connection_fds()]
        for fd in select.select(fds, [], [], 0.1)[0]:
            if fd == watch.fileno():
                watch.accept()
            else:
                watch.read(fd)


def _per_call_us(fn, calls: int) -> tuple[float, float]:
    samples = []
    for _ in range(calls // BATCH):
        t0 = time.perf_counter_ns()
        for _ in range(BATCH):
            fn()
        samples.append((time.perf_counter_ns() - t0) / BATCH / 1000)
    samples.sort()
    return statistics.median(samples), samples[math.ceil(len(samples) * 0.99) - 1]


def client_cost(calls: int) -> None:
    watch = RankWatch()
    os.environ[jobenv.FT_SOCKET] = watch.path
    os.environ[jobenv.FT_CONFIG] = FaultToleranceConfig(rank_heartbeat_timeout=60).to_json()
    stop = threading.Event()
    drainer = threading.Thread(target=_drain, args=(watch, stop), daemon=True)
    drainer.start()
    client = RankMonitorClient()
    client.init_workload_monitoring()

    def section() -> None:
        client.start_section("step")
        client.end_section("step")

    hb_med, hb_p99 = _per_call_us(client.send_heartbeat, calls)
    sec_med, sec_p99 = _per_call_us(section, calls // 2)
    client.shutdown_workload_monitoring()
    stop.set()
    drainer.join()
    watch.close()
    print(f"send_heartbeat():              median {hb_med:6.2f} us   p99 {hb_p99:6.2f} us  "
          f"(calls sent as packets every {HEARTBEAT_PACKET_INTERVAL_S:g} s at most; packets dropped "
          f"while the supervisor lagged: {client.dropped_heartbeats})")  # fmt: skip
    print(f"start_section + end_section:   median {sec_med:6.2f} us   p99 {sec_p99:6.2f} us")


def _monitored(job_dir: Path) -> int:
    """Children whose monitoring began: the supervisor logged their timeouts."""
    return sum(f.read_text().count('"timeouts_set"') for f in job_dir.glob("supervisor-*.jsonl"))


def _measure(
    proc: subprocess.Popen, job_dir: Path, seconds: float, nproc: int
) -> tuple[float, float, float, float]:
    """(wall, CPU) of the supervisor when the last of ``nproc`` children has begun monitoring,
    and again ``seconds``/2 later (inside the children's run of ``seconds``)."""
    sup = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    while _monitored(job_dir) < nproc:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("the children never started monitoring")
        time.sleep(0.1)
    t0, c0 = time.monotonic(), sum(sup.cpu_times()[:2])
    time.sleep(seconds / 2)
    t1, c1 = time.monotonic(), sum(sup.cpu_times()[:2])
    return t0, c0, t1, c1


def supervisor_cpu(seconds: float, nproc: int = 8) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        child = Path(tmp, "child.py")
        child.write_text(CHILD.format(seconds=seconds, out=tmp))
        proc = subprocess.Popen(
            [sys.executable, "-m", "nvrx.supervisor", "--nproc-per-node", str(nproc),
             "--log-dir", tmp, "--job-id", "hb-bench", "--ft-rank-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
             "--", sys.executable, str(child)],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            t0, c0, t1, c1 = _measure(proc, Path(tmp, "hb-bench"), seconds, nproc)
            proc.wait(seconds + 60)
        finally:
            _end(proc)
        if proc.returncode != 0:  # a child that failed sent fewer heartbeats than counted
            raise SystemExit(f"the supervisor exited {proc.returncode}: no figure")
        sent = [json.loads(f.read_text()) for f in Path(tmp).glob("packets-*.json")]
    rate, packets = nproc * 100, packets_between(sent, t0, t1)
    print(f"supervisor with {nproc} ranks x 100 heartbeats/s ({rate} calls/s, which the ranks "
          f"sent as {packets / (t1 - t0):.0f} packets/s): {(c1 - c0) / (t1 - t0) * 100:.2f} % of one "
          f"core ({us_per_packet(c1 - c0, packets):.1f} us CPU per packet, its whole loop counted)")  # fmt: skip


def packets_between(sent: list[list[float]], t0: float, t1: float) -> int:
    """Packets the children sent in [t0, t1): ``sent`` holds each child's send times."""
    return sum(1 for times in sent for t in times if t0 <= t < t1)


def us_per_packet(cpu_s: float, packets: int) -> float:
    """The supervisor's CPU microseconds per packet it was sent (its whole loop counted)."""
    if packets <= 0:
        raise SystemExit("the children sent no packet while the supervisor was measured: no figure")
    return cpu_s / packets * 1e6


def _end(proc: subprocess.Popen) -> None:
    """Ends the supervisor if it still runs: SIGTERM (it ends its children), then its whole
    process group killed if it has not exited within 30 s; reaped either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=200_000, help="heartbeats timed (default 200000)")
    parser.add_argument("--seconds", type=float, default=10.0, help="the children's run (default 10)")
    args = parser.parse_args()
    client_cost(args.calls)
    supervisor_cpu(args.seconds)


if __name__ == "__main__":
    main()
