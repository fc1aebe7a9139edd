"""Small helpers of the reference's ``inprocess.utils`` that code built on it imports."""

from __future__ import annotations

import os
from collections.abc import Iterable

from nvrx import jobenv


def format_rank_set_brief(ranks: Iterable[int]) -> str:
    """``{1-3, 5}``: runs of consecutive ranks as ranges."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return "{" + ", ".join(parts) + "}"


def format_rank_set_verbose(ranks: Iterable[int], head: int = 4, tail: int = 2) -> str:
    """``{0, 1, 2, 3...12, 13 (total: 14)}``: the first and last ranks and the count."""
    ordered = sorted(set(ranks))
    if len(ordered) <= head + tail:
        return "{" + ", ".join(map(str, ordered)) + "}"
    first = ", ".join(map(str, ordered[:head]))
    last = ", ".join(map(str, ordered[-tail:]))
    return f"{{{first}...{last} (total: {len(ordered)})}}"


def format_rank_set(ranks: Iterable[int]) -> str:
    """A set of ranks for a log line: brief ranges, or a listing when
    ``$NVRX_LOG_RANK_FORMAT_VERBOSE`` is set (not 0)."""
    if os.environ.get(jobenv.LOG_RANK_FORMAT_VERBOSE, "") not in ("", "0"):
        return format_rank_set_verbose(ranks)
    return format_rank_set_brief(ranks)


__all__ = ["format_rank_set", "format_rank_set_brief", "format_rank_set_verbose"]
