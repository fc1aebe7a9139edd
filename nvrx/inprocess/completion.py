"""Completion plug-in: runs on every rank after the wrapped function returned normally."""

from __future__ import annotations

import abc

from .state import FrozenState


class Completion(abc.ABC):
    """Base class of the Wrapper's ``completion`` argument: ``__call__(FrozenState) -> FrozenState``.

    Called once per wrapped call, after every rank finished the function
    successfully (for example to write a final marker or report success to an
    outer restarter). The Wrapper logs its errors and still returns the
    function's result.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError


__all__ = ["Completion"]
