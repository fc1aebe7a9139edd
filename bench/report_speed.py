"""Time ``nvrx-report`` on a synthetic 4096-rank x 50-round job; print wall time and peak memory.

Targets: under 10 s and under 1 GiB. The report runs as its own process (as a
user runs it); memory is the peak of the sum of RSS over that process and
its worker processes, sampled every 20 ms, and the largest single process's
peak from ``getrusage``.

    python bench/report_speed.py [--ranks 4096] [--rounds 50] [--keep DIR] [--workers N]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_synthetic_logs import generate  # noqa: E402

TARGET_S = 10.0
TARGET_BYTES = 1 << 30


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


def run_report(log_dir: Path, workers: int | None) -> tuple[float, int, int, int]:
    """Run the CLI on ``log_dir``; return (seconds, peak tree RSS, peak single RSS, exit code)."""
    cmd = [
        sys.executable,
        "-m",
        "nvrx.report.cli",
        str(log_dir),
        "--no-sacct",
        "--format",
        "json",
        "-o",
        os.devnull,
    ]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    peak = 0
    done = threading.Event()
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True)
    ps = psutil.Process(proc.pid)

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.02):
            try:
                peak = max(peak, _tree_rss(ps))
            except psutil.Error:
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        done.set()
        sampler.join()
    elapsed = time.perf_counter() - t
    single = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return elapsed, peak, single, rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--keep", type=Path, default=None, help="generate into DIR and keep it")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nvrx-report-bench-") as tmp:
        out = args.keep or Path(tmp) / "job"
        t = time.perf_counter()
        truth = generate(out, ranks=args.ranks, rounds=args.rounds)
        size = sum(f.stat().st_size for f in out.iterdir())
        print(
            f"generated {truth.events} events in {truth.files} files ({size / 2**20:.0f} MiB) "
            f"in {time.perf_counter() - t:.1f} s"
        )
        elapsed, peak, single, rc = run_report(out, args.workers)
    if rc != 0:
        print(f"nvrx-report exited with {rc}")
        return 1
    print(
        f"report wall time: {elapsed:.2f} s (target {TARGET_S:.0f} s, ratio {elapsed / TARGET_S:.2f})"
    )
    print(
        f"report peak RSS (all processes): {peak / 2**20:.0f} MiB "
        f"(target {TARGET_BYTES / 2**20:.0f} MiB, ratio {peak / TARGET_BYTES:.2f}); "
        f"largest single process {single / 2**20:.0f} MiB"
    )
    print(f"events per second: {truth.events / elapsed:,.0f} on {os.cpu_count()} CPU(s)")
    return 0 if elapsed < TARGET_S and peak < TARGET_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())
