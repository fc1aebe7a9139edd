"""Finalize plug-ins: run after a fault was aborted and before the restart health check."""

from __future__ import annotations

import abc
import datetime
import os
import threading
from collections.abc import Callable
from typing import Any

from . import exception
from .state import FrozenState


class Finalize(abc.ABC):
    """Base class of the Wrapper's ``finalize`` argument: ``__call__(FrozenState) -> FrozenState``.

    Brings the process into a state where the function can run again (reset
    globals, wait for asynchronous work). Raising ends this rank.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        raise NotImplementedError


def as_seconds(timeout: datetime.timedelta | float | int, name: str = "timeout") -> float:
    """``timeout`` in seconds; accepts a timedelta or a number, rejects negatives."""
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{name} must be a datetime.timedelta or seconds, got {timeout!r}")
    if seconds < 0:
        raise ValueError(f"{name} must not be negative, got {timeout!r}")
    return seconds


def _bind_cuda_device() -> None:
    """Select this rank's CUDA device in the calling thread, only where CUDA is in use."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_initialized():
        return
    local_rank = os.environ.get("LOCAL_RANK")
    torch.cuda.set_device(int(local_rank) if local_rank else torch.cuda.current_device())


class ThreadedFinalize(Finalize):
    """Run ``fn(*args, **kwargs)`` in a daemon thread and wait at most ``timeout`` for it.

    On timeout it raises ``exception.TimeoutError`` (the thread cannot be
    cancelled and keeps running); an exception from ``fn`` is re-raised here.
    Unlike the reference it works without CUDA: the CUDA device is selected in
    the thread only when CUDA is already initialized in this process.

    Args:
        timeout: how long to wait for ``fn`` (timedelta or seconds).
        fn: the callable to run.
        args: positional arguments of ``fn``.
        kwargs: keyword arguments of ``fn``.
    """

    def __init__(
        self,
        timeout: datetime.timedelta | float,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        self._timeout_s = as_seconds(timeout, "ThreadedFinalize timeout")
        if not callable(fn):
            raise TypeError(f"ThreadedFinalize fn must be callable, got {fn!r}")
        self.timeout = timeout
        self.fn = fn
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})

    def __call__(self, state: FrozenState) -> FrozenState:
        failure: list[BaseException] = []

        def run() -> None:
            try:
                _bind_cuda_device()
                self.fn(*self.args, **self.kwargs)
            except BaseException as exc:  # handed to the caller below
                failure.append(exc)

        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        thread = threading.Thread(target=run, name=f"ThreadedFinalize-{name}", daemon=True)
        thread.start()
        thread.join(self._timeout_s)
        if thread.is_alive():
            raise exception.TimeoutError(
                f"ThreadedFinalize: {name} did not finish within {self._timeout_s:g} s"
            )
        if failure:
            raise failure[0]
        return state


__all__ = ["Finalize", "ThreadedFinalize"]
