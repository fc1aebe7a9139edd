"""Node-loss recovery: from the moment a node is killed to every rank training again.

Runs the demo job (``examples/train_demo.py``, inside the Wrapper) under 3 local
supervisors x 2 ranks, kills one "node" (its supervisor's whole process tree,
frozen then SIGKILLed) once training runs, and measures from the kill to the
moment every rank of the final world made a training step again (its first
``progress`` event after the kill). Scenarios:

* ``spare, node 1``: ``--spare-nodes 1``; the spare takes node rank 1, its
  children rejoin the running job;
* ``spare, node 0``: the same with the store host: store failover, then a new
  generation of every rank;
* ``shrink, node 0``: the store host with no spare, ``--min-nodes 2``: store failover,
  and the new generation goes on with the 4 ranks of the 2 nodes left;
* ``requeue, node 1``: 2 supervisors, no spare: the job stops (exit 8) and is
  started again from its checkpoint, as a requeue would (SLURM's own delays,
  node-down detection and rescheduling, not included: they only add to it).

The target is ``--node-timeout`` + 3 s.

    .venv/bin/python bench/node_loss.py [--node-timeout 3] [--repeats 1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from nvrx.events import read_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from free_ports import free_ports  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "train_demo.py"
STEPS = 400
KILL_AFTER_STEP = 20


def _start_job(work: Path, job_id: str, nnodes: int, node_timeout: float, *options: str) -> list[subprocess.Popen]:
    master, store = free_ports(2)
    command = [
        sys.executable, str(DEMO), "--steps", str(STEPS), "--checkpoint-every", "2",
        "--step-time", "0.05", "--run-dir", str(work / "run"), "--rejoin-timeout", "30",
    ]  # fmt: skip
    procs = []
    for node in range(nnodes):
        argv = [
            sys.executable, "-m", "nvrx.supervisor.cli", "--nnodes", str(nnodes), "--node-rank", str(node),
            "--nproc-per-node", "2", "--master-port", str(master), "--store-port", str(store),
            "--job-id", job_id, "--log-dir", str(work / "logs"), "--node-timeout", str(node_timeout),
            "--node-heartbeat", str(min(0.5, node_timeout / 4)), "--store-timeout", "20", *options,
            "--", *command,
        ]  # fmt: skip
        out = (work / f"{job_id}-{node}.out").open("w")
        procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _events(work: Path, job_id: str) -> list[dict]:
    found, _ = read_dir(work / "logs" / job_id)
    return found


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)  # a benchmark driver reading event files; not product code
    raise TimeoutError(f"timed out waiting for {what}")


def _kill_tree(pid: int) -> float:
    root = psutil.Process(pid)
    tree = [root, *root.children(recursive=True)]
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGSTOP)
    killed_at = time.time()
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    return killed_at


def _training_again(events: list[dict], since: float, world: int) -> float | None:
    """Seconds from ``since`` until every rank of ``world`` made a step after it."""
    first: dict[int, float] = {}
    for e in events:
        if e["kind"] == "progress" and e["wall"] > since and e.get("rank") is not None:
            first[e["rank"]] = min(first.get(e["rank"], e["wall"]), e["wall"])
    if not all(r in first for r in range(world)):
        return None
    return max(first[r] for r in range(world)) - since


def _stop(procs: list[subprocess.Popen]) -> None:
    """End every process of the job, the ones in groups of their own (standbys, monitor
    processes) too, before its directory is removed."""
    tree: list[psutil.Process] = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += psutil.Process(proc.pid).children(recursive=True)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for child in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(tree, timeout=30)


def _trained(job_id: str, work: Path) -> bool:
    return any(
        e["kind"] == "progress" and e.get("step", 0) >= KILL_AFTER_STEP for e in _events(work, job_id)
    )


#: scenario -> (supervisors, their options, slot killed); every one trains 4 ranks again.
SCENARIOS: dict[str, tuple[int, tuple[str, ...], int]] = {
    "spare, node 1": (3, ("--spare-nodes", "1"), 1),
    "spare, node 0": (3, ("--spare-nodes", "1"), 0),
    "shrink, node 0": (3, ("--min-nodes", "2"), 0),
    "requeue, node 1": (2, (), 1),
}


def one_run(scenario: str, node_timeout: float) -> float:
    with tempfile.TemporaryDirectory(prefix="nvrx-bench-node-") as tmp:
        work = Path(tmp)
        requeue = scenario.startswith("requeue")
        nnodes, options, victim = SCENARIOS[scenario]
        job_id = f"bench-{scenario.split(',')[0]}"
        procs = _start_job(work, job_id, nnodes, node_timeout, *options)
        try:
            _wait_for(lambda: _trained(job_id, work), 120, "training")
            killed_at = _kill_tree(procs[victim].pid)
            if requeue:  # the job stops; a requeue starts it again from its checkpoint
                _wait_for(lambda: procs[0].poll() is not None, 60, "the job to stop")
                job_id += "-r1"
                procs += _start_job(work, job_id, nnodes, node_timeout)
            return _wait_for(
                lambda: _training_again(_events(work, job_id), killed_at, 4), 120, "every rank training"
            )
        finally:
            _stop(procs)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--node-timeout", type=float, default=3.0, help="supervisors' --node-timeout (default 3)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per scenario (default 1)")
    parser.add_argument(
        "--only", action="append", choices=list(SCENARIOS), help="run this scenario (repeatable)"
    )
    args = parser.parse_args()
    target = args.node_timeout + 3.0
    print(f"node loss -> every rank training again (target: --node-timeout {args.node_timeout:g} s + 3 s = {target:g} s)")
    results = {}
    for scenario in args.only or list(SCENARIOS):
        times = [one_run(scenario, args.node_timeout) for _ in range(args.repeats)]
        results[scenario] = statistics.median(times)
        runs = ", ".join(f"{t:.2f}" for t in times)
        ratio = results[scenario] / target
        verdict = "within target" if ratio <= 1 else "over target"
        print(f"  {scenario:<16} median {results[scenario]:6.2f} s  ({runs})  {ratio:.2f}x target, {verdict}")
    base = results.get("requeue, node 1")
    for scenario, took in results.items():
        if base is not None and not scenario.startswith("requeue"):
            print(f"  {scenario}: {base / took:.1f}x faster than the requeue path (before SLURM's own delays)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
