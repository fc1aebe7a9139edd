"""Store keys of node liveness and node roles, the supervisor's; its node agent is told the ring's.

A *slot* is the place a supervisor started in (``SLURM_PROCID``, or
``--node-rank`` without SLURM); it never changes. A *node rank* is the place
in training a slot holds: slot ``s`` holds node rank ``s`` when ``s`` is below
the active node count, else it starts as a spare and may take over the node
rank of a lost slot. One liveness key per slot: store load grows with nodes,
never with ranks.

The slots' liveness is the ring of ``nvrx.store.ring`` (``RING``: a slot's ``alive`` counter
and its ``claim``, sealed with the job's secret, whose first valid entry decides its end:
it left cleanly, or a supervisor that found it silent declared it lost and fenced it).
"""

from __future__ import annotations

from nvrx.store.ring import FENCE as FENCE  # whoever declares a slot lost adds it
from nvrx.store.ring import RingKeys

from .config import KEY_PREFIX

PREFIX = KEY_PREFIX + "node/"
#: Sealed count: node ranks lost with no spare to take them over (the job shrank by as many).
SHRUNK = PREFIX + "shrunk"


#: The ring of slots (``nvrx.store.ring``): a slot's ``alive`` counter and its ``claim``.
RING = RingKeys(PREFIX)


def alive(slot: int) -> str:
    """Counter the slot's node agent bumps every heartbeat interval (``FENCE`` more once lost)."""
    return RING.alive(slot)


def claim(slot: int) -> str:
    """Sealed list whose first valid entry decides a slot's end, once: it left cleanly, or
    a watcher declared it lost. A slot found claimed by someone else was fenced off."""
    return RING.claim(slot)


def info(slot: int) -> str:
    """Sealed JSON about the slot: host, SLURM node name, supervisor pid, the node rank it holds."""
    return f"{PREFIX}info/{slot}"


def done(slot: int) -> str:
    """Sealed chain set when the slot's children all ended: a loss after that costs nothing."""
    return f"{PREFIX}done/{slot}"


def spare_taken(slot: int) -> str:
    """Sealed list whose first valid entry gives spare ``slot`` to one lost node rank."""
    return f"{PREFIX}spare_taken/{slot}"


def hold_store(slot: int) -> str:
    """Sealed chain for ``slot``: the lost slot that was next in line to host the job's store,
    written by the supervisor that declared it lost, when ``slot`` is next in line in its
    place; ``slot`` watches it and keeps a store ready from then on (``Failover.prepare``)."""
    return f"{PREFIX}hold_store/{slot}"


def assign(slot: int) -> str:
    """Sealed chain for spare ``slot``: JSON with the node rank it takes over and the lost
    slot, written by the supervisor that took the spare; the spare watches it."""
    return f"{PREFIX}assign/{slot}"


def step_times(slot: int) -> str:
    """Sealed JSON the slot's supervisor rewrites every ``step_times.PUBLISH_S`` while its ranks
    record steps: its node rank, host, and for each of its ranks whose window is full
    ``[steps recorded, median step time]``. Read by the supervisor that hosts the store."""
    return f"{PREFIX}steps/{slot}"


#: Sealed JSON the store's host writes when it asks nodes named stragglers to leave the job
#: (``--straggler-action exclude``, a spare free): ``{"exclude": [slots]}``. Every
#: supervisor reads it after publishing its step times; a slot listed leaves.
STRAGGLERS = PREFIX + "stragglers"
