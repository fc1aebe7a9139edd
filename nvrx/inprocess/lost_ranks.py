"""Ranks leave the Wrapper's running round on another party's word, so that their peers stop waiting.

The ranks of a lost node (``leave_round``), and a rank whose monitor stopped
beating to its supervisor (``leave_silent``: ``rank_beats``): run in the store
agent (it holds the store client) by the supervisor that found it. Without
a supervisor, the monitor that leads a host's heartbeats (``host_beats``)
takes out the silent ranks of its host, and those of a silent host.

Nobody is left to record the fault, so the declarer does what a dead rank's
monitor process would have done: it
records a ``node_lost`` fault, registers the rank as terminated, interrupts
the round and arrives at the iteration barrier for it. A rank that no spare
will replace is marked gone, so the survivors do not wait for a replacement,
and the declarer arrives for it at the initial barrier of the process
generation that opens next (``nvrx.store.generations``).
Jobs that do not run the Wrapper have no round: there is nothing to do.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from nvrx.store import faults, generations, gone_ranks, keys, rounds
from nvrx.store.barrier import BarrierOverflow

log = logging.getLogger(__name__)


def _round_ranks(
    round_store: Any, initial_ranks: set[int], initial_world_size: int, published: bool = False
) -> list[tuple[int, int, int]]:
    """(rank in the round, world size of the round, initial rank) of each of ``initial_ranks``
    in the round; ``published``: only of those whose state there names them."""
    found: dict[int, tuple[int, int]] = {}
    world_size = initial_world_size
    for rank in range(initial_world_size):
        if not round_store.check([keys.rank_state(rank)]):
            continue
        state = json.loads(round_store.get(keys.rank_state(rank)))
        world_size = int(state.get("world_size", world_size))
        if int(state.get("initial_rank", -1)) in initial_ranks:
            found[int(state["initial_rank"])] = (rank, world_size)
    # a rank that has not written its state yet still has its initial rank
    for initial in () if published else initial_ranks - set(found):
        if initial < world_size:
            found[initial] = (initial, world_size)
    return sorted((rank, ws, initial) for initial, (rank, ws) in found.items())


def _arrive_for_gone(base: Any, initial_ranks: list[int], world_size: int) -> None:
    """Arrive for the gone ranks at the initial barrier of the generation that opens next
    (or is opening now), so the others do not wait there for them."""
    generation = rounds.generation_base(base)
    try:
        generations.arrive_for_gone(base, generation, world_size, initial_ranks)
    except BarrierOverflow:  # it opened with them between the two reads: the round takes them out
        log.info("generation %d opened before ranks %s were marked gone", generation, initial_ranks)


def leave_round(
    base: Any,
    initial_ranks: list[int],
    initial_world_size: int,
    message: str,
    gone: bool,
    kind: str = "node_lost",
    published: bool = False,
    on_left: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Take ``initial_ranks`` out of the running round (a fault record of ``kind``); what was
    done: the round, the ranks there that left it now, and ``out``, the initial ranks out of
    it now (left now or before). ``published``: only those whose state in the round names
    them (not a rank that waits to be admitted, whose number there is another's).
    ``on_left``: called with each rank there as soon as it left (the rest may fail)."""
    if gone:
        gone_ranks.mark(base, initial_ranks)
        _arrive_for_gone(base, initial_ranks, initial_world_size)
    round_ = rounds.current_round(base)
    if round_ is None:
        return {"round": None, "ranks": [], "out": []}
    # ranks left out when the round's generation opened are not in the round
    in_round = set(initial_ranks) - generations.gone_at_start(base, generations.of_round(base, round_))
    round_store = rounds.round_store(base, round_)
    left, out = [], []
    for rank, world_size, initial in _round_ranks(
        round_store, in_round, initial_world_size, published
    ):
        out.append(initial)
        if rank in rounds.terminated_ranks(round_store):
            continue  # its own monitor, or an earlier declaration, already took it out
        record = faults.FaultRecord(rank=rank, kind=kind, message=message)
        rounds.proxy_leave(round_store, base, rank, world_size, record)
        left.append(rank)
        if on_left is not None:
            on_left(rank)
    log.info("ranks %s of round %s left it: %s", left, round_, message)
    return {"round": round_, "ranks": left, "out": sorted(out)}


def leave_silent(base: Any, initial_rank: int, initial_world_size: int, message: str) -> bool:
    """Take the rank of ``initial_rank`` out of the running round as ``unresponsive``, as a
    peer's monitor does without a supervisor; False when it was out already. The round is
    the job's current one, not the last one the silent monitor told of: the rank may have
    moved on just before its monitor froze. A rank not in that round (one waiting to be
    admitted) is left alone: its initial rank may be another process's rank there."""
    left = leave_round(
        base, [initial_rank], initial_world_size, message, False, "unresponsive", published=True
    )
    return bool(left["ranks"])
