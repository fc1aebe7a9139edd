"""Which of this node's Wrapper ranks stopped beating.

The supervisor reads its ranks' heartbeats (``nvrx.rank_beats``) into a
``RankBeats``; ``due(now)`` names each rank whose monitor has been silent for
longer than its ``heartbeat_timeout`` (once per silence). A beat costs the
store nothing: only a silence does. No torch here.
"""

from __future__ import annotations

import dataclasses
import time

from nvrx.rank_beats import Beat


@dataclasses.dataclass
class Beating:
    """What the last beat of one rank's monitor said, and when it came."""

    beat: Beat
    last: float
    declared: bool = False

    @property
    def deadline(self) -> float:
        return self.last + self.beat.timeout


@dataclasses.dataclass(frozen=True)
class Silence:
    """A rank whose monitor stopped beating: take it out of its round."""

    beat: Beat
    silent_s: float


class RankBeats:
    """The latest beat of each local rank's monitor, by initial rank."""

    def __init__(self) -> None:
        self.ranks: dict[int, Beating] = {}
        self._ended: dict[int, int] = {}  # local rank -> its last attempt that ended
        self.wrapper_pids: set[int] = set()  # processes whose monitor beat: Wrapper ranks

    def record(self, beats: list[Beat], now: float | None = None) -> None:
        """Apply received beats: a ``bye`` or the beat of an ended process ends the watch."""
        now = time.monotonic() if now is None else now
        for beat in beats:
            self.wrapper_pids.add(beat.pid)
            if beat.attempt <= self._ended.get(beat.local_rank, -1):
                continue  # queued before its child ended
            current = self.ranks.get(beat.initial_rank)
            if beat.bye:
                if current is not None and current.beat.pid == beat.pid:
                    del self.ranks[beat.initial_rank]
                continue
            if current is None or current.beat.pid != beat.pid or current.beat.round != beat.round:
                self.ranks[beat.initial_rank] = Beating(beat, now)
            else:
                current.beat, current.last = beat, now

    def sync(self, running: dict[int, int]) -> None:
        """Forget the ranks whose child is not running any more: ``running`` maps each running
        child's local rank to its attempt. A child that ended is no silent rank."""
        for initial, beating in list(self.ranks.items()):
            local_rank, attempt = beating.beat.local_rank, beating.beat.attempt
            if running.get(local_rank) != attempt:
                self._ended[local_rank] = max(attempt, self._ended.get(local_rank, -1))
                del self.ranks[initial]

    def due(self, now: float) -> list[Silence]:
        """Ranks silent beyond their timeout, each named once per silence."""
        found = []
        for beating in self.ranks.values():
            if not beating.declared and now > beating.deadline:
                beating.declared = True
                found.append(Silence(beating.beat, now - beating.last))
        return found

    def next_deadline(self) -> float | None:
        """When ``due`` may next have something to say."""
        times = [b.deadline for b in self.ranks.values() if not b.declared]
        return min(times) if times else None
