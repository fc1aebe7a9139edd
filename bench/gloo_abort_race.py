"""How often an abort leaves a rank inside a gloo collective: reads shut down vs both ways.

Four ranks (one process each, one host) loop ``barrier()`` on a gloo group, with
``gloo_abort.tracking()`` on. After a random number of barriers rank 2 faults and leaves;
every rank's helper thread sees the fault (a key of a store the bench hosts) and aborts its
connections. A run counts as *stuck* when a rank has not left its collective ``--grace``
seconds after the fault: it then waits for the group's timeout. Every rank stays alive until
the run ends, as ranks under the Wrapper do.

Two ways to abort are compared, alternating runs:

- ``reads``: ``gloo_abort.shutdown_sockets()`` as nvrx does it (reads shut down, the sockets
  held open until ``release_held``);
- ``both``: the same, then the connections shut down in both directions and released at
  once, so that peers still writing to this rank get a reset (the way the abort worked
  before).

    .venv/bin/python bench/gloo_abort_race.py [--runs 30] [--busy 2] [--grace 3] [--seed 0]

``--busy`` starts that many busy loops beside the ranks: the race needs a loaded machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from free_ports import free_port_run  # noqa: E402

from nvrx import processes  # noqa: E402

WORLD = 4
FAULTY = 2
MODES = ("reads", "both")
_BUSY = "import sys, threading\nthreading.Thread(target=sys.stdin.read, daemon=True).start()\n" \
    "while threading.active_count() > 1: pass"  # spins until its stdin closes


def _worker(mode: str, seed: int) -> None:
    import torch.distributed as dist

    from nvrx.inprocess import gloo_abort

    rank = int(os.environ["RANK"])
    flags, watched = _flags(), _flags()  # a client per thread: a client is not thread-safe
    random.seed(seed + rank)
    with gloo_abort.tracking():  # on for the whole run, as the Wrapper's call
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        threading.Thread(target=_abort_on_fault, args=(watched, mode), daemon=True).start()
        collectives = random.randint(5, 60) if rank == FAULTY else -1
        try:
            while collectives != 0:
                dist.barrier()
                collectives -= 1
            flags.set("fault", "1")
            raise RuntimeError("the faulty rank leaves")
        except RuntimeError:
            flags.set(f"left-{rank}", "1")
        flags.wait(["end"])  # stay alive (and connected) until the run is ended


def _flags():
    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"]) + 1
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))


def _abort_on_fault(flags, mode: str) -> None:
    from nvrx.inprocess import gloo_abort

    flags.wait(["fault"])
    own = _descriptors(set().union(*gloo_abort.tracked_groups().values()))
    gloo_abort.shutdown_sockets()
    if mode == "both":  # the earlier abort: both directions, nothing held
        for fd in own:
            _shutdown_both(fd)
        gloo_abort.release_held()


def _descriptors(inodes: set[int]) -> list[int]:
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and int(target[8:-1]) in inodes:
            found.append(int(name))
    return found


def _shutdown_both(fd: int) -> None:
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return  # gloo closed it already
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


def _run(mode: str, grace: float, seed: int, log_dir: Path) -> str:
    """One run: "ok", "stuck" (a rank still in its collective ``grace`` s after the fault)
    or "exited" (a rank's process ended before the run did: see its log)."""
    import torch.distributed as dist

    port = free_port_run(2)
    flags = dist.TCPStore("127.0.0.1", port + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    env = dict(os.environ, WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    logs = [open(log_dir / f"{mode}-{seed}-rank{r}.log", "w") for r in range(WORLD)]
    ranks = [
        subprocess.Popen([sys.executable, __file__, "--worker", mode, str(seed)],
                         env=dict(env, RANK=str(r)), start_new_session=True, stdout=log, stderr=log)
        for r, log in enumerate(logs)
    ]
    try:
        flags.wait(["fault"], datetime.timedelta(seconds=120))
        try:
            flags.wait([f"left-{r}" for r in range(WORLD)], datetime.timedelta(seconds=grace))
        except RuntimeError:  # torch's store timeout (DistStoreError is a RuntimeError)
            return "exited" if any(p.poll() is not None for p in ranks) else "stuck"
        return "ok"
    finally:
        flags.set("end", "1")
        processes.stop_all(ranks, ask=signal.SIGKILL)
        for log in logs:
            log.close()


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    if args.busy < 0:
        parser.error(f"--busy must be >= 0, got {args.busy}")
    if args.grace <= 0:
        parser.error(f"--grace must be > 0, got {args.grace}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=30, help="runs per way to abort (default 30)")
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the ranks (default 2)")
    parser.add_argument("--grace", type=float, default=3.0,
                        help="seconds after the fault by which every rank must have left (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault moments (default 0)")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker[0], int(args.worker[1]))
        return
    _check(parser, args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally below runs
    busy = [subprocess.Popen([sys.executable, "-c", _BUSY], stdin=subprocess.PIPE) for _ in range(args.busy)]
    counts = {mode: {"ok": 0, "stuck": 0, "exited": 0} for mode in MODES}
    tmp = tempfile.mkdtemp(prefix="nvrx-gloo-race-")
    try:
        for run in range(args.runs):
            for mode in MODES:
                counts[mode][_run(mode, args.grace, args.seed + run, Path(tmp))] += 1
    except BaseException:
        print(f"the ranks' logs are in {tmp}", file=sys.stderr)
        raise
    finally:
        for proc in busy:
            proc.stdin.close()
            proc.wait()
    print(f"{args.runs} runs per way, {args.busy} busy loops, seed {args.seed}")
    for mode in MODES:
        c = counts[mode]
        print(f"abort shutting down {mode:5s}: {c['stuck']} of {args.runs} runs left a rank in its "
              f"collective {args.grace:g} s after the fault ({c['exited']} runs lost a rank)")
    if any(c["exited"] for c in counts.values()):  # those runs tell nothing of the race
        sys.exit(f"runs lost a rank: the ranks' logs are in {tmp}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
