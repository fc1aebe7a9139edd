"""tools.inject_fault: every CPU fault kind, each injected into a child process, does what it says."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvrx.inprocess.tools.inject_fault import Fault, inject_fault

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import signal, sys, time
# as in a program started from a terminal: a child of a background shell inherits SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
from nvrx.inprocess.tools.inject_fault import (
    Fault, InjectedException, inject_fault, maybe_raise_workload_exception)
kind = Fault[sys.argv[1]]
print("armed", inject_fault((kind,), 1, 0, 0.05, 0).name, flush=True)
deadline = time.monotonic() + 8
try:
    while time.monotonic() < deadline:
        maybe_raise_workload_exception()
        time.sleep(0.01)
        print("tick", flush=True)
except InjectedException:
    sys.exit(42)
except KeyboardInterrupt:
    sys.exit(43)
sys.exit(0)
"""


def _start(kind: str) -> subprocess.Popen[str]:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, kind],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> int:
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.mark.parametrize(
    ("kind", "returncode"),
    [
        ("ASYNC_EXC", 42),
        ("SIGNAL_EXC", 42),
        ("WORKLOAD_EXC", 42),
        ("SIGINT", 43),
        ("SIGTERM", -signal.SIGTERM),
        ("SIGKILL", -signal.SIGKILL),
        ("SEGFAULT", -signal.SIGSEGV),
        ("OS_ABORT", -signal.SIGABRT),
        ("KILL", -signal.SIGKILL),  # an older name of SIGKILL
    ],
)
def test_fault_kind_ends_the_child_as_expected(kind, returncode):
    assert _finish(_start(kind)) == returncode


def test_sigstop_stops_the_child():
    proc = _start("SIGSTOP")
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
    finally:
        proc.kill()
        _finish(proc)


def test_lock_gil_stops_every_python_thread():
    proc = _start("LOCK_GIL")
    try:
        assert proc.stdout.readline().startswith("armed LOCK_GIL")
        last, gap = time.monotonic(), 0.0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and gap < 1.5:
            ready, _, _ = select.select([proc.stdout], [], [], 0.1)
            now = time.monotonic()
            if ready:
                line = proc.stdout.readline()
                assert line, "the child ended instead of hanging"
                last = now
            gap = now - last
        assert gap >= 1.5, "the main thread kept running: the GIL was not held"
        assert proc.poll() is None
    finally:
        proc.kill()
        _finish(proc)


class _NotStarted:
    """Stands in for the injecting thread: records what would run, runs nothing."""

    made: list[tuple] = []

    def __init__(self, target, args, name, daemon):
        self.made.append(args)

    def start(self):
        pass


def test_draws_are_reproducible_and_spare_keep_alive_ranks(monkeypatch):
    from nvrx.inprocess.tools import inject_fault as module

    monkeypatch.setattr(module.threading, "Thread", _NotStarted)
    monkeypatch.setenv("WORLD_SIZE", "8")
    runs = []
    for _ in range(2):
        chosen = []
        for rank in range(8):
            monkeypatch.setenv("RANK", str(rank))
            chosen.append(inject_fault((Fault.WORKLOAD_EXC, Fault.SIGKILL), (2, 3), 2, (1, 2), 7))
        runs.append(chosen)
    assert runs[0] == runs[1], "the same seed must choose the same ranks and kind"
    hit = [r for r, f in enumerate(runs[0]) if f is not None]
    assert 2 <= len(hit) <= 3 and min(hit) >= 2
    assert len({f for f in runs[0] if f is not None}) == 1
    delays = {args[1] for args in _NotStarted.made}
    assert len(delays) == 1 and 1 <= delays.pop() <= 2


def test_old_kind_names_are_aliases():
    assert Fault.GIL is Fault.LOCK_GIL and Fault.ABORT is Fault.OS_ABORT
    assert Fault.GPU is Fault.GPU_ERROR and Fault.STOP is Fault.SIGSTOP
    assert Fault["TERM"] is Fault.SIGTERM and Fault["INT"] is Fault.SIGINT


@pytest.mark.parametrize("kind", [Fault.GPU_ERROR, Fault.GPU_SLEEP])
def test_gpu_kinds_name_the_missing_cuda(kind, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match=rf"Fault.{kind.name} needs CUDA"):
        inject_fault((kind, Fault.SIGTERM), 1, 0, 3600.0, 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"faults": ()}, "faults must be a non-empty sequence of Fault"),
        ({"faults": ("SIGKILL",)}, "faults must be a non-empty sequence of Fault"),
        ({"delay": "soon"}, "delay must be a number or a"),
        ({"num_faults": 1.5}, "num_faults must be a number or a"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    args = {"faults": (Fault.WORKLOAD_EXC,), "num_faults": 1, "keep_alive": 0, "delay": 3600.0}
    args.update(kwargs)
    with pytest.raises(TypeError, match=match):
        inject_fault(seed=0, **args)
