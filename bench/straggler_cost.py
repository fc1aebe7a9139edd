"""What straggler scoring costs: ``StepScores.record`` per rank-step, and one evaluation.

``record`` is what a rank's timing path adds to each step; ``scores()`` plus ``evaluate``
is what the job's scorer spends per evaluation, for ``--ranks`` ranks (one evaluation per
step at most). Times are medians of ``--repeats`` batches.

    .venv/bin/python bench/straggler_cost.py [--ranks 4 16 64] [--repeats 5]
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

_BATCH = 100_000


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64], help="job sizes (default 4 16 64)")
    parser.add_argument("--repeats", type=int, default=5, help="batches timed (default 5)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if min(args.ranks) < 2:
        parser.error(f"--ranks must each be >= 2, got {args.ranks}")
    random.seed(0)
    print(f"record: {record_ns(args.repeats):.0f} ns per rank-step")
    for ranks in args.ranks:
        print(f"evaluate {ranks:3d} ranks: {evaluate_us(ranks, args.repeats):.0f} µs per evaluation")


if __name__ == "__main__":
    main()
