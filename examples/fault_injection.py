"""Faults for the demo job, chosen on the command line or in ``NVRX_DEMO_FAULTS``.

A fault is ``KIND:STEP:RANK`` with KIND one of ``exception`` (raise at that
step), ``hang`` (sleep for ever in ``sleep_forever``, with the GIL released, as
a rank stuck in a blocking call does), ``kill`` (SIGKILL the process),
``node`` (lose the whole node: freeze, then SIGKILL, the rank's supervisor and
every process below it, as a node that dies takes all of them at once),
``silent`` (freeze the Wrapper's monitor process of the rank, then the rank:
alive, but no heartbeat) or ``exit130`` (stop the whole
job). Each fault fires once per
job: a marker file in the run directory remembers that it fired, so the
restarted process (or the next in-process round) does not fire it again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = ("exception", "hang", "kill", "node", "silent", "exit130")


class InjectedFault(RuntimeError):
    """The exception an ``exception`` fault raises."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int

    @classmethod
    def parse(cls, text: str) -> Fault:
        parts = text.strip().split(":")
        if len(parts) != 3 or parts[0] not in KINDS:
            raise ValueError(
                f"fault {text!r} must be KIND:STEP:RANK with KIND in {', '.join(KINDS)}"
            )
        try:
            step, rank = int(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(f"fault {text!r}: STEP and RANK must be integers") from None
        return cls(parts[0], step, rank)

    @property
    def marker(self) -> str:
        return f"fault-{self.kind}-s{self.step}-r{self.rank}.fired"


def parse_faults(specs: list[str] | None, env_value: str | None = None) -> list[Fault]:
    """Faults from ``--fault`` options plus the comma-separated ``NVRX_DEMO_FAULTS``."""
    texts = list(specs or [])
    if env_value:
        texts.extend(t for t in env_value.split(",") if t.strip())
    return [Fault.parse(t) for t in texts]


def lose_node() -> None:
    """The ``node`` fault: this rank's supervisor (its parent) and everything below it, gone."""
    import psutil

    supervisor = psutil.Process(os.getppid())

    def below() -> list[psutil.Process]:
        return [p for p in supervisor.children(recursive=True) if p.pid != os.getpid()]

    frozen = [supervisor, *below()]
    for proc in frozen:  # frozen first: nobody reacts to the others
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGSTOP)
    frozen += [p for p in below() if p not in frozen]  # started meanwhile
    # Everything below the supervisor first: the supervisor's death ends this rank at once
    # (its parent-death signal), and whatever was still frozen then would stay frozen.
    for proc in [*frozen[1:], supervisor]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def go_silent(run_dir: Path) -> None:
    """The ``silent`` fault: the rank's monitor process (no more heartbeats), then the rank, stop.

    Their pids go to ``silenced.pids`` in ``run_dir``: whoever runs the demo can end them
    if nothing else does (a frozen monitor leads a session of its own)."""
    import psutil

    from nvrx import monitor_boot

    frozen = [os.getpid()]
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if any(monitor_boot.PROGRAM in part for part in proc.cmdline()):
                frozen.append(proc.pid)
    (run_dir / "silenced.pids").write_text(" ".join(map(str, frozen)) + "\n")
    for pid in frozen[1:]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGSTOP)


def sleep_forever() -> None:
    """The ``hang`` fault: no more progress, GIL released; a signal handler's exception ends it."""
    while True:
        time.sleep(3600)


class FaultInjector:
    """Fires each due fault once per job (marker files under ``run_dir``)."""

    def __init__(self, faults: list[Fault], rank: int, run_dir: str | os.PathLike[str]) -> None:
        self.faults = [f for f in faults if f.rank == rank]
        self.run_dir = Path(run_dir)

    def _claim(self, fault: Fault) -> bool:
        try:
            fd = os.open(self.run_dir / fault.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        os.close(fd)
        return True

    def at_step(self, step: int) -> None:
        for fault in self.faults:
            if fault.step != step or not self._claim(fault):
                continue
            sys.stderr.write(f"[demo] rank {fault.rank}: injecting {fault.kind} at step {step}\n")
            sys.stderr.flush()
            if fault.kind == "exception":
                raise InjectedFault(f"injected exception at step {step} on rank {fault.rank}")
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "node":
                lose_node()
            if fault.kind == "silent":
                go_silent(self.run_dir)
            if fault.kind == "exit130":
                sys.stdout.flush()
                os._exit(130)
            if fault.kind == "hang":
                sleep_forever()
