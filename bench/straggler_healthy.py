"""False positives of straggler scores: a healthy job of N minutes must name no one.

Starts ``--nodes`` local supervisors (``nvrx-supervise``) of ``--nproc`` ranks each running
``examples/ft_heartbeats.py`` (each rank times its step's compute with
``RankMonitorClient.timed_step``), with steps of ``--step-time`` seconds for about
``--minutes`` minutes, on this machine as it is (other work beside it adds the noise a
shared node has), then prints the job's exit codes, its wall time and every ``straggler``
event it wrote (none, for a healthy job). Exit code: 0 when the job ended well and named no
one, 1 when it named someone, 2 when the job itself failed (no verdict).

    .venv/bin/python bench/straggler_healthy.py [--minutes 10] [--nodes 2] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from free_ports import free_ports  # noqa: E402

from nvrx.events import read_dir  # noqa: E402


def run(minutes: float, nodes: int, nproc: int, step_time: float, out: Path) -> dict:
    """Runs a healthy job of ``nodes`` supervisors to its end, or kills it at its deadline.

    Returns its exit codes (-9 for a supervisor killed because the job hung past its deadline),
    its wall time, its step count and every ``straggler`` event it wrote.
    """
    steps = int(minutes * 60 / step_time)
    master, store = free_ports(2)
    job_id = f"healthy{os.getpid()}"
    command = [sys.executable, str(REPO / "examples" / "ft_heartbeats.py"), "--steps", str(steps),
               "--step-time", str(step_time), "--checkpoint-every", "100",
               "--checkpoint-dir", str(out / "ck")]  # fmt: skip
    procs: list[subprocess.Popen] = []
    start = time.monotonic()
    try:
        _start(procs, nodes, nproc, (master, store), job_id, out, command)
    except BaseException:
        wait_all(procs, start)
        raise
    codes = wait_all(procs, start + minutes * 60 + 300)  # its steps, plus its start and end
    found, _ = read_dir(out / "logs" / job_id)
    return {
        "exit_codes": codes,
        "wall_s": round(time.monotonic() - start, 1),
        "steps": steps,
        "straggler_events": [e for e in found if e["kind"] == "straggler"],
    }


def wait_all(procs: list[subprocess.Popen], deadline: float) -> list[int]:
    """Waits for every process until ``deadline`` (``time.monotonic()``), then kills the
    process group of each still running (a supervisor's ranks die with it): their exit codes,
    -9 for those killed."""
    try:
        for proc in procs:
            proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # the job hung: what still runs is killed below
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [proc.returncode for proc in procs]


def _start(
    procs: list[subprocess.Popen],
    nodes: int,
    nproc: int,
    ports: tuple[int, int],
    job_id: str,
    out: Path,
    command: list[str],
) -> None:
    """Starts one ``nvrx-supervise`` per node, each in its own session, appending it to ``procs``.

    Appending as it goes lets the caller kill those already started if a later start fails.
    """
    master, store = ports
    for node in range(nodes):
        cmd = [sys.executable, "-m", "nvrx.supervisor.cli", "--nnodes", str(nodes),
               "--node-rank", str(node), "--nproc-per-node", str(nproc), "--master-port",
               str(master), "--store-port", str(store), "--job-id", job_id, "--log-dir",
               str(out / "logs"), "--no-warm-standby", "--ft-safety-factor", "60", "--", *command]  # fmt: skip
        with open(out / f"supervisor-{node}.out", "w") as sink:
            procs.append(subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip


def verdict(result: dict) -> int:
    """The bench's exit code: 2 when the job did not end well (a failed or hung job proves
    nothing), else 1 when it named someone a straggler, else 0."""
    if any(result["exit_codes"]) or len(result["exit_codes"]) == 0:
        return 2
    return 1 if result["straggler_events"] else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the job (default 10)")
    parser.add_argument("--nodes", type=int, default=2, help="local supervisors (default 2)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per node (default 2)")
    parser.add_argument("--step-time", type=float, default=0.2, help="seconds of compute per step (default 0.2)")
    args = parser.parse_args()
    if args.minutes <= 0 or args.nodes < 2 or args.nproc < 1 or args.step_time <= 0:
        parser.error("--minutes and --step-time must be > 0, --nodes >= 2, --nproc >= 1")
    with tempfile.TemporaryDirectory(prefix="nvrx-bench-healthy-") as out:
        result = run(args.minutes, args.nodes, args.nproc, args.step_time, Path(out))
        print(json.dumps(result))
        code = verdict(result)
        if code == 2:
            tail = (Path(out) / "supervisor-0.out").read_text()[-2000:]
            print(f"the job failed (exit codes {result['exit_codes']}): no verdict\n{tail}",
                  file=sys.stderr)  # fmt: skip
    return code


if __name__ == "__main__":
    sys.exit(main())
