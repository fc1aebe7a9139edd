"""Terminate plug-in: runs on a rank that leaves the restart loop for good."""

from __future__ import annotations

import abc

from .state import FrozenState


class Terminate(abc.ABC):
    """Base class of the Wrapper's ``terminate`` argument: ``__call__(FrozenState) -> FrozenState``.

    Called on the exit path of a rank that stops (``RestartAbort``, a failed
    health check, a discarded rank, ``SystemExit``...), before the exception
    propagates out of the Wrapper. It sends no signals: it is the place to
    release resources or report the rank's end.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError


__all__ = ["Terminate"]
