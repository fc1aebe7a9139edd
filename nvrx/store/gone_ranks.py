"""Ranks that will not come back: their node was lost and no spare node took it over.

The supervisor that declares the node lost marks them. Two readers need them:
survivors deciding whose replacement to wait for (``rejoin``: one look at one
rank's flag), and every rank of a new process generation, which meets its
peers without them (one read of the whole list, not one request per rank).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import keys, rank_lists


def mark(store: Any, initial_ranks: Iterable[int]) -> None:
    """Record that ``initial_ranks`` are gone for the rest of this run of the job."""
    for rank in initial_ranks:
        store.set(keys.rank_gone(rank), "1")
        rank_lists.add(store, keys.GONE_LIST, rank)


def is_gone(store: Any, initial_rank: int) -> bool:
    """Whether ``initial_rank`` was marked gone."""
    return bool(store.check([keys.rank_gone(initial_rank)]))


def all_gone(store: Any) -> set[int]:
    """Every initial rank marked gone so far."""
    return rank_lists.read(store, keys.GONE_LIST)
