"""One event file folded into a ``FileSummary``, event by event in file order.

One file is one process, so a summary is cheap to build in a worker process
and cheap to send back. ``fold`` runs once per event for millions of events:
values that rarely change within one file (host, node, rank, job, round) are
only looked at again when they differ from the previous event's, and what
every event updates is kept in local variables until the file is done.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from nvrx.events.schema import KINDS
from nvrx.events.validation import (
    EVENT_FIELDS,
    MAX_ID,
    MAX_MONO,
    MAX_WALL,
    PROCESS_FIELDS,
    usable_event,
    usual_process_fields,
)

from .file_summary import Ev, slurm_run_of
from .kind_handlers import DISPATCH, UNHANDLED, KindHandlers, OInt, OStr, phase_ended
from .parts import RoundState
from .typed_events import RECORD_TYPES
from .values import as_int, as_str, num

#: Components whose events belong to one training rank.
_RANK_COMPONENTS = ("wrapper", "monitor", "app")
#: Per record type (``typed_events``): its kind's handler, and whether it is filed under its round.
_RECORD_DISPATCH = {cls: DISPATCH.get(kind, UNHANDLED) for kind, cls in RECORD_TYPES.items()}


def _read_common(event: Ev) -> tuple[Any, float | None, Any, tuple[Any, ...]]:
    """Kind, wall, round and (host, node, rank, job) of any event the reader keeps."""
    kind = event["kind"]
    wall = event.get("wall")
    if type(wall) is not float:
        wall = num(wall)
    raw = (event.get("host"), event.get("node"), event.get("rank"), event.get("job"))
    return kind, wall, event.get("round"), raw


def _widen(part: RoundState, first: float, last: float) -> None:
    """Widen ``part``'s span of walls to ``first``..``last`` (nothing when first > last)."""
    if first <= last:
        if part.first_wall is None or first < part.first_wall:
            part.first_wall = first
        if part.last_wall is None or last > part.last_wall:
            part.last_wall = last


_INF = float("inf")


class FileFolder(KindHandlers):
    """Folds the events of one file into a ``FileSummary``: ``fold`` them, then ``finish``.

    ``run_starts``: note where each folded ``supervisor_start`` begins a job run (when every
    event of the file is folded; with filters, the caller notes them from all events).
    ``job_rounds``: a job's round states of run 0 to file rounds under (else the summary's).
    """

    def _context(self, event: Ev, raw: tuple[Any, ...]) -> tuple[OStr, OInt, OInt]:
        """Host, node and rank of ``event`` whose (host, node, rank, job) ``raw`` changed."""
        s = self.s
        host, node, rank = as_str(raw[0]), as_int(raw[1]), as_int(raw[2])
        if raw[3] is not None:
            s.jobs.add(str(raw[3]))
        if host is not None and s.host is None:
            s.host, s.boot = host, as_str(event.get("boot"))
        if s.component is None:
            s.component = as_str(event.get("component"))
        if s.pid is None:
            s.pid = as_int(event.get("pid"))
        if s.slurm_run is None:
            s.slurm_run = slurm_run_of(event)
        if rank is not None and event.get("component") in _RANK_COMPONENTS:
            s.ranks.add(rank)
        if node is not None and host is not None:
            s.node_hosts.setdefault(node, host)
        return host, node, rank

    def fold(self, events: Iterable[Any], parsed: bool = False) -> bool:
        """Fold ``events`` in file order; what every event updates stays in locals meanwhile.

        ``parsed``: they come straight from the JSON parser, unchecked. Each is then checked
        as the reader checks it (``nvrx.events.validation``: the writer's usual event here, any
        other in full), and kinds unknown here are counted in the summary's read stats. False
        at the first value the reader would skip: the summary is then unusable.
        """
        dispatch = DISPATCH
        event_fields, process_fields = EVENT_FIELDS, PROCESS_FIELDS
        first, last = self.first_wall, self.last_wall
        raw_seen, (host, node, rank) = self._raw, self._ctx
        rnd_seen, part = self._round, self._part
        part_first, part_last = _INF, -_INF  # walls of the current round's events, not yet filed
        seen: tuple[Any, ...] = ()  # the process fields of the previous event, if usual
        folded = 0
        event = None
        for event in events:
            try:
                kind, wall, mono, rnd = event_fields(event)
                fields = process_fields(event)
            except (KeyError, TypeError):  # a common field missing, or not an object
                fields = None
            raw = raw_seen
            usual = fields is not None and (  # as validation.all_usual (the round: below)
                type(wall) is float
                and 0.0 <= wall <= MAX_WALL
                and type(mono) is float
                and 0.0 <= mono <= MAX_MONO
                and type(kind) is str
            )
            if usual and (
                fields != seen
                or type(fields[0]) is not int
                or type(fields[1]) is not int
                or type(fields[2]) is not type(seen[2])
                or type(fields[3]) is not type(seen[3])
            ):
                usual = usual_process_fields(fields)
                seen = fields if usual else ()
                raw = (fields[4], fields[2], fields[3], fields[7])  # host, node, rank, job
            if not usual:
                if parsed and not usable_event(event):
                    return False
                kind, wall, rnd, raw = _read_common(event)
                seen = ()
            if raw is not raw_seen and raw != raw_seen:
                raw_seen = raw
                host, node, rank = self._context(event, raw)
            folded += 1
            if wall is not None:
                if wall < first:
                    first = wall
                if wall > last:
                    last = wall
            if rnd is not rnd_seen and (rnd != rnd_seen or type(rnd) is not type(rnd_seen)):
                if parsed and not (rnd is None or (type(rnd) is int and 0 <= rnd <= MAX_ID)):
                    return False  # a round the reader refuses (events read by it have none)
                handler, filed = dispatch.get(kind, UNHANDLED)
                if filed:  # the events of another round begin
                    if part is not None:
                        _widen(part, part_first, part_last)
                    rnd_seen, part, part_first, part_last = rnd, self.round_of(rnd), _INF, -_INF
            else:
                handler, filed = dispatch.get(kind, UNHANDLED)
            if not filed:
                handler(self, event, None, rank, node, host, wall)
                continue
            # Any event of a round (the app's progress, checkpoints) shows that it ran.
            if wall is not None:
                if wall < part_first:
                    part_first = wall
                if wall > part_last:
                    part_last = wall
            if handler is not None:
                handler(self, event, part, rank, node, host, wall)
            elif parsed and kind not in KINDS:
                unknown = self.s.stats.unknown_kinds
                unknown[kind] = unknown.get(kind, 0) + 1
        if part is not None:
            _widen(part, part_first, part_last)
        if event is not None:
            self.last_event = event
        self.s.kept += folded
        self.first_wall, self.last_wall = first, last
        self._raw, self._ctx = raw_seen, (host, node, rank)
        self._round, self._part = rnd_seen, part
        return True

    def fold_records(self, records: Sequence[Any]) -> None:
        """``fold`` for a file's records (``typed_events``): their common fields were checked as
        they were decoded, and every kind is known, so nothing is checked here."""
        dispatch, phase_type = _RECORD_DISPATCH, RECORD_TYPES.get("restart_phase")
        first, last = self.first_wall, self.last_wall
        raw_seen, (host, node, rank) = self._raw, self._ctx
        rnd_seen, part = self._round, self._part
        part_first, part_last = _INF, -_INF  # as in ``fold``
        for record in records:
            wall, rnd = record.wall, record.round
            raw = (record.host, record.node, record.rank, record.job)
            if raw != raw_seen:
                raw_seen = raw
                host, node, rank = self._context(record, raw)
            if wall < first:
                first = wall
            if wall > last:
                last = wall
            cls = type(record)
            handler, filed = dispatch[cls]
            if filed and rnd is not rnd_seen and rnd != rnd_seen:
                if part is not None:
                    _widen(part, part_first, part_last)
                rnd_seen, part, part_first, part_last = rnd, self.round_of(rnd), _INF, -_INF
            if not filed:
                handler(self, record, None, rank, node, host, wall)
                continue
            if wall < part_first:
                part_first = wall
            if wall > part_last:
                part_last = wall
            if cls is phase_type:  # half the events: the handler's work, without the handler
                if part is not None:
                    phase_ended(part, record.phase, record.duration_s, record.ok)
            elif handler is not None:
                handler(self, record, part, rank, node, host, wall)
        if part is not None:
            _widen(part, part_first, part_last)
        if records:
            self.last_event = records[-1]
        self.s.kept += len(records)
        self.first_wall, self.last_wall = first, last
        self._raw, self._ctx = raw_seen, (host, node, rank)
        self._round, self._part = rnd_seen, part

    def finish(self) -> None:
        s = self.s
        self.add_first_faults()
        if self.first_wall <= self.last_wall:
            s.first_wall, s.last_wall = self.first_wall, self.last_wall
        last = self.last_event
        if (self.open_call is not None or self.open_wall is not None) and last is not None:
            boot, start = self.open_call or (None, 0.0)
            mono = num(last.get("mono"))
            counted = 0.0
            if self.open_call is not None and mono is not None and boot == as_str(last.get("boot")):
                # The process vanished inside the function (killed): count up to its last event.
                counted = max(0.0, mono - start)
                s.call_us += round(counted * 1e6)
            if self.open_wall is not None:
                s.open_call = (self.open_wall, counted)
            s.interrupted_calls += 1
            s.vanished = s.ending_fault is None
