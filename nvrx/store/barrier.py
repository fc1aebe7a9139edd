"""Store barriers that cost O(1) requests per rank and wait on the server.

An arrival is one ``add`` on a shared counter (plus a per-rank arrival key),
and the rank whose arrival completes the count sets a release key. Everyone
else blocks in one ``store.wait`` on that key, which the server answers when
the key appears: no client polls, no rank downloads the list of arrivals.
The per-rank arrival keys are read only when a barrier times out, to name the
ranks that never came.

A *reentrant* arrival is idempotent: a rank may be registered twice (by
itself and by its monitor process on its behalf) and still counts once.

These functions take any object with torch's ``Store`` API (``set``, ``add``,
``wait``, ``check``), with one exception: ``barrier`` runs a plain barrier
(neither reentrant nor with ``before_release``, and a timeout) as torch's
native ``Store.barrier``, called unbound (``Store.barrier(store, ...)``) so
that a store class that redefines ``barrier``
(``nvrx.inprocess.store.StoreMixin``) is not re-entered. That needs a real
``torch.distributed.Store``: a duck-typed store gets a ``TypeError`` there
(use ``arrive`` + ``wait``, or a reentrant barrier, with such a store).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from . import errors

log = logging.getLogger(__name__)

#: ``timeout`` value meaning "register the arrival, do not wait".
NO_WAIT = 0.0


class BarrierError(RuntimeError):
    """A barrier could not complete."""


class BarrierTimeout(BarrierError):
    """Not every participant arrived within the timeout; ``missing`` names who did not."""

    def __init__(self, name: str, expected: int, missing: list[int], timeout: float) -> None:
        shown = missing[:32]
        more = f" and {len(missing) - len(shown)} more" if len(missing) > len(shown) else ""
        super().__init__(
            f"barrier {name!r} timed out after {timeout:g} s: {len(missing)} of {expected} "
            f"participants missing, ranks {shown}{more}"
        )
        self.name = name
        self.expected = expected
        self.missing = missing
        self.timeout = timeout


class BarrierOverflow(BarrierError):
    """More arrivals than participants: a rank arrived twice at a non-reentrant barrier."""

    def __init__(self, name: str, expected: int, count: int, rank: int) -> None:
        super().__init__(
            f"barrier {name!r} overflowed: arrival {count} of expected {expected} "
            f"(rank {rank}); use a reentrant barrier where a rank may arrive twice"
        )
        self.name = name
        self.expected = expected
        self.count = count


def _count_key(name: str) -> str:
    return f"{name}/n"


def _arrival_key(name: str, rank: int) -> str:
    return f"{name}/a/{rank}"


def release_key(name: str) -> str:
    """Key set when barrier ``name`` completes."""
    return f"{name}/go"


def arrive(
    store: Any,
    name: str,
    rank: int,
    count: int,
    *,
    reentrant: bool = False,
    before_release: Callable[[], None] | None = None,
) -> bool:
    """Register ``rank`` at barrier ``name`` of ``count`` participants; True if it completed it.

    ``before_release`` runs on the completing arrival only, before the release
    key is set, so what it writes is visible to every rank that is released.
    """
    if count < 1:
        raise ValueError(f"barrier {name!r}: count must be >= 1, got {count}")
    if reentrant:
        if int(store.add(_arrival_key(name, rank), 1)) != 1:
            return False  # already registered (by itself or by proxy)
    else:
        store.set(_arrival_key(name, rank), "1")
    arrived = int(store.add(_count_key(name), 1))
    if arrived > count:
        raise BarrierOverflow(name, count, arrived, rank)
    if arrived == count:
        if before_release is not None:
            before_release()
        store.set(release_key(name), "1")
        return True
    return False


def has_arrived(store: Any, name: str, rank: int) -> bool:
    """Whether ``rank`` is registered at barrier ``name``."""
    return bool(store.check([_arrival_key(name, rank)]))


def is_released(store: Any, name: str) -> bool:
    """Whether barrier ``name`` has completed."""
    return bool(store.check([release_key(name)]))


def missing_ranks(store: Any, name: str, participants: Iterable[int]) -> list[int]:
    """Participants not registered at barrier ``name`` (one request each: timeout path only)."""
    return [r for r in participants if not has_arrived(store, name, r)]


def wait(
    store: Any,
    name: str,
    count: int,
    timeout: float,
    participants: Iterable[int] | None = None,
    *,
    chunk: float | None = None,
) -> None:
    """Block until barrier ``name`` completes; ``BarrierTimeout`` after ``timeout`` seconds.

    ``chunk`` (seconds) splits the wait into server-answered waits of at most
    that long, so that the calling thread is back in Python between them and
    its signal handlers run (a ``KeyboardInterrupt``, the Wrapper's restart);
    None waits in one piece.
    """
    if timeout <= NO_WAIT:
        return
    deadline = time.monotonic() + timeout
    step = timeout if chunk is None or chunk <= 0 else min(chunk, timeout)
    while True:
        left = max(min(step, deadline - time.monotonic()), 0.001)
        try:
            store.wait([release_key(name)], timedelta(seconds=left))
            return
        except errors.timeouts():
            if chunk is None or time.monotonic() >= deadline:
                break
    expected = list(participants) if participants is not None else list(range(count))
    raise BarrierTimeout(name, count, missing_ranks(store, name, expected), timeout)


def barrier(
    store: Any,
    name: str,
    rank: int,
    count: int,
    timeout: float,
    *,
    reentrant: bool = False,
    participants: Iterable[int] | None = None,
    before_release: Callable[[], None] | None = None,
) -> None:
    """Arrive at barrier ``name`` and wait for all ``count`` participants.

    ``participants`` (the rank ids expected, default ``range(count)``) is only
    used to name the missing ranks when the barrier times out.

    A plain barrier (not reentrant, no ``before_release``) runs as torch's
    native ``Store.barrier`` (the same add-then-wait in one C++ call, which
    releases the GIL once instead of per request) after a fire-and-forget
    arrival key, so ``store`` must be a ``torch.distributed.Store`` there
    (``TypeError`` otherwise: a ``wire.WireStore`` or a ``rounds.RoundView`` is not one);
    the others use ``arrive`` + ``wait``.
    """
    if reentrant or before_release is not None or timeout <= NO_WAIT:
        arrive(store, name, rank, count, reentrant=reentrant, before_release=before_release)
        wait(store, name, count, timeout, participants)
        return
    from torch.distributed import DistNetworkError, DistStoreError, Store

    if count < 1:
        raise ValueError(f"barrier {name!r}: count must be >= 1, got {count}")
    store.set(_arrival_key(name, rank), "1")
    try:
        Store.barrier(store, f"{name}/native", count, timedelta(seconds=timeout))
    except DistNetworkError:
        raise
    except DistStoreError:
        expected = list(participants) if participants is not None else list(range(count))
        raise BarrierTimeout(name, count, missing_ranks(store, name, expected), timeout) from None
