"""Initialize plug-ins: run at the start of every restart round, before the function."""

from __future__ import annotations

import abc

from .exception import RestartAbort
from .state import FrozenState


class Initialize(abc.ABC):
    """Base class of the Wrapper's ``initialize`` argument: ``__call__(FrozenState) -> FrozenState``.

    Runs at the start of every round, the first included. An ``Exception``
    restarts all ranks; a ``BaseException`` (e.g. ``RestartAbort``) ends this rank.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError


def _check_count(name: str, value: object, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an int >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"RetryController: {name} must be {expected}, got {value!r}")


class RetryController(Initialize):
    """Stop restarting when a limit is reached, by raising ``RestartAbort``.

    Args:
        max_iterations: most rounds (calls of the wrapped function) allowed;
            round ``max_iterations`` is refused. None: no limit.
        min_world_size: fewest healthy ranks (``state.world_size``) to go on with.
        min_active_world_size: fewest active ranks (``state.active_world_size``)
            to go on with.
    """

    def __init__(
        self,
        max_iterations: int | None = None,
        min_world_size: int = 1,
        min_active_world_size: int = 1,
    ) -> None:
        _check_count("max_iterations", max_iterations, 0, allow_none=True)
        _check_count("min_world_size", min_world_size, 1)
        _check_count("min_active_world_size", min_active_world_size, 1)
        self.max_iterations = max_iterations
        self.min_world_size = min_world_size
        self.min_active_world_size = min_active_world_size

    def __call__(self, state: FrozenState) -> FrozenState:
        active = state.world_size if state.active_world_size is None else state.active_world_size
        if state.world_size < self.min_world_size:
            self._abort(
                state,
                f"world_size {state.world_size} < min_world_size {self.min_world_size}: "
                "too few healthy ranks left to continue",
            )
        if active < self.min_active_world_size:
            self._abort(
                state,
                f"active_world_size {active} < min_active_world_size "
                f"{self.min_active_world_size}: too few active ranks left to continue",
            )
        if self.max_iterations is not None and state.iteration >= self.max_iterations:
            self._abort(
                state, f"iteration {state.iteration} reached max_iterations {self.max_iterations}"
            )
        return state

    def _abort(self, state: FrozenState, reason: str) -> None:
        """Raise ``RestartAbort``: the reference's ``name=value`` fields first, for callers
        that match them, then the reason."""
        fields = (
            f"state.iteration={state.iteration} self.max_iterations={self.max_iterations} "
            f"state.world_size={state.world_size} self.min_world_size={self.min_world_size} "
            f"state.active_world_size={state.active_world_size} "
            f"self.min_active_world_size={self.min_active_world_size} "
        )
        raise RestartAbort(f"{fields}- {reason}")

__all__ = ["Initialize", "RetryController"]
