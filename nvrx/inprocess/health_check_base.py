"""The interface of a health check (``HealthCheck``), and how the Wrapper runs one."""

from __future__ import annotations

import abc

from . import exception
from .state import FrozenState


class HealthCheck(abc.ABC):
    """Base class of the Wrapper's ``health_check`` argument: ``__call__(FrozenState) -> FrozenState``.

    Runs locally on each rank after a fault was aborted and finalized (and at
    the start of each round). An unhealthy rank is reported by raising; the
    rank then leaves the job while the others go on.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError


def run_check(check: HealthCheck, state: FrozenState, what: str) -> None:
    """Run ``check`` for the Wrapper: its failure becomes a ``HealthCheckError`` that says ``what`` failed."""
    try:
        check(state)
    except Exception as exc:
        raise exception.HealthCheckError(f"{what}: {exc!r}") from exc
