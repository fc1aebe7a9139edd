"""How one restart round ended on this rank.

A round (``round_run.RoundRun``) ends in exactly one outcome, which the
restart loop of ``CallWrapper`` acts on:

* ``Completed``: every rank passed the completion barrier; the function's value;
* ``Restart``: a fault somewhere (this rank's own ``fault``, if it had one):
  every rank restarts;
* ``Leave``: this rank leaves the job because of ``exc`` (``RestartAbort``,
  ``RankDiscarded``, a failed health check, ``KeyboardInterrupt``...).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Completed:
    """The round completed on every rank; ``value`` is what the function returned (None on a spare)."""

    value: Any


@dataclasses.dataclass
class Restart:
    """Every rank restarts; ``fault`` is this rank's own exception, None when another rank faulted."""

    fault: BaseException | None


@dataclasses.dataclass
class Leave:
    """This rank leaves the job because of ``exc``; ``recorded``: its fault is on record already."""

    exc: BaseException
    recorded: bool


Outcome = Completed | Restart | Leave
