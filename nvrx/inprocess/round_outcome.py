"""How one restart round ended on this rank.

A round (``round_run.RoundRun``) ends in exactly one outcome, which the
restart loop of ``CallWrapper`` acts on:

* ``Completed``: every rank passed the completion barrier; the function's value;
* ``Restart``: a fault somewhere (this rank's ``fault``, if it raised one):
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
    """Every rank restarts; ``fault``: the exception this rank raised in the round, if any.

    Either this rank's own fault, or an exception that a peer's fault caused
    here (a collective failing once the monitor thread aborted the process
    groups; recorded as a ``peer`` fault); None when this rank raised nothing.
    ``signal``: the ``RankShouldRestart`` that ended the round here, the cause
    of an exception that ends the rank before the next round (as in the reference).
    """

    fault: BaseException | None
    signal: BaseException | None = None


@dataclasses.dataclass
class Leave:
    """This rank leaves the job because of ``exc``; ``recorded``: its fault is on record already."""

    exc: BaseException
    recorded: bool


Outcome = Completed | Restart | Leave
