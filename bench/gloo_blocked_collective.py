"""What ends a thread blocked in a gloo collective before the group's timeout.

For each way to end it, two ranks (one process each, one host) form a gloo group over a
TCPStore that the bench hosts on 127.0.0.1, with a timeout of ``--timeout`` seconds. Rank 1
never joins the collective and stays alive; rank 0 blocks in ``dist.all_reduce`` in a worker
thread and, about 1 s later, its main thread tries one way to end it:

- ``pg.abort()`` and ``pg.shutdown()`` of the default group (where torch has them);
- ``dist.destroy_process_group()``;
- ``distributed_c10d._abort_process_group()`` (where torch has it);
- an exception raised into the blocked thread (``PyThreadState_SetAsyncExc``);
- as a control, the peer killed (SIGKILL to rank 1).

The figure is the seconds from that call until the all_reduce returned or raised, capped at
the timeout plus ``--margin``; a way "only ends it at the timeout" when that took at least
80 % of the timeout (counted from when the thread entered all_reduce, about 1 s before the
call: at the timeout it equals it).

    .venv/bin/python bench/gloo_blocked_collective.py [--timeout 8] [--margin 5]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

sys.dont_write_bytecode = True  # no __pycache__ left behind by the import below
sys.path.insert(0, str(Path(__file__).resolve().parent))
from free_ports import free_ports  # noqa: E402

from nvrx import processes  # noqa: E402

METHODS = ("pg.abort", "pg.shutdown", "destroy_process_group", "_abort_process_group",
           "async exception", "peer killed (control)")
AT_TIMEOUT = 0.8  # share of the timeout from which a collective "returned at the timeout"
STARTUP_S = 90.0  # allowance for both ranks to import torch and form the group
STORE_S = 300.0  # timeout of the bench's store clients (a rank waiting there is killed)


class Interrupt(Exception):
    """The exception raised into the blocked thread."""


# ---------------------------------------------------------------------------- ranks


def _connect(port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False,
                         timeout=datetime.timedelta(seconds=STORE_S))


def _init(store: Any, rank: int, timeout_s: float) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _peer(port: int, timeout_s: float) -> None:
    """Rank 1: joins the group, never the collective, and waits to be killed."""
    store = _connect(port)
    _init(store, 1, timeout_s)
    store.set("pid1", str(os.getpid()))
    store.wait(["end"])  # never set: the bench kills this process (or its store goes away)
    os._exit(0)


def _describe(exc: BaseException | None) -> str:
    """``Type: first line`` of an exception, after those it was raised while handling."""
    chain = []
    while exc is not None:
        lines = str(exc).strip().splitlines()
        first = re.sub(r"\[[^\]]*/([^/\]]+)\]", r"[\1]", lines[0] if lines else "")  # source file
        chain.append(f"{type(exc).__name__}: {first}".strip()[:110])
        exc = exc.__context__
    return " <- ".join(chain) if chain else "nothing"


def _collective(state: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    state["began"] = time.monotonic()
    try:
        try:
            dist.all_reduce(torch.ones(1))
        except BaseException as exc:
            state["raised"] = exc
        state["done"] = time.monotonic()
    except BaseException as exc:  # the async exception landed while the first was handled
        state["raised"] = exc
        state.setdefault("done", time.monotonic())


def _call(method: str, thread: threading.Thread, peer: int) -> str:
    """Try ``method`` on the blocked collective; what the call itself did."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    pg = dist.group.WORLD
    if method in ("pg.abort", "pg.shutdown"):
        name = method.split(".")[1]
        target = pg if hasattr(pg, name) else pg._get_backend(torch.device("cpu"))
        getattr(target, name)()
        return f"{type(target).__name__}.{name}() returned"
    if method == "destroy_process_group":
        dist.destroy_process_group()
    elif method == "_abort_process_group":
        c10d._abort_process_group()
    elif method == "async exception":
        set_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
        set_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
        return f"set on {set_exc(thread.ident, Interrupt)} thread(s)"
    else:
        os.kill(peer, signal.SIGKILL)
    return "returned"


_reported = threading.Lock()


def _report_and_exit(state: dict[str, Any]) -> None:
    """Print rank 0's result and end the process (the first caller does, once)."""
    _reported.acquire()  # a second caller waits here until the first has ended the process
    done = state.get("done")
    result = {
        "seconds": None if done is None else done - state["t0"],
        "since_start": None if done is None else done - state["began"],
        "raised": _describe(state.get("raised")) if done is not None else None,
        "call": state.get("call", "had not returned"),
    }
    print("RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)


def _blocked(port: int, method: str, timeout_s: float, cap_s: float) -> None:
    """Rank 0: blocks in all_reduce in a thread; the main thread then tries ``method``."""
    store = _connect(port)
    _init(store, 0, timeout_s)
    peer = int(store.get("pid1"))  # waits until rank 1 has formed the group too
    state: dict[str, Any] = {}
    thread = threading.Thread(target=_collective, args=(state,), daemon=True)
    thread.start()
    time.sleep(1.0)  # deliberate: lets the thread enter all_reduce (nothing tells when it has)
    state["t0"] = start = time.monotonic()
    watchdog = threading.Timer(cap_s, _report_and_exit, args=(state,))
    watchdog.daemon = True
    watchdog.start()  # ends the process at the cap even if the call itself hangs
    try:
        outcome = _call(method, thread, peer)
    except BaseException as exc:
        outcome = f"raised {_describe(exc)}"
    state["call"] = f"{outcome} after {time.monotonic() - start:.2f} s"
    thread.join(timeout=max(0.0, start + cap_s - time.monotonic()))
    _report_and_exit(state)


# --------------------------------------------------------------------------- bench


def _available(method: str) -> bool:
    """Whether this torch offers ``method`` at all."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if method in ("pg.abort", "pg.shutdown"):
        name = method.split(".")[1]
        return hasattr(dist.ProcessGroup, name) or hasattr(dist.ProcessGroupGloo, name)
    if method == "_abort_process_group":
        return hasattr(c10d, "_abort_process_group")
    return True


def _start(rank: int, method: str, port: int, args: argparse.Namespace, log: IO) -> subprocess.Popen:
    """One rank: this script as ``--worker``, in a session of its own, its output to ``log``."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    env.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # bounds reverse-DNS stalls
    cmd = [sys.executable, __file__, "--timeout", str(args.timeout), "--margin", str(args.margin),
           "--worker", str(rank), method, str(port)]
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log, stderr=log)


def _result(log: IO) -> tuple[dict[str, Any] | None, str]:
    """Rank 0's RESULT line (None without one) and the rest of its output."""
    log.seek(0)
    text = log.read().decode(errors="replace")
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), text
    return None, text


def _run(method: str, args: argparse.Namespace) -> tuple[dict[str, Any] | None, str]:
    """One pair of ranks for ``method``: rank 0's result and output."""
    import torch.distributed as dist

    port = free_ports(1)[0]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=STORE_S))
    with tempfile.TemporaryFile() as log0, tempfile.TemporaryFile() as log1:
        procs: list[subprocess.Popen] = []
        try:
            procs.append(_start(0, method, port, args, log0))
            procs.append(_start(1, method, port, args, log1))
            procs[0].wait(timeout=STARTUP_S + args.timeout + args.margin)
        except subprocess.TimeoutExpired:
            pass
        finally:
            processes.stop_all(procs, ask=signal.SIGKILL)
        del store
        return _result(log0)


def _row(method: str, result: dict[str, Any] | None, timeout_s: float, cap_s: float) -> list[str]:
    """The table's row of ``method``; whether the collective ended only at its timeout is read
    from its time in all_reduce, which the timeout bounds."""
    if result is None:
        return [method, "-", "-", "-", "-", "no result (see rank 0's output below)"]
    seconds = result["seconds"]
    if seconds is None:
        return [method, f">{cap_s:g}", "-", "yes (not by the cap)", result["call"], "still blocked"]
    if seconds < 0:
        return [method, "-", "-", "-", result["call"], f"before the call: {result['raised']}"]
    at_timeout = "yes" if result["since_start"] >= AT_TIMEOUT * timeout_s else "no"
    return [method, f"{seconds:.2f}", f"{result['since_start']:.2f}", at_timeout, result["call"],
            result["raised"]]


def _table(rows: list[list[str]]) -> None:
    """Print ``rows`` under their heading, in columns (the last one as it comes)."""
    head = ["method", "s after call", "s in all_reduce", "only at timeout", "the call",
            "the collective raised"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]
    for row in [head, *rows]:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]))


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a timeout or margin the measure cannot use, naming it."""
    if args.timeout <= 1:
        parser.error(f"--timeout must be > 1 s, got {args.timeout}")
    if args.margin <= 0:
        parser.error(f"--margin must be > 0, got {args.margin}")


def main() -> None:
    """A rank (``--worker``), or the bench: a pair of ranks per method, then the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--timeout", type=float, default=8.0,
                        help="the gloo group's timeout in seconds (default 8)")
    parser.add_argument("--margin", type=float, default=5.0,
                        help="seconds past the timeout after which a collective counts as still "
                             "blocked (default 5)")
    parser.add_argument("--worker", nargs=3, metavar=("RANK", "METHOD", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    _check(parser, args)
    cap_s = args.timeout + args.margin
    if args.worker:
        rank, method, port = int(args.worker[0]), args.worker[1], int(args.worker[2])
        if rank == 0:
            _blocked(port, method, args.timeout, cap_s)
        else:
            _peer(port, args.timeout)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally in _run runs
    import torch

    print(f"torch {torch.__version__}, gloo timeout {args.timeout:g} s, cap {cap_s:g} s, "
          f"GLOO_SOCKET_IFNAME=lo")
    rows, failed = [], []
    for method in METHODS:
        if not _available(method):
            rows.append([method, "-", "-", "-", "-", "(not in this torch)"])
            continue
        result, output = _run(method, args)
        rows.append(_row(method, result, args.timeout, cap_s))
        if result is None:
            failed.append((method, output))
    _table(rows)
    for method, output in failed:
        print(f"\n--- rank 0's output for {method}:\n{output.strip()[-3000:]}")
    if failed:
        sys.exit(f"no result for {', '.join(m for m, _ in failed)}: see rank 0's output above")


if __name__ == "__main__":
    main()
