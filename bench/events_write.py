"""Cost of one event: EventWriter.emit (one write(2) per event), with and without fsync.

Usage: python bench/events_write.py [N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from nvrx.events import EventWriter


def measure(n: int, fsync: bool) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        writer = EventWriter(
            tmp, "bench", {"job": "bench", "node": 0, "rank": 0, "round": 0}, fsync=fsync
        )
        costs = []
        for i in range(n):
            t0 = time.perf_counter()
            writer.emit("progress", step=i, loss=0.5)
            costs.append(time.perf_counter() - t0)
        writer.close()
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("n", nargs="?", type=int, default=20000,
                        help="events without fsync (default 20000; with fsync: n / 50, 200 at least)")  # fmt: skip
    n = parser.parse_args().n
    for fsync, count in ((False, n), (True, max(200, n // 50))):
        costs = measure(count, fsync)
        costs.sort()
        print(
            f"emit fsync={fsync!s:5} n={count:6d}  median {statistics.median(costs) * 1e6:7.1f} us"
            f"  p99 {costs[int(len(costs) * 0.99)] * 1e6:8.1f} us"
        )


if __name__ == "__main__":
    main()
