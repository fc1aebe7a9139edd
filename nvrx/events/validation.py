"""Checking an event's common fields (``schema.COMMON_FIELDS``) as it is read.

A reader must survive any file: a line that parses as JSON but whose common
fields have the wrong type or an impossible value (a ``wall`` of 1e308, a
``rank`` of "abc", a negative pid, a non-finite ``mono``) is skipped like a
torn line, so that no consumer has to guard every field. A kind's own fields
are not checked here: consumers read them defensively. Missing fields are
allowed (old or hand-written events); only wrong values are refused.

Millions of events are checked at a time: ``all_usual`` (and ``nvrx.report``'s
fold, inline) checks the writer's usual event cheaply, comparing the fields
one process's events share with the previous event's; any other event gets
the full check.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import itemgetter
from typing import Any

#: Latest wall time accepted: 9999-12-31T23:59:59Z (what calendars and time_t can show).
MAX_WALL = 253402300799.0
#: Largest monotonic clock value accepted (31 000 years of uptime).
MAX_MONO = 1e12
#: Largest pid, node, rank or round accepted.
MAX_ID = 2**31 - 1
MAX_VERSION = 10**6


def _number(value: Any, low: float, high: float) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{type(value).__name__} is not a number"
    if not low <= value <= high:  # also refuses NaN
        return f"{value!r:.32} is outside {low:g}..{high:g}"
    return None


def _integer(value: Any, low: int, high: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{type(value).__name__} is not an integer"
    if not low <= value <= high:
        return f"{value!r:.32} is outside {low}..{high}"
    return None


def _optional_integer(value: Any, low: int, high: int) -> str | None:
    return None if value is None else _integer(value, low, high)


def _optional_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return None
    return f"{type(value).__name__} is not a string"


def _job(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return None
    return _integer(value, 0, 2**63 - 1)


_CHECKS: tuple[tuple[str, Any], ...] = (
    ("v", lambda v: _integer(v, 0, MAX_VERSION)),
    ("wall", lambda v: _number(v, 0.0, MAX_WALL)),
    ("mono", lambda v: _number(v, 0.0, MAX_MONO)),
    ("pid", lambda v: _integer(v, 1, MAX_ID)),
    ("node", lambda v: _optional_integer(v, 0, MAX_ID)),
    ("rank", lambda v: _optional_integer(v, 0, MAX_ID)),
    ("round", lambda v: _optional_integer(v, 0, MAX_ID)),
    ("host", _optional_text),
    ("boot", _optional_text),
    ("component", _optional_text),
    ("job", _job),
)


def _id_ok(value: Any) -> bool:
    return value is None or (type(value) is int and 0 <= value <= MAX_ID)


def _quick_ok(event: dict[str, Any]) -> bool:
    """The common case (a writer's own event), checked cheaply: millions are read."""
    wall, mono, pid, v = event.get("wall"), event.get("mono"), event.get("pid"), event.get("v")
    return (
        type(wall) is float
        and 0.0 <= wall <= MAX_WALL
        and type(mono) is float
        and 0.0 <= mono <= MAX_MONO
        and type(pid) is int
        and 0 < pid <= MAX_ID
        and type(v) is int
        and 0 <= v <= MAX_VERSION
        and _id_ok(event.get("node"))
        and _id_ok(event.get("rank"))
        and _id_ok(event.get("round"))
        and type(event.get("host")) is str
        and type(event.get("boot")) is str
        and type(event.get("component")) is str
        and type(event.get("job")) in (str, type(None))
    )


def common_field_problem(event: dict[str, Any]) -> str | None:
    """Why ``event``'s common fields cannot be used (naming the field), or None when they can."""
    if _quick_ok(event):
        return None
    for name, check in _CHECKS:
        if name in event:
            problem = check(event[name])
            if problem is not None:
                return f"bad common field {name!r}: {problem}"
    return None


def usable_event(value: Any) -> bool:
    """Whether a parsed JSON value is an event (an object with a text ``kind``) whose common
    fields can be used: what a reader keeps."""
    return type(value) is dict and type(value.get("kind")) is str and common_field_problem(value) is None


#: Common fields that change from event to event (raises KeyError where one is missing).
EVENT_FIELDS = itemgetter("kind", "wall", "mono", "round")
#: Common fields that one process's events share: v, pid, node, rank, host, boot, component, job.
PROCESS_FIELDS = itemgetter("v", "pid", "node", "rank", "host", "boot", "component", "job")


def usual_process_fields(fields: tuple[Any, ...]) -> bool:
    """Whether ``PROCESS_FIELDS`` of an event have the writer's own types and are in range."""
    v, pid, node, rank, host, boot, component, job = fields
    return (
        type(v) is int
        and 0 <= v <= MAX_VERSION
        and type(pid) is int
        and 0 < pid <= MAX_ID
        and _id_ok(node)
        and _id_ok(rank)
        and type(host) is str
        and type(boot) is str
        and type(component) is str
        and type(job) in (str, type(None))
    )


def all_usual(events: Iterable[Any]) -> bool:
    """Whether every value is an event with all its common fields present, of the writer's own
    types and in range (what ``_quick_ok`` accepts): then ``common_field_problem`` finds nothing.

    The check of a whole file's events at once, for millions of events: the fields one process's
    events share are checked again only where they differ from the previous event's (their
    types too: 1, 1.0 and true are equal). False says only that some event needs the full check.
    """
    seen: tuple[Any, ...] = ()
    try:
        for event in events:
            kind, wall, mono, rnd = EVENT_FIELDS(event)
            if not (
                type(wall) is float
                and 0.0 <= wall <= MAX_WALL
                and type(mono) is float
                and 0.0 <= mono <= MAX_MONO
                and type(kind) is str
                and (rnd is None or (type(rnd) is int and 0 <= rnd <= MAX_ID))
            ):
                return False
            fields = PROCESS_FIELDS(event)
            if (
                fields != seen
                or type(fields[0]) is not int
                or type(fields[1]) is not int
                or type(fields[2]) is not type(seen[2])
                or type(fields[3]) is not type(seen[3])
            ):
                if not usual_process_fields(fields):
                    return False
                seen = fields
    except (KeyError, TypeError):  # a common field missing, or a value that is not an object
        return False
    return True
