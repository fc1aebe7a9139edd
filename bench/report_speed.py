"""Time ``nvrx-report`` on a synthetic 4096-rank x 50-round job; print wall time and peak memory.

Targets: under 10 s and under 1 GiB (the exit status); issue 14 asks for under
2 s, printed beside the figure with its ratio. The report runs as its own
process (as a user runs it); memory is the peak of the sum of RSS over that
process and its worker processes, sampled every 50 ms (a sample costs about 1 ms of
CPU that the report's workers would miss on a small machine), and the largest single
process's peak from ``getrusage``. The CPU time of all of them is printed too:
on a machine shared with other work it varies far less than the wall time.
``--log-dir`` times a job directory already there (one kept with ``--keep``).

    python bench/report_speed.py [--ranks 4096] [--rounds 50] [--keep DIR] [--workers N]
    python bench/report_speed.py --log-dir DIR [--workers N]
"""

from __future__ import annotations

import argparse
import importlib
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
ISSUE_TARGET_S = 2.0  # issue 14's aim
SAMPLE_S = 0.05  # between two samples of the memory of the report's processes


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


def parsers() -> str:
    """Which of the report's optional parsers (``nvrx[fast]``) this Python can import."""
    found = []
    uses = (
        ("msgspec", "rank files as typed records, other files as dicts"),
        ("orjson", "every file as dicts where msgspec is missing"),
    )
    for name, use in uses:
        try:
            module = importlib.import_module(name)
        except ImportError:
            found.append(f"no {name}")
            continue
        found.append(f"{name} {getattr(module, '__version__', '?')} ({use})")
    return ", ".join(found) + "; damaged files: the standard library's json"


def run_report(log_dir: Path, workers: int | None) -> tuple[float, int, int, int, float]:
    """Run the CLI on ``log_dir``; return (seconds, peak tree RSS, peak single RSS, exit code,
    CPU seconds of the report and its worker processes)."""
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
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True)
    ps = psutil.Process(proc.pid)

    def sample() -> None:
        nonlocal peak
        while not done.wait(SAMPLE_S):
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
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, peak, after.ru_maxrss * 1024, rc, cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=4096, help="ranks of the synthetic job")
    p.add_argument("--rounds", type=int, default=50, help="rounds of the synthetic job")
    p.add_argument("--workers", type=int, default=None, help="nvrx-report --workers")
    p.add_argument("--keep", type=Path, default=None, help="generate into DIR and keep it")
    p.add_argument(
        "--log-dir", type=Path, default=None, help="time this job directory, generating nothing"
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nvrx-report-bench-") as tmp:
        out = args.log_dir or args.keep or Path(tmp) / "job"
        t = time.perf_counter()
        if args.log_dir is None:
            events = generate(out, ranks=args.ranks, rounds=args.rounds).events
            what = "generated"
        else:
            events = sum(f.read_bytes().count(b"\n") for f in out.glob("*.jsonl"))
            what = "found"
        files = list(out.glob("*.jsonl"))
        size = sum(f.stat().st_size for f in files)
        print(
            f"{what} {events} events in {len(files)} files ({size / 2**20:.0f} MiB) "
            f"in {time.perf_counter() - t:.1f} s"
        )
        print(f"parsers: {parsers()}")
        elapsed, peak, single, rc, cpu = run_report(out, args.workers)
    if rc != 0:
        print(f"nvrx-report exited with {rc}")
        return 1
    print(
        f"report wall time: {elapsed:.2f} s (target {TARGET_S:.0f} s, ratio {elapsed / TARGET_S:.2f}; "
        f"issue 14: {ISSUE_TARGET_S:.0f} s, ratio {elapsed / ISSUE_TARGET_S:.2f})"
    )
    print(f"report CPU time (all processes): {cpu:.2f} s")
    print(
        f"report peak RSS (all processes): {peak / 2**20:.0f} MiB "
        f"(target {TARGET_BYTES / 2**20:.0f} MiB, ratio {peak / TARGET_BYTES:.2f}); "
        f"largest single process {single / 2**20:.0f} MiB"
    )
    print(f"events per second: {events / elapsed:,.0f} on {os.cpu_count()} CPU(s)")
    return 0 if elapsed < TARGET_S and peak < TARGET_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())
