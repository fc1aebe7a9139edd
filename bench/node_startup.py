"""The start of a job of several local "nodes": when each node's children start, and when the
last rank enters its function.

Runs ``--nnodes`` supervisors (``python -m nvrx.supervisor.cli``, one per node rank, all on
this machine) of ``--nproc`` ranks each, the demo (``examples/train_demo.py``, Wrapper on) for a
few steps, without faults, ``--repeats`` times, and prints, from the events the processes
write, seconds from the first ``supervisor_start`` to: node 0's ``store_start``, each node's
first ``child_start``, and the last rank's first ``call_start``. Medians last.

On one machine every node's imports share its cores, unlike a real cluster: the figure that
carries over is each node's ``child_start`` (issue 14's target: a supervisor's children run
within 2 s of its start).

    .venv/bin/python bench/node_startup.py [--nnodes 2] [--nproc 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import private_netns  # noqa: E402
from free_ports import free_ports  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "train_demo.py"
TARGET_CHILDREN_S = 2.0


def run_once(nnodes: int, nproc: int, tmp: Path) -> dict[str, float]:
    """One job; the seconds of each milestone from the first supervisor's start."""
    from nvrx.events import read_dir

    master, store = free_ports(2)
    env = {**os.environ, "NVRX_DEMO_FAULTS": ""}
    procs = []
    for node in range(nnodes):
        with open(tmp / f"supervisor-{node}.out", "wb") as sink:
            procs.append(subprocess.Popen(
                [
                    sys.executable, "-m", "nvrx.supervisor.cli", "--nnodes", str(nnodes),
                    "--node-rank", str(node), "--nproc-per-node", str(nproc),
                    "--master-port", str(master), "--store-port", str(store), "--job-id", "j",
                    "--log-dir", str(tmp), "--", sys.executable, str(DEMO), "--steps", "5",
                ],
                stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=tmp, start_new_session=True,
            ))  # fmt: skip
    try:
        for p in procs:
            p.wait(300)
    except subprocess.TimeoutExpired:
        pass  # what still runs is killed below, and read as -9
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        for node in range(nnodes):  # the directory goes with the run: what they said, first
            tail = (tmp / f"supervisor-{node}.out").read_text(errors="replace")[-2000:]
            print(f"--- supervisor of node {node}, exit code {codes[node]}, its last output:\n{tail}",
                  file=sys.stderr)  # fmt: skip
        raise RuntimeError(f"a supervisor failed: exit codes {codes} (their output is above)")
    events, _ = read_dir(tmp / "j")
    t0 = min(e["wall"] for e in events if e["kind"] == "supervisor_start")
    out: dict[str, float] = {}
    for e in events:
        if e["kind"] == "store_start":
            out.setdefault("store answers", e["wall"] - t0)
        elif e["kind"] == "child_start":
            out.setdefault(f"node {e['node']} children start", e["wall"] - t0)
    calls = [e["wall"] - t0 for e in events if e["kind"] == "call_start" and e["round"] == 0]
    out["last rank in its function"] = max(calls)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nnodes", type=int, default=2, help="local supervisors")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per supervisor")
    parser.add_argument("--repeats", type=int, default=3, help="runs")
    parser.add_argument("--no-netns", action="store_true", help="stay in this network namespace")
    args = parser.parse_args()
    code = private_netns.rerun_inside(__file__, args.no_netns)
    if code is not None:
        return code
    runs = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="nvrx-node-startup-") as tmp:
            runs.append(run_once(args.nnodes, args.nproc, Path(tmp)))
        print(f"run {i + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in runs[-1].items()), flush=True)
    print(f"medians of {len(runs)} ({args.nnodes} nodes x {args.nproc} ranks, {os.cpu_count()} CPUs):")
    for key in runs[0]:
        value = statistics.median(r[key] for r in runs)
        line = f"  {key:<28} {value:6.2f} s"
        if key.endswith("children start"):
            line += f"  target {TARGET_CHILDREN_S:.1f} s, ratio {value / TARGET_CHILDREN_S:.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
