"""Store barriers that cost O(1) requests per rank and wait on the server.

An arrival is one ``add`` on a shared counter (plus a per-rank arrival key),
and the rank whose arrival completes the count sets a release key. Everyone
else blocks in one ``store.wait`` on that key, which the server answers when
the key appears: no client polls, no rank downloads the list of arrivals.
The per-rank arrival keys are read only when a barrier times out, to name the
ranks that never came.

A *reentrant* arrival is idempotent: a rank may be registered twice (by
itself and by its monitor process on its behalf) and still counts once. The
round protocol's barriers (``by_keys``) go further: their participants are the
ranks ``0..count-1``, and an arrival that brings the count to ``count`` or more
checks that each of their arrival keys is there (one ``check``); of those that
find it complete, the one whose token the closing key takes (a ``compare_set`` from
empty) releases; an arrival tried again with the same token (its connection broke after
it took the closing) finds the token its own and releases too.
So a host's agent may register all of its ranks at once (``arrive_group``: one
``multi_set`` and one ``add``; sealed, one entry of the barrier's group list and one
``add``), even ranks registered before: the count may run past ``count``, the arrivals decide.

**Sealed barriers** (``sealing`` given: the job's secret, under a supervisor): a client
without the secret could otherwise release a round early (a forged release key or a
forged ``add`` to the count) or keep a rank's arrival out (a forged arrival key written
ahead of it). So each arrival key holds a value sealed for it, with a nonce (a value that
does not unseal is overwritten; one that does is an arrival on record); the count only
says who looks: an arrival that brings it to ``count`` or more reads every participant's
arrival key (``range(count)``) and completes the barrier only when each one unseals or a
valid entry of the group list (``<name>/group``, a sealed list a host's agent appends its
ranks to) names that rank, and of those that find it complete, the one that takes the
closing key releases; it also reports the group list's forged entries. The release
is a *signal*: keys ``<name>/go``, ``<name>/go/g2``, ..., where the releaser puts a sealed
value into the first generation not set and a waiter that reads a value that does not
unseal waits on the next generation. A forged value passed over is reported (``Sealing``'s
``report``) by the one process whose own value took its place: the arrival that
overwrote it, the signaller that wrote the next generation (where that process has a
``report``: a rank's Wrapper does; a proxy in a monitor process, a node agent or a
supervisor only logs it). What stays open: a forged *negative* ``add`` to the count, or a
valid value overwritten after it was written (an arrival, the closing, a release), holds
the barrier until its timeout (a denial of service, as deleting keys is).

These functions take any object with torch's ``Store`` API (``set``, ``add``,
``wait``, ``check``; one that completes ``by_keys`` also ``compare_set`` (returning bytes); a
sealed barrier also ``get``, ``multi_get`` and ``append``),
with one exception: ``barrier`` runs a plain barrier
(neither reentrant nor with ``before_release``, and a timeout) as torch's
native ``Store.barrier``, called unbound (``Store.barrier(store, ...)``) so
that a store class that redefines ``barrier``
(``nvrx.inprocess.store.StoreMixin``) is not re-entered. That needs a real
``torch.distributed.Store``: a duck-typed store gets a ``TypeError`` there
(use ``arrive`` + ``wait``, or a reentrant barrier, with such a store).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from nvrx import processes

from . import errors
from .client import wait_span
from .seal import SealedList, Sealer, text_of
from .sealed_keys import MAX_GENERATIONS

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
        why = (
            f"{len(missing)} of {expected} participants missing, ranks {shown}{more}"
            if missing
            else f"all {expected} participants arrived, but the arrival that completed it did "
            "not release it in time (its process hung or ended, where no arrival after it "
            "could tell)"
        )
        super().__init__(f"barrier {name!r} timed out after {timeout:g} s: {why}")
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


@dataclass(frozen=True)
class Sealing:
    """How a sealed barrier's keys are sealed: the job's ``sealer``, the ``full_key`` a key
    of the store view has (a round's view adds the round's prefix: a seal binds to it), and
    who is told of a forged value this process passed over (its full key, its length)."""

    sealer: Sealer
    full_key: Callable[[str], str] = lambda key: key
    report: Callable[[str, int], None] | None = None

    def seal(self, key: str, payload: str) -> bytes:
        """``payload`` sealed for ``key`` of the view."""
        return self.sealer.seal(self.full_key(key), payload).encode()

    def valid(self, key: str, raw: bytes | str) -> bool:
        """Whether ``raw``, read at ``key`` of the view, unseals."""
        return self.sealer.unseal(self.full_key(key), text_of(raw)) is not None

    def entry(self, key: str, payload: str) -> bytes:
        """``payload`` as one entry of the sealed list at ``key`` of the view, to append."""
        return self.sealer.entry(self.full_key(key), payload).encode()

    def entries(self, key: str, raw: bytes | str) -> SealedList:
        """The sealed list ``raw`` read at ``key`` of the view."""
        return self.sealer.entries(self.full_key(key), text_of(raw))

    def passed_over(self, forged: list[tuple[str, int]]) -> None:
        """Report the forged values (key of the view, length) this process's value replaced."""
        for key, size in forged:
            log.warning("passed over a value with no valid seal at %s", self.full_key(key))
            if self.report is not None:
                self.report(self.full_key(key), size)


def _take(
    store: Any, key: str, sealing: Sealing, token: str | None = None
) -> tuple[bool, bytes]:
    """Put a sealed value of this process's own at ``key``: whether it stands there now (a
    forged one was overwritten, and reported), and the value that does (this one's, or
    another process's that unseals). ``token``: what makes the value this one's (a fresh
    one when None); a second try with the same token finds its own value and takes it
    again. ``BarrierError`` when forged values keep coming."""
    mine = sealing.seal(key, token or secrets.token_hex(8))
    expected: bytes = b""
    forged: list[tuple[str, int]] = []
    for _ in range(MAX_GENERATIONS):
        held = bytes(store.compare_set(key, expected, mine))
        if held == mine:
            sealing.passed_over(forged)
            return True, held
        if sealing.valid(key, held):
            return False, held
        if held != expected:
            forged.append((key, len(held)))
        # torch answers a compare_set on a key deleted meanwhile with the value expected
        expected = held if store.check([key]) else b""
    raise BarrierError(f"could not write {sealing.full_key(key)}: forged values keep replacing it")


def signal_key(key: str, generation: int) -> str:
    """Generation ``generation`` (from 1) of the signal at ``key``: ``key``, ``key/g2``, ..."""
    return key if generation == 1 else f"{key}/g{generation}"


def signal(store: Any, key: str, sealing: Sealing | None, what: str = "1") -> None:
    """Raise the one-time signal at ``key`` (a barrier's release, a wake-up): set it without
    ``sealing``; with it, a sealed value in the first generation not set, unless one that
    unseals stands before it (raised already)."""
    if sealing is None:
        store.set(key, what)
        return
    forged: list[tuple[str, int]] = []
    for generation in range(1, MAX_GENERATIONS + 1):
        at = signal_key(key, generation)
        mine = sealing.seal(at, f"{what}:{secrets.token_hex(8)}")
        held = bytes(store.compare_set(at, "", mine))
        # a ``set`` wakes waiters on every server: torch's legacy backend answers a
        # ``compare_set`` without waking any (the key never changes once set)
        store.set(at, held)
        if held == mine:
            sealing.passed_over(forged)
            return
        if sealing.valid(at, held):
            return
        forged.append((at, len(held)))
    log.error("could not raise %s: every generation holds a forged value", key)


def raised(store: Any, key: str, sealing: Sealing | None) -> bool:
    """Whether the signal at ``key`` was raised (a generation that unseals, with ``sealing``)."""
    for generation in range(1, MAX_GENERATIONS + 1):
        at = signal_key(key, generation)
        if not store.check([at]):
            return False
        if sealing is None or sealing.valid(at, store.get(at)):
            return True
    return False


def await_signal(
    store: Any, key: str, timeout: float, sealing: Sealing | None, chunk: float | None = None
) -> bool:
    """Wait up to ``timeout`` seconds for the signal at ``key``; False when it did not come.
    ``chunk`` splits the wait as ``wait`` says."""
    deadline = time.monotonic() + timeout
    step = timeout if chunk is None or chunk <= 0 else min(chunk, timeout)
    generation = 1
    while generation <= MAX_GENERATIONS:
        at = signal_key(key, generation)
        try:
            store.wait([at], wait_span(min(step, deadline - time.monotonic())))
        except errors.timeouts():
            if chunk is None or time.monotonic() >= deadline:
                return False
            continue
        if sealing is None or sealing.valid(at, store.get(at)):
            return True
        log.warning("a signal with no valid seal at %s: waiting on", sealing.full_key(at))
        generation += 1
    return False


def _count_key(name: str) -> str:
    return f"{name}/n"


def _arrival_key(name: str, rank: int) -> str:
    return f"{name}/a/{rank}"


def release_key(name: str) -> str:
    """Key set when barrier ``name`` completes (the first generation of its signal)."""
    return f"{name}/go"


def _closing_key(name: str) -> str:
    return f"{name}/closing"


def closer_token() -> str:
    """A fresh token for an arrival at the closing of a barrier, naming its process
    (``processes.identity``): an arrival of the same host that finds the closing held by a
    process that ended meanwhile takes it over (``_take_closing``)."""
    return f"{secrets.token_hex(8)}@{processes.identity() or ''}"


def _take_closing(
    store: Any, name: str, token: str, sealing: Sealing | None
) -> Literal["taken", "taken over", "held"]:
    """Take barrier ``name``'s closing for ``token``: ``taken`` (from empty, or found its own:
    a try again), ``taken over`` from a closer that ended before it released (a process of
    this host: ``processes.gone``), or ``held`` by another arrival (or by a closer that
    ended after it released: its release is raised again, to wake waiters the store's
    ``compare_set`` did not)."""
    key = _closing_key(name)
    if sealing is None:
        held = bytes(store.compare_set(key, "", token))
        if held == token.encode():
            return "taken"
        holder, mine = held.decode(errors="replace"), token.encode()
    else:
        taken, held = _take(store, key, sealing, token)
        if taken:
            return "taken"
        mine = sealing.seal(key, token)
        holder = sealing.sealer.unseal(sealing.full_key(key), text_of(held)) or ""
    _, at, identity = holder.partition("@")
    if not at or not processes.gone(identity):
        return "held"
    if raised(store, release_key(name), sealing):
        signal(store, release_key(name), sealing)
        return "held"
    if bytes(store.compare_set(key, held, mine)) != mine:
        return "held"  # another arrival took it over first
    log.warning("barrier %s: the arrival that took its closing ended before it released; "
                "this one closes it", name)  # fmt: skip
    return "taken over"


def _group_key(name: str) -> str:
    return f"{name}/group"


def arrive(
    store: Any,
    name: str,
    rank: int,
    count: int,
    *,
    reentrant: bool = False,
    before_release: Callable[[], None] | None = None,
    sealing: Sealing | None = None,
    by_keys: bool = False,
) -> bool:
    """Register ``rank`` at barrier ``name`` of ``count`` participants; True if it completed it.

    ``before_release`` runs on the completing arrival only, before the release
    key is set, so what it writes is visible to every rank that is released.
    With ``sealing`` the barrier is sealed (see above): every arrival is reentrant.
    ``by_keys`` (reentrant): the participants are the ranks ``0..count-1`` and the
    barrier completes by their keys, so that group arrivals (``arrive_group``) may
    meet it too; without it a reentrant barrier of any rank ids completes at the
    ``count``-th distinct rank (``BarrierOverflow`` past it).
    """
    if count < 1:
        raise ValueError(f"barrier {name!r}: count must be >= 1, got {count}")
    if by_keys and not reentrant:
        raise ValueError(f"barrier {name!r}: only a reentrant barrier completes by its keys")
    if sealing is not None:
        return _arrive_sealed(store, name, rank, count, before_release, sealing)
    if reentrant:
        first = int(store.add(_arrival_key(name, rank), 1)) == 1
        if by_keys:  # counted again all the same: a group arrival may have ended before its add
            return _count_and_close(store, name, count, 1, before_release, None)
        if not first:
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


def _arrive_sealed(
    store: Any,
    name: str,
    rank: int,
    count: int,
    before_release: Callable[[], None] | None,
    sealing: Sealing,
) -> bool:
    # registered before (by itself, a proxy, a group) or now: counted all the same, as a
    # group arrival may have ended between its keys and its count
    _take(store, _arrival_key(name, rank), sealing)
    return _count_and_close(store, name, count, 1, before_release, sealing)


def arrive_group(
    store: Any,
    name: str,
    ranks: Iterable[int],
    count: int,
    *,
    before_release: Callable[[], None] | None = None,
    sealing: Sealing | None = None,
    closer: str | None = None,
    again: bool = False,
) -> bool:
    """Register ``ranks`` at barrier ``name`` of ``count`` participants, met ``by_keys``, as
    one arrival (a host's agent for the host's ranks); True if it completed the barrier
    (``before_release`` ran, the release is raised). ``closer``: this arrival's token at
    the closing, the same for each try of one arrival; ``again``: a try after the first
    (``_count_and_close``).

    One write whatever the number of ranks, and one ``add`` that raises the count
    by their number (a rank registered before, by itself or a proxy, is counted again: the
    count only says who looks, the arrivals decide). Unsealed, the arrival keys in one
    ``multi_set``. Sealed, one entry naming the ranks appended to the barrier's group list
    (an append overwrites nothing: a forged entry there stands beside the real ones and
    counts for nothing); the ranks' own arrival keys are not written, so a forged value
    there is neither read nor reported for a rank the group names."""
    if count < 1:
        raise ValueError(f"barrier {name!r}: count must be >= 1, got {count}")
    ranks = sorted(set(ranks))
    if not ranks:
        return False
    if sealing is None:
        store.multi_set([_arrival_key(name, r) for r in ranks], ["1"] * len(ranks))
    else:
        listed = ",".join(map(str, ranks))
        store.append(_group_key(name), sealing.entry(_group_key(name), f"{listed}:{secrets.token_hex(8)}"))
    return _count_and_close(store, name, count, len(ranks), before_release, sealing, closer, again)


def _count_and_close(
    store: Any,
    name: str,
    count: int,
    arrivals: int,
    before_release: Callable[[], None] | None,
    sealing: Sealing | None,
    closer: str | None = None,
    again: bool = False,
) -> bool:
    """``arrivals`` registered: count them, and release the barrier if it is complete and no
    other arrival that found it complete took the closing first; True when this one did.

    Every arrival writes its keys before it counts, so the arrival whose ``add`` comes last
    finds every key written: the barrier completes whatever the count says beyond that.
    The closing holds the closer's token (``closer``, a fresh one when None): an arrival
    tried again with the same token after its connection broke, even once it took the
    closing, finds the closing its own and releases the barrier itself: it runs
    ``before_release`` again (which must bear that: the round protocol's count a restart
    once and write the same values again), unless the release is raised already (one
    request more, made only by a try ``again``). So does an arrival that finds the closing
    held by a process of this host that ended before it released (a host's agent killed
    while it closed the barrier for its ranks: they arrive themselves, or through the
    agent that replaces it): it takes the closing over (``_take_closing``)."""
    if int(store.add(_count_key(name), arrivals)) < count:
        return False
    complete, forged = _all_arrived(store, name, count, sealing)
    if not complete:
        return False
    took = _take_closing(store, name, closer or closer_token(), sealing)
    if took == "held":
        return False  # another arrival found it complete too, and releases
    if sealing is not None:
        sealing.passed_over(forged)  # the group list's forged entries, by the one that closed
    # released by a try before this one (its answer was lost), or by a write of the closer
    # taken over from that reached the store only now
    if (again or took == "taken over") and raised(store, release_key(name), sealing):
        return True
    if before_release is not None:
        before_release()
    signal(store, release_key(name), sealing)
    return True


def _all_arrived(
    store: Any, name: str, count: int, sealing: Sealing | None
) -> tuple[bool, list[tuple[str, int]]]:
    """Whether every participant arrived: its arrival key is there, and with ``sealing``
    holds a value that unseals or an entry of the group list that unseals names it (a count
    reached by forged ``add``s is not a barrier complete); and the group list's forged
    entries (its key, their length)."""
    listed, forged = _listed(store, name, sealing)
    keys = [_arrival_key(name, r) for r in range(count) if r not in listed]
    if keys and not store.check(keys):
        return False, forged
    if sealing is None or not keys:
        return True, forged
    raws = store.multi_get(keys)
    return all(sealing.valid(key, raw) for key, raw in zip(keys, raws, strict=True)), forged


def _listed(
    store: Any, name: str, sealing: Sealing | None
) -> tuple[set[int], list[tuple[str, int]]]:
    """The ranks the group list's valid entries name, and its forged entries (none
    without ``sealing``: an unsealed group writes the arrival keys)."""
    key = _group_key(name)
    if sealing is None or not store.check([key]):
        return set(), []
    entries = sealing.entries(key, store.get(key))
    named = (r for payload in entries.valid for r in payload.partition(":")[0].split(","))
    ranks = {int(r) for r in named if r.isdigit()}
    return ranks, [(key, entries.invalid_bytes)] if entries.invalid else []


def has_arrived(store: Any, name: str, rank: int, sealing: Sealing | None = None) -> bool:
    """Whether ``rank`` is registered at barrier ``name``."""
    return _key_arrived(store, name, rank, sealing) or rank in _listed(store, name, sealing)[0]


def _key_arrived(store: Any, name: str, rank: int, sealing: Sealing | None) -> bool:
    key = _arrival_key(name, rank)
    if not store.check([key]):
        return False
    return sealing is None or sealing.valid(key, store.get(key))


def is_released(store: Any, name: str, sealing: Sealing | None = None) -> bool:
    """Whether barrier ``name`` has completed."""
    return raised(store, release_key(name), sealing)


def missing_ranks(
    store: Any, name: str, participants: Iterable[int], sealing: Sealing | None = None
) -> list[int]:
    """Participants not registered at barrier ``name`` (a request or two each, and the
    group list read once when sealed: timeout path only)."""
    listed = _listed(store, name, sealing)[0]
    return [r for r in participants if r not in listed and not _key_arrived(store, name, r, sealing)]


def wait(
    store: Any,
    name: str,
    count: int,
    timeout: float,
    participants: Iterable[int] | None = None,
    *,
    chunk: float | None = None,
    sealing: Sealing | None = None,
) -> None:
    """Block until barrier ``name`` completes; ``BarrierTimeout`` after ``timeout`` seconds.

    ``chunk`` (seconds) splits the wait into server-answered waits of at most
    that long, so that the calling thread is back in Python between them and
    its signal handlers run (a ``KeyboardInterrupt``, the Wrapper's restart);
    None waits in one piece. ``sealing``: a sealed barrier (a release that does
    not unseal is waited past). ``participants`` name the missing ranks on a
    timeout (default ``range(count)``, the only participants of a barrier met
    ``by_keys`` or sealed).
    """
    if timeout <= NO_WAIT:
        return
    if await_signal(store, release_key(name), timeout, sealing, chunk):
        return
    expected = list(participants) if participants is not None else list(range(count))
    raise BarrierTimeout(name, count, missing_ranks(store, name, expected, sealing), timeout)


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
