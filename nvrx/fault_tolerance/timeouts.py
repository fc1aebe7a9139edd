"""Timeouts in force for one rank, and the observations that computed ones come from.

``Timeouts`` is what the supervisor checks; ``Observations`` records, on the
rank's side, the longest time to the first heartbeat, between heartbeats, in
each section and outside every section. A computed timeout is the longest
observation of every rank (a MAX all-reduce where torch.distributed runs) times
the safety factor; where the value in force was itself computed, the new one
is averaged with it (weights 1/2), so one unusual stretch does not swing it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from .data import HeartbeatTimeouts, SectionTimeouts


def _check_seconds(what: str, value: object) -> None:
    """ValueError unless ``value`` is None or a finite number of seconds ≥ 0."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if value is not None and not (number and 0 <= value < math.inf):  # type: ignore[operator]
        raise ValueError(f"timeouts: {what} must be seconds ≥ 0 or null, got {value!r}")


#: The key of NVRx's ``RankMonitorClient.state_dict()``, which nvrx writes and reads too.
CHECKPOINT_KEY = "current_timeouts"


@dataclasses.dataclass
class Timeouts:
    """Seconds; None: not checked. ``computed`` names the values that were computed, not configured."""

    initial_heartbeat: float | None = None
    heartbeat: float | None = None
    sections: dict[str, float | None] = dataclasses.field(default_factory=dict)
    out_of_section: float | None = None
    computed: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeouts:
        """The timeouts ``data`` (``to_dict``) holds; TypeError or ValueError, naming the
        field, for anything else (it comes from a rank's process, which may be broken)."""
        if not isinstance(data, dict):
            raise TypeError(f"timeouts: expected an object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"timeouts: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
        timeouts = cls(**data)
        for name in ("initial_heartbeat", "heartbeat", "out_of_section"):
            _check_seconds(name, getattr(timeouts, name))
        if not isinstance(timeouts.sections, dict):
            raise TypeError(f"timeouts: sections must be an object, got {timeouts.sections!r}")
        for name, limit in timeouts.sections.items():
            _check_seconds(f"section {name!r}", limit)
        if not isinstance(timeouts.computed, list) or not all(isinstance(c, str) for c in timeouts.computed):
            raise TypeError(f"timeouts: computed must be a list of names, got {timeouts.computed!r}")
        return timeouts

    def heartbeat_view(self) -> HeartbeatTimeouts:
        """The heartbeat timeouts as NVRx's client shows them (``hb_timeouts``)."""
        computed = "heartbeat" in self.computed or "initial_heartbeat" in self.computed
        return HeartbeatTimeouts(self.initial_heartbeat, self.heartbeat, computed)

    def section_view(self) -> SectionTimeouts:
        """The section timeouts as NVRx's client shows them (``section_timeouts``)."""
        calculated = {n[len("section:"):] for n in self.computed if n.startswith("section:")}
        return SectionTimeouts(
            dict(self.sections), self.out_of_section, calculated, "out_of_section" in self.computed
        )

    def to_checkpoint(self) -> dict[str, Any]:
        """NVRx's checkpoint entry: the computed timeouts only (configured ones come from the
        launcher again after a restart)."""
        saved: dict[str, Any] = {}
        hb = self.heartbeat_view()
        if hb.are_valid and hb.were_calculated:
            saved["heartbeat"] = dataclasses.asdict(hb)
        sections = self.section_view()
        if sections.calculated_sections or sections.is_out_of_section_calculated:
            saved["section"] = dataclasses.asdict(sections)
            saved["section"]["calculated_sections"] = sorted(sections.calculated_sections)
        return {CHECKPOINT_KEY: saved}

    @classmethod
    def from_checkpoint(cls, saved: dict[str, Any]) -> Timeouts:
        """The timeouts of NVRx's checkpoint entry (``to_checkpoint``); None where it holds
        none. Beside the computed ones it holds the section timeouts configured when it was
        saved (``computed_only`` leaves them out)."""
        timeouts = cls(initial_heartbeat=None, heartbeat=None, out_of_section=None)
        if "heartbeat" in saved:
            hb = HeartbeatTimeouts(**saved["heartbeat"])
            timeouts.initial_heartbeat, timeouts.heartbeat = hb.initial, hb.subsequent
            if hb.were_calculated:
                timeouts.computed += ["initial_heartbeat", "heartbeat"]
        if "section" in saved:
            sections = SectionTimeouts(**saved["section"])
            timeouts.sections = dict(sections.section)
            timeouts.out_of_section = sections.out_of_section
            timeouts.computed += [f"section:{n}" for n in sorted(sections.calculated_sections)]
            if sections.is_out_of_section_calculated:
                timeouts.computed.append("out_of_section")
        return timeouts

    def computed_only(self) -> Timeouts:
        """These timeouts less the ones not computed: what a checkpoint puts back in force
        after a restart, whose configuration gives the rest again."""
        done = set(self.computed)
        return Timeouts(
            initial_heartbeat=self.initial_heartbeat if "initial_heartbeat" in done else None,
            heartbeat=self.heartbeat if "heartbeat" in done else None,
            sections={n: v for n, v in self.sections.items() if f"section:{n}" in done},
            out_of_section=self.out_of_section if "out_of_section" in done else None,
            computed=list(self.computed),
        )

    def merge(self, name: str, value: float) -> float:
        """The value to put in force for ``name`` after computing ``value``."""
        old = self.sections.get(name[len("section:"):]) if name.startswith("section:") else getattr(self, name)
        if name in self.computed and old is not None:
            return (old + value) / 2
        return value


class Observations:
    """Longest stretches seen by one rank since monitoring began (monotonic seconds)."""

    def __init__(self, now: float | None = None) -> None:
        self.started = time.monotonic() if now is None else now
        self.last_heartbeat: float | None = None
        self.first_heartbeat_s: float | None = None
        self.max_heartbeat_gap_s: float | None = None
        self.open: dict[str, float] = {}
        self.max_section_s: dict[str, float] = {}
        self.outside_since: float | None = self.started
        self.max_out_of_section_s: float | None = None

    def heartbeat(self, now: float) -> None:
        if self.last_heartbeat is None:
            self.first_heartbeat_s = now - self.started
        else:
            gap = now - self.last_heartbeat
            if self.max_heartbeat_gap_s is None or gap > self.max_heartbeat_gap_s:
                self.max_heartbeat_gap_s = gap
        self.last_heartbeat = now

    def section_start(self, name: str, now: float) -> None:
        if not self.open and self.outside_since is not None:
            span = now - self.outside_since
            if self.max_out_of_section_s is None or span > self.max_out_of_section_s:
                self.max_out_of_section_s = span
            self.outside_since = None
        self.open[name] = now

    def section_end(self, name: str, now: float) -> None:
        started = self.open.pop(name, None)
        if started is not None:
            span = now - started
            if span > self.max_section_s.get(name, -1.0):
                self.max_section_s[name] = span
        if not self.open:
            self.outside_since = now

    def end_all(self, now: float) -> None:
        for name in list(self.open):
            self.section_end(name, now)


__all__ = ["CHECKPOINT_KEY", "Observations", "Timeouts"]
