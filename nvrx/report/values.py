"""Event field values as the report needs them, whatever JSON type a writer gave them.

A kind's own fields are not checked when events are read (only the common
ones are), so a number may arrive as a string or a bool: these helpers turn
anything unusable into ``None`` instead of failing.
"""

from __future__ import annotations

import math
from typing import Any


def num(value: Any, default: float | None = None) -> float | None:
    """A finite number as float, else ``default`` (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    try:
        value = float(value)
    except OverflowError:  # an integer too large for a float
        return default
    return value if math.isfinite(value) else default


#: Longest span the report believes, in seconds (about 31 years); sums of such stay floats.
MAX_SECONDS = 1e9
#: Largest count (world size, attempt, exit code ...) the report believes.
MAX_COUNT = 2**31 - 1


def seconds(value: Any) -> float | None:
    """A duration in seconds: a number in 0..MAX_SECONDS, else None."""
    value = num(value)
    return value if value is not None and 0.0 <= value <= MAX_SECONDS else None


def count(value: Any) -> int | None:
    """An integer in -MAX_COUNT..MAX_COUNT (exit codes may be negative), else None."""
    value = as_int(value)
    return value if value is not None and -MAX_COUNT <= value <= MAX_COUNT else None


def as_int(value: Any) -> int | None:
    """An integer (or an integral float) as int, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def as_str(value: Any) -> str | None:
    """Text as text, a number as its text; anything else (a list, an object) is not text: None.

    (``str`` of an array nested a thousand deep would exceed the recursion limit.)
    """
    if isinstance(value, str):
        return value
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def int_list(value: Any) -> list[int] | None:
    """A list of integers (``node_lost``'s ranks), unusable items left out; not a list: None."""
    if not isinstance(value, list):
        return None
    return [n for n in map(as_int, value) if n is not None]


def flag(value: Any) -> bool | None:
    """A true/false value as written; anything else: None (unknown)."""
    return value if isinstance(value, bool) else None


def str_list(value: Any) -> list[str] | None:
    """A list of texts (a requeue's node names), unusable items left out; not a list: None."""
    if not isinstance(value, list):
        return None
    return [text for text in map(as_str, value) if text is not None]


def str_dict(value: Any) -> dict[str, str] | None:
    """An object of text values (SLURM's State/Reason), other values left out; else None."""
    if not isinstance(value, dict):
        return None
    return {str(k): text for k, v in value.items() if (text := as_str(v)) is not None}
