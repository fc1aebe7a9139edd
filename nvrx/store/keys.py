"""Key layout of the nvrx store: the root, and the keys of host liveness without a supervisor.

Everything nvrx writes lives under ``nvrx/``. The keys of restart rounds and
process generations belong to the round protocol and are declared there
(``nvrx.store.rounds``); the supervisors' keys to theirs
(``nvrx.supervisor.node_keys``).
"""

from __future__ import annotations

ROOT = "nvrx/"

#: Without a supervisor, one node agent per host beats for the host's ranks
#: (``nvrx.node_agent.host``): a host's *slot* is its place in the ring of hosts
#: (``nvrx.store.ring``: ``alive/<slot>`` and ``claim/<slot>`` under this prefix).
HOSTS_PREFIX = ROOT + "host/"
#: Counter: host slots handed out (a slot taken twice by one host is ended at once).
HOST_COUNT = HOSTS_PREFIX + "count"
#: The job's token: each monitor writes it (compare-and-set, so the first to write decides)
#: before it lists its rank and before its first beat, and gives it to its host's agent,
#: which reads it at every connect: a store without it, or with another, is not the agent's
#: job's (a job started again at the same address after a kill).
JOB_TOKEN = HOSTS_PREFIX + "job"


def host_slot(host: str) -> str:
    """The slot of ``host`` (compare-and-set once: the first monitor of the host to ask decides it)."""
    return f"{HOSTS_PREFIX}slot/{host}"


def host_name(slot: int) -> str:
    """JSON ``{"host": ..., "node": ...}`` of host ``slot``, set by its agent as it takes the
    slot: the agent that finds the host silent names it in the faults of its ranks."""
    return f"{HOSTS_PREFIX}name/{slot}"


def host_ranks(slot: int) -> str:
    """Append-only ``"r,"`` list of the initial ranks on host ``slot``: each rank's monitor
    adds its own when it starts watching, before its rank goes on."""
    return f"{HOSTS_PREFIX}ranks/{slot}"


def host_ended(slot: int) -> str:
    """Append-only ``"r,"`` list of those whose monitor stopped beating on purpose."""
    return f"{HOSTS_PREFIX}ended/{slot}"
