"""Pick free TCP ports for the benches' jobs.

The ports are only free when picked: the sockets are closed before returning, so another
process could take one before the job binds it.
"""

from __future__ import annotations

import contextlib
import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports on ``host`` (bound all at once, so they differ)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def free_port_run(n: int = 2, host: str = "127.0.0.1", tries: int = 100) -> int:
    """A port p with p .. p + n - 1 all free on ``host``, for jobs that use neighbouring ports.

    For example MASTER_PORT, and the inprocess Wrapper's store on MASTER_PORT + 1.
    """
    for _ in range(tries):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind((host, 0))
            port = first.getsockname()[1]
            if port + n - 1 > 65535:
                continue
            try:
                for offset in range(1, n):
                    stack.enter_context(socket.socket()).bind((host, port + offset))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no {n} neighbouring free ports found on {host}")
