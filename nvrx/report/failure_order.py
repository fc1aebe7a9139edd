"""The order of *Failures by signature*: by first occurrence, root causes before their
consequences.

A signature that is a round's cause (``RoundRow.cause``) is a root: it is placed at
its first occurrence. Any other signature seen in a round is placed right after the
root of the first round it was seen in, even when its clock says it came first (a
peer's ``PeerLost`` written a moment before the fault that caused it reached the
events); one seen in no round, at its own first occurrence. A follow-on fault
(``consequence``: a communication error about a peer, an abort by the Wrapper) is
never a root unless a round has no other cause.
"""

from __future__ import annotations

import math

from .consequence import FOLLOW_ON, fault_shape
from .model import Failure, ReportData


def is_follow_on(f: Failure) -> bool:
    """Whether ``f`` tells that another fault went first (``consequence.fault_shape``)."""
    return fault_shape(f.exc_type, f.message, f.signature) == FOLLOW_ON


def _time(value: float | None) -> float:
    return math.inf if value is None else value


def causes_first(r: ReportData) -> list[Failure]:
    """``r.failures`` in the order above."""
    by_signature = {f.signature: f for f in r.failures}
    roots: dict[str, float] = {}
    round_root: dict[int, float] = {}
    for row in sorted(r.timeline, key=lambda t: (t.run, t.round)):
        if row.cause is None:
            continue
        root = by_signature.get(row.cause)
        at = _time(root.first_wall if root is not None else row.start_wall)
        roots[row.cause] = min(roots.get(row.cause, math.inf), at)
        round_root.setdefault(row.round, at)

    def key(f: Failure) -> tuple[float, int, float]:
        own = _time(f.first_wall)
        if f.signature in roots:
            return roots[f.signature], 0, own
        anchors = [round_root[n] for n in f.rounds if n in round_root]
        return (min(anchors) if anchors else own), 1, own

    return sorted(r.failures, key=key)
