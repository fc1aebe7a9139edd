"""Exception types of the in-process restart machinery.

``RestartError`` and its subclasses are ``Exception``\\ s: raised inside the
restart loop they stop this rank's participation in the current step, and the
Wrapper decides from the stage whether the rank restarts or leaves.
``RestartAbort`` is a ``BaseException`` so that ordinary ``except Exception``
handlers in training code cannot swallow a request to stop for good.
"""

from __future__ import annotations

import builtins


class RestartError(Exception):
    """Base class of errors raised by the restart machinery and its plug-ins."""


class RestartAbort(BaseException):
    """Stop restarting: the rank (or the whole job) leaves the restart loop for good.

    A process that exits because of it should return ``exit_code`` (130), which
    nvrx supervisors read as "stop the job, do not restart this process" (they exit 12).
    """

    CLEAN_EXIT_CODE = 130

    def __init__(self, *args: object, exit_code: int = CLEAN_EXIT_CODE) -> None:
        super().__init__(*args)
        self.exit_code = exit_code

    @staticmethod
    def behind(exc: BaseException) -> RestartAbort | None:
        """``exc`` when it is a ``RestartAbort``, else the one that caused it, where one did:
        a ``terminate`` plug-in that raises leaves the Wrapper with its own exception, caused
        by the one that ended the rank. None when no ``RestartAbort`` ended it."""
        seen: set[int] = set()
        current: BaseException | None = exc
        while current is not None and id(current) not in seen:
            if isinstance(current, RestartAbort):
                return current
            seen.add(id(current))
            current = current.__cause__
        return None


class HealthCheckError(RestartError):
    """A health check found this rank unfit to continue."""


class InternalError(RestartError):
    """The restart machinery itself failed (not the wrapped function)."""


class TimeoutError(RestartError, builtins.TimeoutError):  # noqa: A001 - reference name
    """An operation of the restart machinery ran past its time limit.

    Keeps the reference's name; unlike the reference it is also a builtin
    ``TimeoutError``, so ``except TimeoutError`` catches it whichever name is in scope.
    """

    def __init__(self, *args: object) -> None:
        # One message, never OSError's (errno, strerror) reading of two arguments.
        if len(args) > 1:
            args = (" ".join(str(a) for a in args),)
        super().__init__(*args)


__all__ = [
    "HealthCheckError",
    "InternalError",
    "RestartAbort",
    "RestartError",
    "TimeoutError",
]
