"""A ring of liveness counters: which party one party watches, and when that one went silent.

Each party (a node's supervisor, or a host's node agent without one) bumps
its own counter in the store every interval and reads the counter of the next
party in the ring that has not ended: each party is watched by exactly one
other, and the load is two requests per party per interval. ``RingWatch`` is
the bookkeeping of one watcher, no store in it: its owner reads the counters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


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
        kept = (self.target, self._value, self._changed, self._changed_wall, self._reported)
        self.nslots = nslots
        self._move(self.own)
        if self.target == kept[0]:
            self.target, self._value, self._changed, self._changed_wall, self._reported = kept

    def ended_slot(self, slot: int) -> None:
        """``slot`` left or was declared lost: never watch it again."""
        self.ended.add(slot)
        if slot == self.target:
            self._move(slot)

    def still_for(self, now: float) -> float:
        """How long the target's counter has read the same (0 before a first read)."""
        return 0.0 if self._value is None else now - self._changed

    def restart_clock(self, now: float) -> None:
        """Count the target's silence from ``now``: the watcher did not look before, or it
        learnt otherwise that the target is alive."""
        self._changed = now

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
        """The target's counter read at ``now``; a ``node_silent`` report when it newly went silent."""
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
