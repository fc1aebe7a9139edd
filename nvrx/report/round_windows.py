"""Which restart round a wall time belongs to: the one definition the report uses.

A round's window runs from its first event (``first_wall``) until the next
round of its run begins: the earliest ``first_wall`` of the run's later
rounds (by number), open at that end. A process killed mid-round writes no
last word, so its death is placed in a round by its time alone. A round with
no known first wall has no window. Windows never overlap (each ends where a
later round begins), so the round whose window holds a time is found by
bisection over the rounds' first walls.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping

from .parts import RoundState

#: A round's window of wall times: [start, end).
Window = tuple[float, float]


class RoundWindows:
    """The windows of the rounds of ``rounds`` ((run, round) -> state), built once."""

    def __init__(self, rounds: Mapping[tuple[int, int], RoundState]) -> None:
        self._windows: dict[tuple[int, int], Window] = {}
        by_run: dict[int, list[tuple[int, float]]] = {}
        for (run, rnd), r in rounds.items():
            if r.first_wall is not None:
                by_run.setdefault(run, []).append((rnd, r.first_wall))
        # Per run, its non-empty windows by start: (starts, [(end, round)]).
        self._held: dict[int, tuple[list[float], list[tuple[float, int]]]] = {}
        for run, firsts in by_run.items():
            end = math.inf
            held: list[tuple[float, float, int]] = []
            for rnd, start in sorted(firsts, reverse=True):  # last round first
                self._windows[(run, rnd)] = (start, end)
                if start < end:
                    held.append((start, end, rnd))
                end = min(end, start)
            held.reverse()  # by start: each non-empty window starts before all later rounds
            self._held[run] = ([w[0] for w in held], [(w[1], w[2]) for w in held])

    def window(self, run: int, rnd: int) -> Window | None:
        """Wall times that belong to round ``rnd`` of ``run``; None without its first wall."""
        return self._windows.get((run, rnd))

    def round_at(self, run: int, wall: float | None) -> int | None:
        """The round of ``run`` whose window holds ``wall``; None when none does."""
        if wall is None or run not in self._held:
            return None
        starts, rest = self._held[run]
        i = bisect.bisect_right(starts, wall)
        if not i:
            return None
        end, rnd = rest[i - 1]
        return rnd if wall < end else None
