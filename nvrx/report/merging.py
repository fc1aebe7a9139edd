"""One way to merge partial summaries: each field says how it combines.

Summaries of the report (a round, a failure signature, the whole job) are
built from many files, in any order and in several worker processes. Each of
their fields declares its merge rule (``merged(SUM)``, ``merged(UNION)``, ...)
and ``merge_fields`` applies them, so a summary's merge is written once, next
to its fields, and every part merges the same way wherever it is folded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# Merge rules, by what the field holds.
SUM = "sum"  # numbers: added
MIN = "min"  # optional numbers: the smaller (None counts as unknown)
MAX = "max"  # optional numbers: the larger
UNION = "union"  # sets: united
COUNTS = "counts"  # dict of numbers: added key by key
MAX_EACH = "max_each"  # dict of numbers: the larger, key by key
UNION_EACH = "union_each"  # dict of sets: united key by key
EXTEND = "extend"  # lists: concatenated
EXTEND_EACH = "extend_each"  # dict of lists: concatenated key by key
PARTS = "parts"  # dict of summaries: merged key by key (their own ``merge``)
KEEP = "keep"  # merged by the owner's own code (or not at all)

_FACTORIES: dict[str, Callable[[], Any]] = {
    UNION: set,
    COUNTS: dict,
    MAX_EACH: dict,
    UNION_EACH: dict,
    EXTEND: list,
    EXTEND_EACH: dict,
    PARTS: dict,
}


def merged(how: str, default: Any = None) -> Any:
    """A dataclass field merged by rule ``how`` (containers default to empty ones)."""
    meta = {"merge": how}
    if how in _FACTORIES:
        return dataclasses.field(default_factory=_FACTORIES[how], metadata=meta)
    if how == SUM and default is None:
        default = 0
    return dataclasses.field(default=default, metadata=meta)


def min_opt(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def max_opt(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _max_each(mine: dict[Any, float], theirs: dict[Any, float]) -> None:
    for key, value in theirs.items():
        if key not in mine or value > mine[key]:
            mine[key] = value


def _counts(mine: dict[Any, int], theirs: dict[Any, int]) -> None:
    for key, n in theirs.items():
        mine[key] = mine.get(key, 0) + n


def _union_each(mine: dict[Any, set[Any]], theirs: dict[Any, set[Any]]) -> None:
    for key, values in theirs.items():
        mine.setdefault(key, set()).update(values)


def _extend_each(mine: dict[Any, list[Any]], theirs: dict[Any, list[Any]]) -> None:
    for key, values in theirs.items():
        mine.setdefault(key, []).extend(values)


def _parts(mine: dict[Any, Any], theirs: dict[Any, Any]) -> None:
    for key, part in theirs.items():
        if key in mine:
            mine[key].merge(part)
        else:
            mine[key] = part


_IN_PLACE: dict[str, Callable[[Any, Any], None]] = {
    UNION: set.update,
    COUNTS: _counts,
    MAX_EACH: _max_each,
    UNION_EACH: _union_each,
    EXTEND: list.extend,
    EXTEND_EACH: _extend_each,
    PARTS: _parts,
}
_BY_VALUE: dict[str, Callable[[Any, Any], Any]] = {
    SUM: lambda a, b: a + b,
    MIN: min_opt,
    MAX: max_opt,
}


_PLANS: dict[type, list[tuple[str, Callable[[Any, Any], None] | None, Any]]] = {}


def _plan(cls: type) -> list[tuple[str, Callable[[Any, Any], None] | None, Any]]:
    """(field, in-place merge or None, by-value merge) per merged field of ``cls``, once."""
    plan = _PLANS.get(cls)
    if plan is None:
        plan = []
        for f in dataclasses.fields(cls):
            how = f.metadata.get("merge")
            if how is not None and how != KEEP:
                plan.append((f.name, _IN_PLACE.get(how), _BY_VALUE.get(how)))
        _PLANS[cls] = plan
    return plan


def merge_fields(target: Any, other: Any) -> None:
    """Fold ``other`` into ``target`` (same dataclass), field by field by its ``merged`` rule.

    ``other`` may hand its containers over to ``target``: do not use it afterwards.
    """
    mine, their = vars(target), vars(other)  # (a merge per file and round: no getattr)
    for name, in_place, by_value in _plan(type(target)):
        theirs = their[name]
        if in_place is not None:
            if theirs:
                in_place(mine[name], theirs)
        elif theirs is not None:  # an unknown (None) changes no MIN or MAX; sums are numbers
            mine[name] = by_value(mine[name], theirs)
