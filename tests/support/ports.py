"""Free TCP ports for the tests' jobs, picked below the kernel's ephemeral range and
outside the range of the ports nvrx derives from job ids.

A port is only free when it is picked: the job binds it later. A port of the ephemeral
range (``net.ipv4.ip_local_port_range``) can be taken meanwhile by any outgoing
connection of another test (every store client makes some), and the job then fails with
EADDRINUSE. Ports below that range are never handed out to outgoing connections; each
pick is random there and checked free, so two tests that run at once rarely meet.

The jobs of the local SLURM cluster take the ports their job id maps to
(``nvrx.jobenv.ports_for_job``), and so do submitit's local jobs; a supervisor started
without ports draws a free block of that range (``nvrx.supervisor.free_ports``). A test
that picked one of those ports before such a job bound it would make that job fail. So no
pick lies there, nor on the local SLURM cluster's own daemons' ports.
"""

from __future__ import annotations

import contextlib
import functools
import random
import socket
from collections.abc import Iterable

from nvrx import jobenv
from tests.support.slurm_config import SLURMD_PORT_BASE

#: Lowest port picked: above the well-known and most registered services' ports.
LOWEST = 10000
#: The ports nvrx derives from job ids: never picked.
DERIVED = range(jobenv.PORT_BASE, jobenv.PORT_BASE + jobenv.PORT_STRIDE * jobenv.PORT_SLOTS)
#: The local SLURM cluster's slurmd ports, one per node: never picked.
SLURMD = range(SLURMD_PORT_BASE, SLURMD_PORT_BASE + 64)


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _all_free(ports: Iterable[int], host: str) -> bool:
    with contextlib.ExitStack() as stack:
        try:
            for port in ports:
                stack.enter_context(socket.socket()).bind((host, port))
        except OSError:
            return False
    return True


def free_port_run(
    n: int = 1, host: str = "127.0.0.1", also: Iterable[int] = (), tries: int = 200
) -> int:
    """A port p with p .. p + n - 1 free on ``host``, and the ports ``p + d`` for each offset
    ``d`` in ``also`` (a job's other ports at fixed distances)."""
    offsets = [*range(n), *also]
    candidates = _candidates(min(offsets), max(offsets), _ephemeral_start())
    for _ in range(tries):
        port = random.choice(candidates)
        if _all_free((port + d for d in offsets), host):
            return port
    raise RuntimeError(f"no run of {n} free ports found on {host} in {tries} tries")


@functools.cache
def _candidates(low: int, high: int, ephemeral: int) -> list[int]:
    """Every p whose ports p + low .. p + high lie in [LOWEST, ephemeral), outside the
    ranges never picked (a run is far shorter than either, so its two ends tell)."""
    avoid = (DERIVED, SLURMD)
    ends = (low, high)
    found = [
        p for p in range(LOWEST - low, ephemeral - high)
        if not any(p + end in r for end in ends for r in avoid)
    ]  # fmt: skip
    if not found:
        raise RuntimeError(
            f"no port to pick between {LOWEST} and the ephemeral range's start {ephemeral} "
            "(/proc/sys/net/ipv4/ip_local_port_range) outside the ports of jobs"
        )
    return found


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports (each one its own pick)."""
    picked: list[int] = []
    while len(picked) < n:
        port = free_port_run(1, host)
        if port not in picked:
            picked.append(port)
    return picked
