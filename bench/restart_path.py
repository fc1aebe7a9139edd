"""The path of one exception restart through nvrx: the files the failing rank passes through.

Two ranks run a wrapped function under the in-process Wrapper (no supervisor, one host).
Rank 1 raises in the first round; a profile hook set on its main thread just before the
raise records every function of ``nvrx/`` called, and every frame unwound or returned
from, until the function is entered again in the next round, where the hook is removed.
Module bodies (a module imported for the first time on the way) are not counted. The
bench prints those files with the number of calls into each, and their count.

    .venv/bin/python bench/restart_path.py [--repeats 1] [--keep] [--functions]

The path covers the main thread only: the raise, the fault's record, the iteration
barrier, the rank assignment and the re-entry. The rank's monitor thread (which waits on
the store) and its monitor process run beside it.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from free_ports import free_port_run  # noqa: E402

SETTINGS = dict(
    soft_timeout=20.0,
    hard_timeout=40.0,
    heartbeat_timeout=20.0,
    heartbeat_interval=1.0,
    barrier_timeout=60.0,
)


def _rank(out: Path) -> int:
    import nvrx.inprocess as inprocess

    rank = int(os.environ["RANK"])
    package = Path(inprocess.__file__).resolve().parents[1]  # the nvrx that runs
    root = str(package) + os.sep
    frames: collections.Counter[str] = collections.Counter()

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if code.co_filename.startswith(root) and code.co_name != "<module>":
            path = os.path.relpath(code.co_filename, package.parent)
            frames[f"{path}::{code.co_name}"] += 1 if event == "call" else 0

    def fn(call_wrapper: inprocess.CallWrapper) -> None:
        if call_wrapper.iteration > 0:
            sys.setprofile(None)
            if rank == 1:
                (out / "path.json").write_text(json.dumps(dict(frames)))
            return
        if rank == 1:
            sys.setprofile(hook)
            raise RuntimeError("injected")
        while True:  # rank 0 trains until the restart interrupts it
            time.sleep(0.01)

    kw = {k: datetime.timedelta(seconds=v) for k, v in SETTINGS.items()}
    inprocess.Wrapper(**kw)(fn)()
    return 0


def _run(out: Path) -> dict[str, int]:
    port = free_port_run(2)
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=str(port), NVRX_LOG_DIR=str(out / "logs"))
        for name in ("NVRX_STORE_HOST", "NVRX_STORE_PORT", "NVRX_SUPERVISED", "NVRX_RESTART_COUNT"):
            env.pop(name, None)
        with open(out / f"rank-{rank}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--rank", str(out)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    deadline = time.monotonic() + 180
    try:
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:  # each leads its own process group: its monitor goes with it
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    codes = [p.returncode for p in procs]
    path = out / "path.json"
    if codes != [0, 0] or not path.exists() or not json.loads(path.read_text()):
        raise RuntimeError(f"no restart path recorded (exit codes {codes}); logs in {out}")
    return dict(json.loads(path.read_text()))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        return _rank(Path(sys.argv[2]))
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs; the union is printed")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument(
        "--functions", action="store_true", help="also print the functions called in each file"
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    calls: collections.Counter[str] = collections.Counter()
    for _ in range(args.repeats):
        out = Path(tempfile.mkdtemp(prefix="nvrx-bench-path-"))
        try:
            calls.update(_run(out))
        finally:
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
    total: collections.Counter[str] = collections.Counter()
    for where, count in calls.items():
        total[where.partition("::")[0]] += count
    for path, count in sorted(total.items()):
        print(f"{count:6d}  {path}")
        for where, n in sorted(calls.items()) if args.functions else ():
            if where.startswith(path + "::"):
                print(f"{n:14d}  {where.partition('::')[2]}")
    print(f"restart_path: {len(total)} distinct nvrx/ files between the raise and the re-entry")
    return 0


if __name__ == "__main__":
    sys.exit(main())
