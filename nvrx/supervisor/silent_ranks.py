"""Which of this node's Wrapper ranks stopped beating, and whether any still beats.

The supervisor reads its ranks' heartbeats (``nvrx.rank_beats``) into a
``RankBeats``; ``due(now)`` names each rank whose monitor has been silent for
longer than its ``heartbeat_timeout`` (once per silence), and
``alive_due(now)`` says when the job's alive counter should move for the
node: once per heartbeat interval in which a rank beat. No torch here.
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
        self._beat_since_tick = False
        self._next_tick: float | None = None

    def record(self, beats: list[Beat], now: float | None = None) -> None:
        """Apply received beats: a ``bye`` or the beat of an ended process ends the watch."""
        now = time.monotonic() if now is None else now
        for beat in beats:
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
            self._beat_since_tick = True
            if self._next_tick is None:
                self._next_tick = now

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

    def alive_due(self, now: float) -> bool:
        """Whether to move the job's alive counter now (at most once per beat interval, and
        only when a rank beat since the last time)."""
        if self._next_tick is None or now < self._next_tick or not self._beat_since_tick:
            return False
        interval = min((b.beat.interval for b in self.ranks.values()), default=1.0)
        self._next_tick = now + max(interval, 0.01)
        self._beat_since_tick = False
        return True

    def next_deadline(self) -> float | None:
        """When ``due`` or ``alive_due`` may next have something to say."""
        times = [b.deadline for b in self.ranks.values() if not b.declared]
        if self._beat_since_tick and self._next_tick is not None:
            times.append(self._next_tick)
        return min(times) if times else None
