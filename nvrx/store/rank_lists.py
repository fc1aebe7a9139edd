"""Append-only lists of ranks in the store: ``"r,"`` per entry, read back whole in one request.

Adding a rank is one ``append``, however many parties add at once; a reader gets
the whole list with one ``get`` (the gone ranks, a host's ranks and those of its
monitors that ended: ``rounds.all_gone``, ``host_ring``).
"""

from __future__ import annotations

from typing import Any


def add(store: Any, key: str, rank: int) -> None:
    """Add ``rank`` to the list at ``key``."""
    store.append(key, f"{int(rank)},")


def read(store: Any, key: str) -> set[int]:
    """Every rank in the list at ``key`` (none while it does not exist)."""
    if not store.check([key]):
        return set()
    raw = store.get(key)
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return {int(part) for part in text.split(",") if part.strip().isdigit()}
