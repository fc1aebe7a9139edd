"""Store keys of node liveness and node roles, shared by the supervisor and its store agent.

A *slot* is the place a supervisor started in (``SLURM_PROCID``, or
``--node-rank`` without SLURM); it never changes. A *node rank* is the place
in training a slot holds: slot ``s`` holds node rank ``s`` when ``s`` is below
the active node count, else it starts as a spare and may take over the node
rank of a lost slot. One liveness key per slot: store load grows with nodes,
never with ranks.

A slot's end is decided once, by its *claim*: a sealed list (``nvrx.store.seal``) to which
the slot itself appends when it leaves cleanly, and a supervisor that found it silent
when it declares it lost; the first entry that unseals wins (``nvrx.store.sealed_keys``;
``claims`` reads one). An entry a client without the job's secret appended is skipped: it neither
ends a healthy slot nor keeps a lost one from being declared. Whoever declared the slot
lost then adds ``FENCE`` to its ``alive`` counter; the slot's next beat shows it, and the
slot reads its claim to learn whether a valid declaration stands behind it.
"""

from __future__ import annotations

from nvrx.store.seal import SealedList, Sealer

from .config import KEY_PREFIX

PREFIX = KEY_PREFIX + "node/"
#: Sealed count: node ranks lost with no spare to take them over (the job shrank by as many).
SHRUNK = PREFIX + "shrunk"


#: Added to a slot's ``alive`` counter by whoever declared it lost, right after taking its
#: ``claim``: the slot's own next beat (an ``add`` that returns the counter) then shows it
#: was fenced off, with no request of its own. Far above any count of beats.
FENCE = 1 << 40


def alive(slot: int) -> str:
    """Counter the slot's store agent bumps every heartbeat interval (``FENCE`` once lost)."""
    return f"{PREFIX}alive/{slot}"


def claim(slot: int) -> str:
    """Sealed list whose first valid entry decides a slot's end, once: it left cleanly, or
    a watcher declared it lost. A slot found claimed by someone else was fenced off."""
    return f"{PREFIX}claim/{slot}"


def claims(sealer: Sealer, slot: int, value: str | None) -> SealedList:
    """The claim of ``slot`` as read (``value``; None: not set): its entries that unseal,
    the first deciding, and the fragments that do not."""
    return sealer.entries(claim(slot), value)


def info(slot: int) -> str:
    """Sealed JSON about the slot: host, SLURM node name, supervisor pid, the node rank it holds."""
    return f"{PREFIX}info/{slot}"


def done(slot: int) -> str:
    """Sealed chain set when the slot's children all ended: a loss after that costs nothing."""
    return f"{PREFIX}done/{slot}"


def spare_taken(slot: int) -> str:
    """Sealed list whose first valid entry gives spare ``slot`` to one lost node rank."""
    return f"{PREFIX}spare_taken/{slot}"


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
