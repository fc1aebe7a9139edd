"""Latency of nvrx store barriers for many participants on one TCPStore server.

N participants are threads spread over a few processes, each with its own
store connection; the server runs in a process of its own. For every barrier
the figure is "last arrival -> last release" (the first barrier is dropped as
warm-up); a participant whose barrier fails makes the run exit non-zero. Run as root it re-executes itself in a private network namespace
(``unshare -n`` + ``ip link set lo up``) so that loopback connections do not
stall on reverse DNS; otherwise it relies on RES_OPTIONS.

    .venv/bin/python bench/store_barrier.py [--sizes 16,256,1024,4096] [--algo nvrx|torch]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

TARGET_4096_S = 0.25
BARRIER_TIMEOUT_S = 120.0  # a barrier that has not released by then fails the run


def _worker(
    host: str, port: int, first: int, threads: int, n: int, iters: int, algo: str, reentrant: bool
) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from nvrx.store import client
    from nvrx.store.barrier import barrier as nvrx_barrier

    threading.stack_size(512 * 1024)
    arrivals = [[0.0] * threads for _ in range(iters)]
    releases = [[0.0] * threads for _ in range(iters)]
    ready = threading.Barrier(threads + 1)
    go = threading.Event()
    failures: list[str] = []

    def run(idx: int) -> None:
        try:
            store = client.connect(host, port, timeout=120)
        finally:
            ready.wait()  # a participant that failed to connect is reported below
        go.wait()
        try:
            _barriers(store, idx)
        except Exception as exc:  # a barrier that failed leaves no release time to report
            failures.append(f"participant {first + idx}: {exc!r}")

    def _barriers(store: object, idx: int) -> None:
        rank = first + idx
        for it in range(iters):
            name = f"bench/{n}/{algo}/{int(reentrant)}/{it}"
            arrivals[it][idx] = time.monotonic()
            if algo == "torch":
                dist.Store.barrier(store, name, n, timedelta(seconds=BARRIER_TIMEOUT_S))
            elif algo == "addwait":  # the same protocol without per-rank arrival keys
                if int(store.add(name + "/n", 1)) == n:
                    store.set(name + "/go", "1")
                store.wait([name + "/go"], timedelta(seconds=BARRIER_TIMEOUT_S))
            else:
                nvrx_barrier(store, name, rank, n, BARRIER_TIMEOUT_S, reentrant=reentrant)
            releases[it][idx] = time.monotonic()

    pool = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    ready.wait()
    print("READY", flush=True)
    sys.stdin.readline()  # the parent starts every process's threads at once
    go.set()
    for t in pool:
        t.join()
    unreleased = sum(1 for row in releases for t in row if t == 0.0)
    if failures or unreleased:
        print(f"FAILED {unreleased} barrier passes without a release: {failures[:3]}", flush=True)
        sys.exit(1)
    out = [[max(arrivals[i]), max(releases[i])] for i in range(iters)]
    print("RESULT " + json.dumps(out), flush=True)


def _run_size(
    host: str, port: int, n: int, procs: int, iters: int, algo: str, reentrant: bool
) -> list[float]:
    per = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    children = []
    first = 0
    for count in per:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            host,
            str(port),
            str(first),
            str(count),
            str(n),
            str(iters),
            algo,
            str(int(reentrant)),
        ]
        children.append(
            subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
        first += count
    try:
        for child in children:
            line = child.stdout.readline()
            if not line.startswith("READY"):
                raise RuntimeError(f"bench worker failed to connect: {line!r}")
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        results = []
        for child in children:
            line = child.stdout.readline()
            if not line.startswith("RESULT"):
                raise RuntimeError(f"bench worker failed: {line!r}")
            results.append(json.loads(line[len("RESULT ") :]))
            child.wait()
            if child.returncode != 0:
                raise RuntimeError(f"bench worker exited {child.returncode}")
    finally:
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, 9)
                child.wait()
    lat = []
    for it in range(1, iters):
        last_arrival = max(r[it][0] for r in results)
        last_release = max(r[it][1] for r in results)
        lat.append(last_release - last_arrival)
    return lat


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="16,256,1024,4096", help="participants, comma separated")
    parser.add_argument("--algo", choices=("nvrx", "torch", "addwait"), default="nvrx",
                        help="nvrx.store.barrier (default), torch's Store.barrier, or add + wait")  # fmt: skip
    parser.add_argument(
        "--reentrant", action="store_true", help="idempotent arrivals (2 requests per rank)"
    )
    parser.add_argument(
        "--no-netns", action="store_true", help="do not enter a private network namespace"
    )
    return parser


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        h, p, first, threads, n, iters, algo, reentrant = sys.argv[2:10]
        _worker(h, int(p), int(first), int(threads), int(n), int(iters), algo, reentrant == "1")
        return 0
    args = _parser().parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if not args.no_netns and os.environ.get("NVRX_BENCH_IN_NETNS") != "1":
        if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip"):
            env = dict(os.environ, NVRX_BENCH_IN_NETNS="1")
            inner = " ".join(map(_quote, [sys.executable, __file__, *sys.argv[1:]]))
            return subprocess.call(
                ["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {inner}"], env=env
            )
        os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
        print("not root: running without a network namespace (RES_OPTIONS set)")
    from nvrx.store import client

    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys,torch.distributed as d,datetime as t;"
            "s=d.TCPStore('127.0.0.1',0,None,True,t.timedelta(seconds=120),wait_for_workers=False);"
            "print(s.port,flush=True);sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        port = int(server.stdout.readline())
        del client
        print(f"algo={args.algo} reentrant={args.reentrant} server=127.0.0.1:{port}")
        print(f"{'N':>6} {'procs':>5} {'iters':>5} {'median_ms':>10} {'p99_ms':>9}")
        for n in [int(s) for s in args.sizes.split(",")]:
            procs = 2 if n <= 64 else 4 if n <= 1024 else 8
            iters = 100 if n <= 256 else 40 if n <= 1024 else 15
            lat = _run_size("127.0.0.1", port, n, procs, iters, args.algo, args.reentrant)
            med, p99 = statistics.median(lat), _p99(lat)
            print(f"{n:>6} {procs:>5} {iters:>5} {med * 1e3:>10.2f} {p99 * 1e3:>9.2f}", flush=True)
            if n == 4096:
                print(
                    f"4096 median / target {TARGET_4096_S} s = {med / TARGET_4096_S:.2f} (<= 1 meets the target)"
                )
    finally:
        server.stdin.close()
        server.wait(timeout=10)
    return 0


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


if __name__ == "__main__":
    sys.exit(main())
