"""The start of a process generation: the initial barrier and what its last arrival opens.

A generation is every process of the job started anew (the job's start, a
restart of all processes, a store failover). Its processes meet at one
barrier; the arrival that completes it opens the generation before anyone is
released: torch's rendezvous keys of earlier rounds are deleted, the job
restart is counted, the ranks gone at that moment are recorded (every rank's
first rank assignment leaves exactly those out) and the generation's first
round is published.

Ranks marked gone (``gone_ranks``) never come, so someone arrives for them:
every rank of the generation for the ones gone when it starts, and the
supervisor that marks a rank gone for the generation that is opening (or the
next one), so a node lost while the others wait does not hold the barrier
until its timeout. Any arrival may be the completing one, so each carries
the same opening.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from . import barrier, gone_ranks, keys, rounds
from .client import delete_prefix

log = logging.getLogger(__name__)


def initial_barrier(generation: int) -> str:
    """Name of the initial barrier of ``generation`` (its first round's number)."""
    return f"{keys.ROOT}g{generation}/initial"


def _gone_record(generation: int) -> str:
    return f"{keys.ROOT}g{generation}/gone"


def clear_torch_keys(store: Any) -> int:
    """Delete torch's rendezvous keys left by an earlier round."""
    try:
        return delete_prefix(store, keys.TORCH_DEFAULT_PG_PREFIX)
    except Exception as exc:  # a custom store without list_keys: keys stay, torch re-sets them
        log.debug("could not clear torch rendezvous keys: %r", exc)
        return 0


def gone_in(store: Any, world_size: int) -> set[int]:
    """The initial ranks below ``world_size`` marked gone so far."""
    return {r for r in gone_ranks.all_gone(store) if 0 <= r < world_size}


def _open(store: Any, generation: int, world_size: int) -> None:
    clear_torch_keys(store)
    if generation > 0:
        rounds.count_job_restart(store)
    store.set(_gone_record(generation), json.dumps(sorted(gone_in(store, world_size))))
    rounds.publish_round(store, generation)


def arrive(store: Any, generation: int, rank: int, world_size: int) -> bool:
    """Register ``rank`` (its own arrival, or one for a rank that will not come) at the
    initial barrier of ``generation``; True when it completed and opened the generation."""
    return barrier.arrive(
        store,
        initial_barrier(generation),
        rank,
        world_size,
        reentrant=True,
        before_release=lambda: _open(store, generation, world_size),
    )


def arrive_for_gone(
    store: Any, generation: int, world_size: int, ranks: Iterable[int] | None = None
) -> None:
    """Arrive for ``ranks`` (default: every rank marked gone) at ``generation``'s initial barrier."""
    for rank in sorted(gone_in(store, world_size) if ranks is None else ranks):
        if 0 <= rank < world_size:
            arrive(store, generation, rank, world_size)


def of_round(store: Any, round_: int) -> int:
    """The generation ``round_`` belongs to (its first round), as opened in ``store``.

    Generations start at multiples of ``GENERATION_STEP`` but may run more rounds than
    that: the next one starts above the last round published. So it is the highest
    multiple at or below ``round_`` that opened in this store (none for a round restored
    after a store failover: then the multiple at or below it, whose record is missing).
    """
    step = rounds.GENERATION_STEP
    first = round_ - round_ % step
    generation = first
    while generation >= 0:
        if store.check([_gone_record(generation)]):
            return generation
        generation -= step
    return first


def gone_at_start(store: Any, generation: int) -> set[int]:
    """The ranks that were gone when ``generation`` opened; empty when it did not open in
    this store (a round restored after a store failover)."""
    if not store.check([_gone_record(generation)]):
        return set()
    return {int(r) for r in json.loads(store.get(_gone_record(generation)))}
