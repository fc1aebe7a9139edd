"""What preparing a warm standby costs the training beside it.

One busy process per CPU this process may use (``taskset -c 0,1`` makes a
2-core machine) stands for the training ranks, counting loop iterations. A
standby (``nvrx.supervisor.standby.Standby``, as the supervisor starts after
each restart) is started beside them. Prints how long the standby took to be
warm (it and the Wrapper monitor it starts ahead are past their imports) and
the busy processes' speed meanwhile, as a share of their speed before.

    taskset -c 0,1 .venv/bin/python bench/standby_cost.py [--repeats 3]

Measured when the standby's priority was chosen (its imports at nice 0 or in a
thread at nice 10): the share was the same either way (autogroups: each
process the supervisor starts has a session of its own), so it runs at nice 0.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

from nvrx.supervisor.standby import Standby

WARM_WITHIN_S = 120.0  # a standby not warm by then fails the run


def _busy(marks: mp.Queue, stop: mp.Event) -> None:  # type: ignore[type-arg]
    n, seen = 0, []
    while not stop.is_set():
        for _ in range(20000):
            n += 1
        seen.append((time.monotonic(), n))
    marks.put(seen)


def _rate(marks: list[tuple[float, int]], start: float, end: float) -> float:
    inside = [(t, n) for t, n in marks if start <= t <= end]
    if len(inside) < 2:
        return float("nan")
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def one(busy: int, baseline_s: float = 2.0) -> tuple[float, float]:
    """Seconds until the standby is warm; the busy processes' speed meanwhile (share of their
    speed over the ``baseline_s`` seconds before it started)."""
    marks: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    stop = mp.Event()
    procs = [mp.Process(target=_busy, args=(marks, stop)) for _ in range(busy)]
    for proc in procs:
        proc.start()
    time.sleep(baseline_s)  # the busy processes' speed over this period is the baseline
    t0 = time.monotonic()
    standby = Standby(sys.executable, dict(os.environ))
    try:
        deadline = t0 + WARM_WITHIN_S
        while (ready := standby.poll_ready()) is None:  # its imports go on
            if time.monotonic() > deadline:
                raise SystemExit(f"the standby was not warm within {WARM_WITHIN_S:g} s")
            time.sleep(0.05)  # a benchmark polling; not product code
        if not ready:  # it ended without saying it was warm
            raise SystemExit("the standby ended before it was warm: no figure")
        t1 = time.monotonic()
    finally:
        stop.set()
        seen = [marks.get() for _ in procs]
        for proc in procs:
            proc.join()
        standby.discard()
    before = statistics.mean(_rate(m, t0 - baseline_s, t0) for m in seen)
    during = statistics.mean(_rate(m, t0, t1) for m in seen)
    return t1 - t0, during / before


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3, help="standbys started (default 3)")
    args = parser.parse_args()
    busy = len(os.sched_getaffinity(0))
    runs = []
    for _ in range(args.repeats):
        warm_s, share = one(busy)
        runs.append((warm_s, share))
        print(f"standby warm in {warm_s:5.2f} s; {busy} busy processes ran at "
              f"{share * 100:5.1f} % of their speed meanwhile", flush=True)  # fmt: skip
    warm_s = statistics.median(r[0] for r in runs)
    share = statistics.median(r[1] for r in runs)
    print(f"{busy} CPUs, {busy} busy processes; median of {args.repeats}: standby warm in "
          f"{warm_s:5.2f} s, training at {share * 100:5.1f} % meanwhile")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
