"""Finalize plug-ins: run after a fault was aborted and before the restart health check."""

from __future__ import annotations

import abc
import datetime
import math
import os
import threading
import time
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


#: The longest timeout taken, ten years: every wait stays far below the limit of Python's
#: clocks, locks and ``select`` (about 292 years, ``threading.TIMEOUT_MAX``), sums of
#: several timeouts included. A longer one is refused, never cut short.
MAX_SECONDS = 10 * 365 * 24 * 3600.0


def as_seconds(
    timeout: datetime.timedelta | float | int, name: str = "timeout", *, positive: bool = False
) -> float:
    """``timeout`` in seconds, from a timedelta or a number: finite, ``>= 0`` (``> 0`` with
    ``positive``) and at most ``MAX_SECONDS``, else ``ValueError`` naming ``name``, the
    constraint and the value (``TypeError`` for neither a timedelta nor a number)."""
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        try:
            seconds = float(timeout)
        except OverflowError:  # an int beyond any float
            seconds = math.inf
    else:
        raise TypeError(f"{name} must be a datetime.timedelta or seconds, got {timeout!r}")
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {seconds:g}")
    if seconds > MAX_SECONDS:
        raise ValueError(
            f"{name} must be at most {MAX_SECONDS:.0f} seconds (10 years), got {seconds:g}"
        )
    return seconds


#: Longest single wait of ``join_in_slices``: the main thread runs bytecode between two.
JOIN_SLICE_S = 0.5


def join_in_slices(thread: threading.Thread, timeout_s: float) -> None:
    """Join ``thread``, ``timeout_s`` seconds at most, in waits of ``JOIN_SLICE_S`` at most.

    One ``join`` blocks the calling thread in C: the progress watchdog's probe (a pending
    call, run only between bytecodes) would wait for its end, and between rounds the
    monitor process would end a rank whose plug-in is slow but within its own timeout
    once ``hard_timeout`` passed. Between the slices the probe runs.
    """
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and (left := deadline - time.monotonic()) > 0:
        thread.join(min(left, JOIN_SLICE_S))


def _rank_cuda_device() -> int | None:
    """This rank's CUDA device, only where CUDA is in use: ``LOCAL_RANK``'s, else the
    current one. Read in the calling thread: a new thread's current device is 0."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_initialized():
        return None
    local_rank = os.environ.get("LOCAL_RANK")
    return int(local_rank) if local_rank else torch.cuda.current_device()


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
        device = _rank_cuda_device()

        def run() -> None:
            try:
                if device is not None:
                    import torch

                    torch.cuda.set_device(device)
                self.fn(*self.args, **self.kwargs)
            except BaseException as exc:  # handed to the caller below
                failure.append(exc)

        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        thread = threading.Thread(target=run, name=f"ThreadedFinalize-{name}", daemon=True)
        thread.start()
        join_in_slices(thread, self._timeout_s)
        if thread.is_alive():
            raise exception.TimeoutError(
                f"ThreadedFinalize: {name} did not finish within {self._timeout_s:g} s"
            )
        if failure:
            raise failure[0]
        return state


__all__ = ["Finalize", "ThreadedFinalize"]
