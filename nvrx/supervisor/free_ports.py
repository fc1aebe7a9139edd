"""Free ports for a job alone on one machine: so that two such jobs started side by side do
not both take the default ports.

A job of several nodes needs ports every node agrees on without talking (the defaults, or
SLURM's job id); a job of one node has no one to agree with, and takes a free pair: the
ranks' ``MASTER_PORT`` and the store's port that follows from it (``jobenv.store_port_for``).
"""

from __future__ import annotations

import random

from nvrx.jobenv import PORT_BASE, PORT_SLOTS, PORT_STRIDE, store_port_for
from nvrx.store.server_process import port_is_free

#: Pairs tried before giving up.
TRIES = 20


def free_pair(host: str, tries: int = TRIES) -> tuple[int, int] | None:
    """(P, ``store_port_for(P)``), both free on ``host`` now; None where ``host`` cannot be
    bound here or no free pair turned up in ``tries`` (the caller keeps its default ports:
    starting the store then says what is wrong with them).

    P is drawn from the range of the ports derived from job ids (``jobenv.ports_for_job``),
    below the system's range for outgoing connections: a port the system hands out (bind to
    port 0) could be taken by any connection opened before the job binds it.
    """
    for _ in range(tries):
        port = PORT_BASE + PORT_STRIDE * random.randrange(PORT_SLOTS)
        store = store_port_for(port)
        try:
            if port_is_free(host, port) and port_is_free(host, store):
                return port, store
        except OSError:  # not an address of this machine
            return None
    return None
