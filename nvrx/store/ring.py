"""The ring of liveness: each party beats in the store and watches the next party's beat.

The parties are a job's nodes (each supervisor's node agent, ``nvrx.node_agent.supervised``:
*slots*, with the job's secret) or, without a supervisor, its hosts (each host's node agent,
``nvrx.node_agent.host``, no secret). Each party has two keys under its ring's prefix
(``RingKeys``); who writes what, in which order:

1. ``alive/<slot>``, a counter: the party adds 1 every interval (its *beat*) and reads the
   counter of the next party in the ring that has not ended (its *target*): each party is
   watched by exactly one other, and the load is two requests per party per interval.
2. ``claim/<slot>``, a list whose first valid entry decides the party's end, once: the
   party appends to it when it leaves cleanly, a watcher that found it silent when it
   declares it lost (``declare_lost``). Entries are sealed with the job's secret where
   there is one (an entry that does not unseal is skipped: it neither ends a healthy party
   nor keeps a lost one from being declared), plain without one.
3. ``alive/<slot>`` again, ``+ FENCE``: whoever declared the party lost, right after its
   claim. The party's own next beat (an ``add`` that returns the counter) shows it, and it
   reads its claim to learn whether a valid declaration stands behind it: it was *fenced
   off* (a frozen node that thawed: the job has moved on without it).

A watcher reads the claims only when they can have changed something: its target's
counter stood still (the ring then moves past a target that ended); its own first beat (a
store that failed over keeps the claims, not the counters); and its own claim once every
``OWN_CLAIM_EVERY`` beats besides, in place of that beat's look. A target that never beat
is given ``startup_s`` before it is found silent.

``RingPlace`` is one party's part: its beat, its look, and what it finds, as reports
(``node_silent``, ``rejected``, ``fenced``); its owner acts on them. ``RingWatch`` is the
bookkeeping of its watch, no store in it. A party found silent is watched no more
(``ended_slot``), the watch moving on to the next; where the party that found it silent
sees it beat again before acting on it (no rank of it taken out, its place not ended),
it is watched again (``watch_again``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from . import sealed_keys
from .seal import ENTRY, SealedList, Sealer, text_of

log = logging.getLogger(__name__)

#: Added to a party's ``alive`` counter by whoever declared it lost, right after taking its
#: claim: far above any count of beats.
FENCE = 1 << 40
#: Beats between two reads of a party's own claim: only for a declarer that ended between
#: its claim and its fence (the fence is what normally tells a party).
OWN_CLAIM_EVERY = 600
#: Asked of the store as both the expected and the new value, to read a key in one request:
#: an unset key answers it back unchanged, a set one answers its value. No writer of ours
#: ever writes it.
_UNSET = "\x00unset"


@dataclass(frozen=True)
class RingKeys:
    """The keys of one ring, under ``prefix``."""

    prefix: str

    def alive(self, slot: int) -> str:
        """Counter party ``slot`` bumps every interval (``FENCE`` more once declared lost)."""
        return f"{self.prefix}alive/{slot}"

    def claim(self, slot: int) -> str:
        """List whose first valid entry decides party ``slot``'s end: it left, or was
        declared lost."""
        return f"{self.prefix}claim/{slot}"


class Unsealed:
    """The entries of a ring's claims where the job has no secret: plain, each one valid
    (``Sealer``'s ``entry`` and ``entries``, without the seal)."""

    def entry(self, key: str, payload: str) -> str:
        """``payload`` as one entry of the list at ``key``, to append."""
        return f"{ENTRY}{payload}{ENTRY}"

    def entries(self, key: str, value: str | None) -> SealedList:
        """The list ``value`` read at ``key`` (None: not set): every entry, in order."""
        return SealedList(tuple(f for f in (value or "").split(ENTRY) if f))


Entries = Sealer | Unsealed
#: Where a party's tick sends what it finds (``node_silent``, ``rejected``, ``fenced``).
Report = Callable[[dict[str, Any]], None]


class Counters(Protocol):
    """What a ring needs of a store client: counters to bump and read, and a compare-and-set
    to read a claim in one request (``nvrx.store.wire.WireStore``, a torch store)."""

    def add(self, key: str, amount: int) -> int: ...

    def compare_set(self, key: str, expected: str, desired: str) -> bytes | str: ...


def read_claims(store: Counters, keys: RingKeys, entries: Entries, slot: int) -> SealedList:
    """Party ``slot``'s claim as it is now, in one request."""
    key = keys.claim(slot)
    raw = store.compare_set(key, _UNSET, _UNSET)
    value = text_of(raw)
    return entries.entries(key, None if value == _UNSET else value)


def claim(store: Any, keys: RingKeys, entries: Entries, slot: int, by: int) -> bool:
    """Claim party ``slot``'s end for ``by`` (``store``: ``append`` and ``get`` besides);
    True when this claim is the first valid one."""
    return sealed_keys.claim(store, entries, keys.claim(slot), by)


def declare_lost(store: Any, keys: RingKeys, entries: Entries, slot: int, by: int) -> bool:
    """``by`` declares party ``slot`` lost: its claim, then its fence when the claim won."""
    if not claim(store, keys, entries, slot, by):
        return False
    store.add(keys.alive(slot), FENCE)
    return True


class RingWatch:
    """Which slot ``own`` watches, and when that slot has been silent for ``timeout``."""

    def __init__(
        self, own: int, nslots: int, timeout: float, startup_s: float | None = None
    ) -> None:
        self.own, self.nslots, self.timeout = own, nslots, timeout
        self.startup_s = timeout if startup_s is None else max(timeout, startup_s)
        self.ended: set[int] = set()
        self.target: int | None = None
        self._value: int | None = None
        self._changed = 0.0
        self._changed_wall = 0.0
        self._reported = False
        self._move(own)

    def _move(self, after: int) -> None:
        self.target, self._value, self._reported = None, None, False
        for step in range(1, self.nslots):
            slot = (after + step) % self.nslots
            if slot != self.own and slot not in self.ended:
                self.target = slot
                return

    def resize(self, nslots: int) -> None:
        """The ring holds ``nslots`` now (parties that joined late): watch the next party
        again, keeping what was seen of the target if it stays the same."""
        if nslots == self.nslots:
            return
        self.nslots = nslots
        self._move_keeping()

    def watch_again(self, slot: int) -> None:
        """``slot``, found silent, beats again before its watcher did anything about it: it
        is watched again where it is the next party (its silence counted afresh)."""
        if slot in self.ended:
            self.ended.discard(slot)
            self._move_keeping()

    def _move_keeping(self) -> None:
        """Watch the next party from ``own``, keeping what was seen of the target if it
        stays the same."""
        kept = (self.target, self._value, self._changed, self._changed_wall, self._reported)
        self._move(self.own)
        if self.target == kept[0]:
            self.target, self._value, self._changed, self._changed_wall, self._reported = kept

    @property
    def seen(self) -> int | None:
        """The target's counter as last read (None before the first read): what a
        ``node_silent`` report found standing still."""
        return self._value

    def ended_slot(self, slot: int) -> None:
        """``slot`` left, was declared lost, or was found silent: watch it no more, unless
        its owner finds it alive again (``watch_again``)."""
        self.ended.add(slot)
        if slot == self.target:
            self._move(slot)

    def restart_clock(self, now: float, seen_wall: float | None = None) -> None:
        """Count the target's silence from ``now``: the watcher did not look before, or it
        learnt otherwise that the target is alive, at ``seen_wall`` (its last sign of life
        from then on; without it, the one seen before stands)."""
        self._changed = now
        if seen_wall is not None:
            self._changed_wall = seen_wall

    def stood_still(self, beats: int) -> bool:
        """Whether the target's counter read ``beats`` again: it may have ended."""
        return beats == self._value

    def look(
        self, read_beats: Callable[[int], int], has_ended: Callable[[int, int], bool]
    ) -> int | None:
        """Read the target's counter (``read_beats(slot)``), moving past each target whose
        counter stood still and that ``has_ended(slot, beats)`` (its end is read only then):
        the counter of the target watched now, None when no slot is left to watch."""
        while self.target is not None:
            beats = read_beats(self.target)
            if not self.stood_still(beats) or not has_ended(self.target, beats):
                return beats
            self.ended_slot(self.target)
        return None

    def observe(self, beats: int, now: float, wall: float) -> dict[str, Any] | None:
        """The target's counter read at ``now``; a ``node_silent`` report when it newly went
        silent."""
        if self.target is None:
            return None
        if beats != self._value:
            self._value, self._changed, self._changed_wall, self._reported = beats, now, wall, False
            return None
        silent = now - self._changed
        if self._reported or silent <= (self.startup_s if beats == 0 else self.timeout):
            return None
        self._reported = True
        return {
            "event": "node_silent",
            "slot": self.target,
            "silent_s": round(silent, 3),
            "last_seen_wall": self._changed_wall,
        }


class RingPlace:
    """One party's part in the ring: ``tick`` beats for ``own`` and looks at its target.

    ``stamps`` (a folder only the job's user can write, shared by the parties): where a
    party whose counter another client sets back stamps its beats too, and where a watcher
    whose target's counter stands still reads them (see ``tick``). ``stall_s``: a tick
    whose store requests, or whose distance from the last tick, took longer than this
    restarts the target's clock (time this party did not look is nobody's silence); None
    counts every second (a supervisor's watch, whose store watchdog tells a frozen store).
    """

    def __init__(
        self,
        keys: RingKeys,
        own: int,
        nslots: int,
        timeout: float,
        entries: Entries,
        startup_s: float | None = None,
        stamps: Path | None = None,
        stall_s: float | None = None,
    ) -> None:
        self.keys, self.own, self.entries = keys, own, entries
        self.ring = RingWatch(own, nslots, timeout, startup_s)
        self.stamps, self.stall_s = stamps, stall_s
        self._beats = 0
        self._fence_floor = 0  # a count at or above this plus FENCE is a fence to look into
        self._forged_seen = 0  # entries of the own claim that did not unseal, reported already
        self._last_count: int | None = None  # what this party's last beat read of its counter
        self._last_tick: float | None = None
        self._stamping = False  # once this party's counter was set back: beats in ``stamps`` too
        self._stamp_read: dict[int, str | None] = {}  # a target's stamp, as last read
        self._held: set[int] = set()  # targets whose store beats are held still, said once

    def tick(self, store: Counters, now: float, wall: float, report: Report) -> bool:
        """One beat and one look (``now``: monotonic seconds, ``wall``: epoch seconds); what
        it finds goes to ``report`` as it is found. False once the party was fenced off
        (a ``fenced`` report): it has ended, and ticks no more."""
        started, last = time.monotonic(), self._last_tick
        self._last_tick = now
        count = int(store.add(self.keys.alive(self.own), 1))
        self._beats += 1
        self._check_counter(count, report)
        if self._stamping:
            self._stamp()
        fence = count >= self._fence_floor + FENCE
        own_claim = (self._beats - 1) % OWN_CLAIM_EVERY == 0  # the first beat, then rarely
        if (fence or own_claim) and self._ended(store, count, fence, report):
            report({"event": "fenced", "slot": self.own})
            return False
        if own_claim and self._beats > 1:
            return True  # the claim was this beat's second request: the look waits a beat
        beats = self.ring.look(
            lambda slot: int(store.add(self.keys.alive(slot), 0)),
            lambda slot, _: bool(read_claims(store, self.keys, self.entries, slot).valid),
        )
        if beats is not None and not self._stalled(started, last, now):
            self._observe(beats, now, wall, report)
        return True

    def _stalled(self, started: float, last: float | None, now: float) -> bool:
        """Whether this party itself did not look for longer than ``stall_s`` (its requests
        since ``started`` took that long, or its last tick was ``last``): the target's
        silence is then counted from ``now``."""
        if self.stall_s is None:
            return False
        took = time.monotonic() - started
        if took > self.stall_s or (last is not None and now - last > self.stall_s):
            self.ring.restart_clock(now)
            return True
        return False

    def _observe(self, beats: int, now: float, wall: float, report: Report) -> None:
        target = self.ring.target
        if not self.ring.stood_still(beats) and target is not None:
            self._stamp_read.pop(target, None)  # a later stretch reads its stamp afresh
        elif self._stamp_moved(target):
            self.ring.restart_clock(now, wall)  # alive: its store beats are held still
        silent = self.ring.observe(beats, now, wall)
        if silent is not None:
            log.warning("slot %s silent for %.1f s", silent["slot"], silent["silent_s"])
            report(silent)

    def _check_counter(self, count: int, report: Report) -> None:
        """Only this party adds to its counter but for a declarer's fence, which raises it: a
        count at or below the last one means a client set it back (deleted it, or added a
        negative amount), which holds this party still in its watcher's eyes. Each set-back
        is reported, and from the first the party stamps its beats in ``stamps`` too."""
        last, self._last_count = self._last_count, count
        if last is None or count > last:
            return
        stamps = ", this slot stamps its beats in the job folder for its watcher"
        stamps = stamps if self.stamps is not None else ""
        reason = (
            f"this slot's beat counter was set back from {last} to {count - 1} before this beat: "
            f"not a write of {self._writers()} (held still in the store{stamps})"
        )
        log.warning("rejected a change of slot %d's beat counter: %s", self.own, reason)
        key = self.keys.alive(self.own)
        report({"event": "rejected", "key": key, "reason": reason, "value_bytes": 0})
        self._stamping = self.stamps is not None
        # a forged fence set back: a real one later counts from where the counter is now
        self._fence_floor = min(self._fence_floor, count - count % FENCE)

    def _stamp(self) -> None:
        """This beat in ``stamps``, written whole (a reader never sees half of it)."""
        assert self.stamps is not None
        try:
            self.stamps.mkdir(parents=True, exist_ok=True)
            part = self.stamps / f".{self.own}.part"
            part.write_text(str(self._beats))
            os.replace(part, self.stamps / str(self.own))
        except OSError as exc:
            log.warning("cannot stamp this slot's beat in the job folder: %s", exc)

    def _stamp_moved(self, slot: int | None) -> bool:
        """Whether ``slot``'s stamp changed (or appeared) since this party last read it in
        this stretch of its counter standing still."""
        if self.stamps is None or slot is None:
            return False
        try:
            stamp: str | None = (self.stamps / str(slot)).read_text()
        except OSError:
            stamp = None
        read_before, last = slot in self._stamp_read, self._stamp_read.get(slot)
        self._stamp_read[slot] = stamp
        moved = read_before and stamp is not None and stamp != last
        if moved and slot not in self._held:
            self._held.add(slot)
            log.warning(
                "slot %d's beat counter stands still in the store, but it stamps its beats in "
                "the job folder: held still by another client, not silent",
                slot,
            )
        return moved

    def _writers(self) -> str:
        """Who writes this ring's keys: what a write of another client is not."""
        sealed = isinstance(self.entries, Sealer)
        return "this job's supervisors" if sealed else "this job's node agents"

    def _ended(self, store: Counters, count: int, fence: bool, report: Report) -> bool:
        """Whether this party's claim holds a valid entry; reports what was forged of it."""
        claims = read_claims(store, self.keys, self.entries, self.own)
        if claims.valid:
            return True
        forged = claims.invalid - self._forged_seen
        if forged > 0 or fence:
            self._forged_seen = claims.invalid
            key = self.keys.claim(self.own) if forged > 0 else self.keys.alive(self.own)
            reason = (
                f"{forged} claim entries with no valid seal: not a declaration of "
                f"{self._writers()} in this run"
                if forged > 0
                else f"a fence with no valid claim behind it: not added by {self._writers()}"
            )
            log.warning("rejected a forged end of slot %d: %s", self.own, reason)
            size = claims.invalid_bytes if forged > 0 else 0
            report({"event": "rejected", "key": key, "reason": reason, "value_bytes": size})
        if fence:
            self._fence_floor = count - count % FENCE
        return False
