"""Ranks that will not come back: their node was lost and no spare node took it over.

The supervisor that declares the node lost marks them. Two readers need them:
survivors deciding whose replacement to wait for (``rejoin``: one look at one
rank's flag), and every rank of a new process generation, which meets its
peers without them (one read of the whole list, not one request per rank).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import keys


def mark(store: Any, initial_ranks: Iterable[int]) -> None:
    """Record that ``initial_ranks`` are gone for the rest of this run of the job."""
    for rank in initial_ranks:
        store.set(keys.rank_gone(rank), "1")
        store.append(keys.GONE_LIST, f"{int(rank)},")


def is_gone(store: Any, initial_rank: int) -> bool:
    """Whether ``initial_rank`` was marked gone."""
    return bool(store.check([keys.rank_gone(initial_rank)]))


def all_gone(store: Any) -> set[int]:
    """Every initial rank marked gone so far."""
    if not store.check([keys.GONE_LIST]):
        return set()
    raw = store.get(keys.GONE_LIST)
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return {int(part) for part in text.split(",") if part.strip().isdigit()}
