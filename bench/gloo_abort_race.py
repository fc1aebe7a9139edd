"""How often an abort leaves a rank inside a gloo collective: reads shut down vs both ways.

Four ranks (one process each, one host) loop ``barrier()`` on a gloo group created under
``gloo_abort.tracking()``. At a random moment rank 2 faults and leaves; every rank's helper
thread sees the fault (a flag file) and aborts its connections. A run counts as *stuck* when
a rank has not left its collective ``--grace`` seconds after the fault: it then waits for the
group's timeout. Every rank stays alive until the run ends, as ranks under the Wrapper do.

Two ways to abort are compared, alternating runs:

- ``reads``: ``gloo_abort.shutdown_sockets()`` as nvrx does it (reads shut down, the sockets
  held open until ``release_held``);
- ``both``: the same, then writes shut down too and the sockets released at once, so that
  peers still writing to this rank get a reset (the way the abort worked before).

    .venv/bin/python bench/gloo_abort_race.py [--runs 30] [--busy 2] [--grace 3]

``--busy`` starts that many busy loops beside the ranks: the race needs a loaded machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from free_ports import free_port_run  # noqa: E402

WORLD = 4
FAULTY = 2
MODES = ("reads", "both")


def _worker(mode: str, run_dir: Path) -> None:
    import torch.distributed as dist

    from nvrx.inprocess import gloo_abort

    rank = int(os.environ["RANK"])
    fault = run_dir / "fault"
    with gloo_abort.tracking():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        threading.Thread(target=_abort_on, args=(fault, mode), daemon=True).start()
        fault_at = time.monotonic() + random.uniform(0.1, 0.6)
        try:
            while True:
                if rank == FAULTY and time.monotonic() > fault_at:
                    fault.touch()
                    raise RuntimeError("the faulty rank leaves")
                dist.barrier()
        except RuntimeError:
            (run_dir / f"left-{rank}").touch()
        threading.Event().wait(60)  # stay alive (and connected) until the run is ended


def _abort_on(fault: Path, mode: str) -> None:
    from nvrx.inprocess import gloo_abort

    while not fault.exists():
        time.sleep(0.0005)
    gloo_abort.shutdown_sockets()
    if mode == "both":
        for sock in list(gloo_abort._held):  # private: only to rebuild the former abort
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        gloo_abort.release_held()


def _run(mode: str, grace: float) -> bool:
    """One run; True when a rank stayed in its collective ``grace`` s after the fault."""
    with tempfile.TemporaryDirectory(prefix="nvrx-gloo-race-") as tmp:
        run_dir = Path(tmp)
        env = dict(os.environ, WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port_run(1)))
        ranks = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", mode, str(run_dir)],
                env=dict(env, RANK=str(rank)), start_new_session=True,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            for rank in range(WORLD)
        ]
        try:
            if not _wait_for(lambda: (run_dir / "fault").exists(), 120.0):
                raise RuntimeError(f"no fault within 120 s (ranks exited: {[p.poll() for p in ranks]})")
            return not _wait_for(lambda: all((run_dir / f"left-{r}").exists() for r in range(WORLD)), grace)
        finally:
            _end(ranks)


def _wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _end(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per way to abort (default 30)")
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the ranks (default 2)")
    parser.add_argument("--grace", type=float, default=3.0,
                        help="seconds after the fault by which every rank must have left (default 3)")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker[0], Path(args.worker[1]))
        return
    if args.runs < 1 or args.busy < 0 or args.grace <= 0:
        parser.error(f"--runs must be ≥ 1, --busy ≥ 0, --grace > 0; got {args.runs}, {args.busy}, {args.grace}")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(args.busy)]
    stuck = dict.fromkeys(MODES, 0)
    try:
        for _ in range(args.runs):
            for mode in MODES:
                stuck[mode] += _run(mode, args.grace)
    finally:
        _end(busy)
    for mode in MODES:
        print(f"abort shutting down {mode:5s}: {stuck[mode]} of {args.runs} runs left a rank "
              f"in its collective {args.grace:g} s after the fault")


if __name__ == "__main__":
    main()
