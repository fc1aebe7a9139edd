"""What straggler scoring costs: the rank's timing path per step, and the store's traffic.

* ``RankMonitorClient.record_step`` per step, with a real supervisor socket (``RankWatch``)
  at the other end: what a rank's timing path adds to each step (the times are sent
  together, at most every 0.25 s).
* ``StepScores.record`` per rank-step, and one evaluation (``scores()`` plus ``evaluate``)
  over ``--ranks`` ranks: what a supervisor spends.
* The store traffic of the live path: ``--hosts`` supervisors' ``StepTimes`` (the real
  class, each with a full window for its share of ``--ranks`` ranks) publish and, on the
  first, score against a real torch ``TCPStore`` on loopback, sealed with a job secret as
  under a supervisor; the store requests and bytes one interval (``step_times.PUBLISH_S``)
  costs, as the node agent sends them (a read is a ``check`` and a ``get``). Requests grow
  with hosts, not ranks; bytes with ranks (one median per rank). A run in which no step
  times reached the store exits non-zero instead of printing a count.

Times are medians of ``--repeats`` batches.

    .venv/bin/python bench/straggler_cost.py [--ranks 4 16 64] [--hosts 2 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nvrx.straggler import StepScores  # noqa: E402
from nvrx.supervisor.step_times import PUBLISH_S  # noqa: E402

_BATCH, _CHUNK = 100_000, 1000


def record_ns(repeats: int) -> float:
    """Median nanoseconds of one ``record`` call."""
    scores = StepScores()
    times = [random.random() for _ in range(_BATCH)]
    batches = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for t in times:
            scores.record(0, t)
        batches.append((time.perf_counter_ns() - start) / _BATCH)
    return statistics.median(batches)


def evaluate_us(ranks: int, repeats: int) -> float:
    """Median microseconds of ``evaluate(scores())`` over ``ranks`` ranks with full windows."""
    scores = StepScores()
    for _ in range(scores.rule.window):
        for rank in range(ranks):
            scores.record(rank, random.lognormvariate(0, 0.1))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(100):
            scores.evaluate(scores.scores())
        runs.append((time.perf_counter_ns() - start) / 100 / 1000)
    return statistics.median(runs)


def record_step_ns(repeats: int) -> tuple[float, float, int]:
    """Median nanoseconds of one ``record_step`` call and of one ``timed_step()`` block (an
    empty one), their batched sends included; and the step times the socket dropped. The
    watch is read between chunks of calls, as the supervisor's loop reads it meanwhile."""
    import os

    from nvrx import jobenv
    from nvrx.fault_tolerance import RankMonitorClient
    from nvrx.supervisor.rank_watch import RankWatch

    watch = RankWatch()
    os.environ[jobenv.FT_SOCKET] = watch.path
    client = RankMonitorClient()
    client.init_workload_monitoring()
    fd = watch.accept()

    def timed(loop) -> float:
        spent = 0
        for _ in range(_BATCH // _CHUNK):
            start = time.perf_counter_ns()
            loop()
            spent += time.perf_counter_ns() - start
            watch.read(fd)
        return spent / _BATCH

    def records() -> None:
        for _ in range(_CHUNK):
            client.record_step(0.1)

    def blocks() -> None:  # as a training loop writes it
        for _ in range(_CHUNK):
            with client.timed_step():
                pass

    try:
        record = statistics.median(timed(records) for _ in range(repeats))
        timed_block = statistics.median(timed(blocks) for _ in range(repeats))
        dropped = client.dropped_steps
    finally:
        client.shutdown_workload_monitoring()
        watch.close()
    return record, timed_block, dropped


class _CountingLink:
    """What ``StepTimes`` uses of a store link, over a real ``TCPStore`` client, making the
    store requests the node agent makes for it (a ``get`` is a ``check``, then a ``get`` when
    the key is there: ``nvrx.node_agent.supervised``); each store request is counted, with
    the bytes of its key and value."""

    lost = None

    def __init__(self, store) -> None:
        self.store, self.requests, self.bytes = store, 0, 0

    def set(self, key: str, value: str) -> None:
        self.requests, self.bytes = self.requests + 1, self.bytes + len(key) + len(value)
        self.store.set(key, value)

    def get(self, key: str) -> str | None:
        self.requests, self.bytes = self.requests + 1, self.bytes + len(key)
        if not self.store.check([key]):
            return None
        value = self.store.get(key).decode()
        self.requests, self.bytes = self.requests + 1, self.bytes + len(key) + len(value)
        return value

    def add(self, key: str, amount: int) -> int:
        self.requests, self.bytes = self.requests + 1, self.bytes + len(key)
        return self.store.add(key, amount)


class _Node:
    """The supervisor as ``StepTimes`` sees it."""

    def __init__(self, node_rank: int) -> None:
        self.node_rank, self.events = node_rank, []

    def emit(self, kind: str, **fields) -> None:
        self.events.append(kind)

    def request_stop(self, reason: str, exit_code: int, broadcast: bool) -> None:
        raise AssertionError(f"no node should leave here: {reason}")


def store_traffic(ranks: int, hosts: int, intervals: int = 20) -> tuple[float, float, float]:
    """(requests, bytes, scoring µs) per publication interval, the whole job together, over
    ``intervals`` - 1 of them: the first (the store's host reads before the others published)
    is left out of all three."""
    if intervals < 2:
        raise ValueError(f"intervals must be >= 2 (the first is not counted), got {intervals}")
    from datetime import timedelta

    import torch.distributed as dist

    from nvrx.jobenv import JobEnv
    from nvrx.store.seal import new_secret
    from nvrx.supervisor import node_keys
    from nvrx.supervisor.config import SupervisorConfig
    from nvrx.supervisor.course import Course, CourseTracker
    from nvrx.supervisor.job_store import JobStore
    from nvrx.supervisor.step_times import StepTimes
    from nvrx.supervisor.stop_flag import StopFlag

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from free_ports import free_ports

    port = free_ports(1)[0]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))  # fmt: skip
    per_host, parts = ranks // hosts, []
    secret = bytes.fromhex(new_secret())  # as under a supervisor: the step times are sealed
    for host in range(hosts):
        job = JobEnv.local(nnodes=hosts, node_rank=host, nproc_per_node=per_host, job_id="bench")
        store = JobStore(SupervisorConfig(command=["train"], job=job))
        store.link = _CountingLink(dist.TCPStore("127.0.0.1", port, is_master=False,
                                                 timeout=timedelta(seconds=30)))  # fmt: skip
        store.service = server if host == 0 else None  # the first hosts the store: it scores
        store.stop = StopFlag(secret, 0)
        course = CourseTracker()
        course.to(Course.TRAINING)
        times = StepTimes(store, course, _Node(host))
        parts.append(times)
    scoring = []
    for interval in range(intervals):
        for host, times in enumerate(parts):
            for r in range(host * per_host, (host + 1) * per_host):
                times.record(r, [random.lognormvariate(0, 0.05) for _ in range(times.local.rule.window)])
            times._next = 0.0  # due now: one interval passed
            start = time.perf_counter_ns()
            times.check()
            if host == 0 and interval:
                scoring.append((time.perf_counter_ns() - start) / 1000)
        if interval == 0:  # counted from the second interval on, as the scoring times are
            for times in parts:
                times.store.link.requests = times.store.link.bytes = 0
    links = [t.store.link for t in parts]
    published = parts[0].store.link.store.check([node_keys.step_times(h) for h in range(hosts)])
    if not published or not any(link.requests for link in links):
        raise SystemExit(f"{hosts} hosts, {ranks} ranks: no step times reached the store "
                         "(the straggler path logged why): no traffic to count")  # fmt: skip
    total_requests = sum(link.requests for link in links) / (intervals - 1)
    total_bytes = sum(link.bytes for link in links) / (intervals - 1)
    return total_requests, total_bytes, statistics.median(scoring)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64], help="job sizes (default 4 16 64)")
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4], help="hosts (default 2 4)")
    parser.add_argument("--repeats", type=int, default=5, help="batches timed (default 5)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if min(args.ranks) < 2:
        parser.error(f"--ranks must each be >= 2, got {args.ranks}")
    if min(args.hosts) < 1 or any(r % h for r in args.ranks for h in args.hosts):
        parser.error(f"--hosts must each be >= 1 and divide every --ranks, got {args.hosts}")
    random.seed(0)
    record, block, dropped = record_step_ns(args.repeats)
    print(f"rank's timing path: record_step {record:.0f} ns per step, an empty timed_step() "
          f"block {block:.0f} ns; step times dropped on a full socket: {dropped}")
    print(f"supervisor: StepScores.record {record_ns(args.repeats):.0f} ns per rank-step")
    for ranks in args.ranks:
        print(f"evaluate {ranks:3d} ranks: {evaluate_us(ranks, args.repeats):.0f} µs per evaluation")
    print(f"store traffic per {PUBLISH_S:g} s interval, the whole job (real TCPStore on loopback):")
    for hosts in args.hosts:
        for ranks in args.ranks:
            requests, size, scoring = store_traffic(ranks, hosts)
            print(f"  {hosts} hosts, {ranks:3d} ranks: {requests:4.0f} requests, {size:6.0f} bytes; "
                  f"publishing and scoring on the store's host {scoring:.0f} µs")


if __name__ == "__main__":
    main()
