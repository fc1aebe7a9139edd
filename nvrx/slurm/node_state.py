"""Whether SLURM sees a node responding: the one rule for "the node itself failed".

A supervisor that falls silent is declared lost by its peers, but its node may be fine:
a killed supervisor leaves ``slurmd`` answering, and SLURM's view of the node says so.
The supervisor asks before it requeues a job without the node, and ``nvrx-report``
asks the same of the state recorded in ``node_lost`` before it advises excluding it.

``scontrol show node`` writes the state as a base state with ``+FLAG`` suffixes
(``MIXED``, ``IDLE+NOT_RESPONDING``, ``DOWN+DRAIN``); ``sinfo`` marks a node that does
not respond with a ``*`` suffix (``down*``). Both forms are read.
"""

from __future__ import annotations

import enum

#: Base states and flags that say the node itself is not answering or has failed.
FAILED_PARTS = frozenset({"DOWN", "FAIL", "FAILING", "NOT_RESPONDING", "NO_RESPOND", "UNKNOWN"})


class NodeHealth(enum.StrEnum):
    """SLURM's word on a node, as far as excluding it goes."""

    RESPONDING = "responding"  # slurmd answers: whatever was lost, the node is not to blame
    FAILED = "failed"  # down, failed or not responding: evidence against the node
    UNKNOWN = "unknown"  # no state could be had (no SLURM, or SLURM did not answer)


def node_health(state: str | None) -> NodeHealth:
    """What SLURM's ``State`` of a node (``scontrol`` or ``sinfo`` form) says of it."""
    if not state or not state.strip():
        return NodeHealth.UNKNOWN
    text = state.strip().upper()
    if text.endswith("*"):
        return NodeHealth.FAILED
    parts = {part.strip() for part in text.replace("*", "").split("+")}
    return NodeHealth.FAILED if parts & FAILED_PARTS else NodeHealth.RESPONDING
