"""Bounded waits on conditions for tests: never a fixed sleep that assumes a speed."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    what: str,
    condition: Callable[[], object],
    timeout: float,
    interval: float = 0.1,
    state: Callable[[], object] | None = None,
) -> None:
    """Poll ``condition()`` until it is true; AssertionError naming ``what`` after ``timeout`` s.

    For conditions outside the test process (a file another process writes, a
    job's state), where no blocking wait exists. ``state()``, when given, is
    added to the error: what was seen instead.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            seen = f"; last seen: {state()}" if state is not None else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{seen}")
        time.sleep(interval)
