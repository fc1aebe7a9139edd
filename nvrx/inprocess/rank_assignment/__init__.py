"""Rank assignment: after a fault, give the surviving ranks consecutive indices and pick active ones.

Every plug-in takes and returns a ``RankAssignmentCtx``. Assignments
(``ShiftRanks``, ``FillGaps``) renumber ranks around the terminated ones and
raise ``RankDiscarded`` on a terminated rank; filters (``ActivateAllRanks``,
``MaxActiveWorldSize``, ``ActiveWorldSizeDivisibleBy``) only decide which
ranks run the function. Compose them with ``Compose``, filters first in the
argument list (they run last). ``Tree`` does both from a topology and is used alone.
"""

from .base import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    MaxActiveWorldSize,
    RankAssignment,
    RankAssignmentCtx,
    RankDiscarded,
    RankFilter,
    ShiftRanks,
    assignment_wait_s,
    terminated_set,
)
from .grouped_filter import FilterCountGroupedByKey, FilterGroupedByKey
from .tree import Layer, LayerFlag, Tree

__all__ = [
    "ActivateAllRanks",
    "ActiveWorldSizeDivisibleBy",
    "FillGaps",
    "FilterCountGroupedByKey",
    "FilterGroupedByKey",
    "Layer",
    "LayerFlag",
    "MaxActiveWorldSize",
    "RankAssignment",
    "RankAssignmentCtx",
    "RankDiscarded",
    "RankFilter",
    "ShiftRanks",
    "assignment_wait_s",
    "Tree",
    "terminated_set",
]
